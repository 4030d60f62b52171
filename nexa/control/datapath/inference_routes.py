"""The inference routes, each declared once (`http.declare.Route`): method, path, roles, bodies,
headers, errors and description. `inference` serves them (plain ASGI: its own dispatch, not the
management app's router) and checks these roles; `http.openapi` describes them. No I/O here.
"""

from __future__ import annotations

from typing import Any, Final

from nexa.contracts.domain import Role
from nexa.contracts.gateway import (
    MAX_CHOICES,
    MAX_MODEL_CHARS,
    MAX_REQUEST_TOKENS,
    AnthropicError,
    Capability,
    OpenAIError,
    Priority,
    SignedReceipt,
    WorkloadCreate,
    WorkloadList,
    WorkloadView,
)
from nexa.contracts.wire import RuntimeMethod
from nexa.control.datapath.stored import STORED_ROUTES, StoredRoute
from nexa.control.http.declare import INFERENCE, PAGE_QUERY, Param, Route, RouteKey
from nexa.errors import (
    ApiNotServed,
    Cancelled,
    Conflict,
    DeadlineExceeded,
    FieldNotSupported,
    IdempotencyKeyReused,
    ModelNotServed,
    NoReadyReplica,
    NoReplicaForDataClass,
    NotFound,
    Overloaded,
    QueueFull,
    QuotaExceeded,
    ResponseNotFound,
    RetentionNotPermitted,
    RetentionUnavailable,
    RuntimeFailed,
    RuntimeRejected,
    StoredResponseLost,
    WorkloadAlreadyActive,
)

Json = dict[str, Any]

#: Optional request headers of the OpenAI routes: priority class and deadline.
PRIORITY_HEADER: Final = "x-nexa-priority"
DEADLINE_HEADER: Final = "x-nexa-deadline-ms"
#: Optional: the request's data class (as the envelope's `data_class`): only nodes allowed it serve it.
DATA_CLASS_HEADER: Final = "x-nexa-data-class"
#: Optional: the request's retention (as the envelope's `retention`): `ephemeral` or a policy's name.
RETENTION_HEADER: Final = "x-nexa-retention"
#: On every response of these routes: nexa's own time in it, in ms (`calls.overhead_ms`).
OVERHEAD_HEADER: Final = "x-nexa-overhead-ms"
#: A stored response's own routes, `STORED_ROUTES`' suffixes after it.
STORED_RULE: Final = "/v1/responses/<response_id>"

_SSE: Final = "text/event-stream"
_ANY_OBJECT: Final[Json] = {"type": "object"}
_OPENAI_MODELS: Final[Json] = {
    "type": "object",
    "properties": {
        "object": {"const": "list"},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "string"},
                    "object": {"const": "model"},
                    "created": {"type": "integer"},
                    "owned_by": {"type": "string"},
                },
                "required": ["id", "object", "created", "owned_by"],
            },
        },
    },
    "required": ["object", "data"],
}


def _openai_body(prompt: str, prompt_schema: Json, *, generates: bool) -> Json:
    """An OpenAI request body: free-form (passed to the runtime), with the fields the gateway checks."""
    props: Json = {
        "model": {"type": "string", "minLength": 1, "maxLength": MAX_MODEL_CHARS, "description": "an alias"},
        prompt: prompt_schema,
    }
    if generates:
        tokens = {"type": "integer", "minimum": 1, "maximum": MAX_REQUEST_TOKENS}
        props |= {
            "stream": {"type": "boolean", "default": False},
            "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
            "max_tokens": tokens,
            "max_completion_tokens": tokens,
            "n": {"type": "integer", "minimum": 1, "maximum": MAX_CHOICES},
        }
    return {"type": "object", "properties": props, "required": ["model", prompt], "additionalProperties": True}


_HEADERS: Final = (
    Param(name=PRIORITY_HEADER, schema=Priority, where="header", description="admission priority"),
    Param(
        name=DEADLINE_HEADER,
        schema={"type": "integer", "minimum": 1},
        where="header",
        description="milliseconds from now (at most the gateway's max_deadline_s)",
    ),
    Param(name=DATA_CLASS_HEADER, schema=str, where="header", description="only nodes allowed it serve it"),
    Param(
        name=RETENTION_HEADER,
        schema=str,
        where="header",
        description="ephemeral (default: nothing kept), or a retention policy the tenant may use",
    ),
)
_SERVING: Final = (
    ModelNotServed,
    Overloaded,
    QuotaExceeded,
    QueueFull,
    NoReadyReplica,
    NoReplicaForDataClass,
    RuntimeFailed,
    RuntimeRejected,
    DeadlineExceeded,
    FieldNotSupported,
    RetentionNotPermitted,
    RetentionUnavailable,
)


def _generate(path: str, summary: str, prompt: str, prompt_schema: Json, *, stream: bool) -> Route:
    """An OpenAI route that runs a prompt on a served model."""
    return Route(
        method="POST",
        path=path,
        roles=INFERENCE,
        summary=summary,
        tag="openai",
        body=_openai_body(prompt, prompt_schema, generates=stream),
        body_kind="required",
        answer=_ANY_OBJECT,
        also=(_SSE,) if stream else (),
        params=_HEADERS,
        errors=_SERVING,
    )


_WORKLOAD: Final = "/api/v1/workloads/<workload_id>"

_MODEL: Final[Json] = {"type": "string", "minLength": 1, "maxLength": MAX_MODEL_CHARS, "description": "an alias"}
_TEXTS: Final[Json] = {"type": ["string", "array"], "description": "a string or a list of them"}
_RERANK_BODY: Final[Json] = {
    "type": "object",
    "properties": {
        "model": _MODEL,
        "query": {"type": "string"},
        "documents": {"type": "array", "minItems": 1, "description": "strings (or the runtime's document objects)"},
        "top_n": {"type": "integer", "minimum": 0, "description": "the best n (0 or left out: all)"},
        "return_documents": {"type": "boolean"},
    },
    "required": ["model", "query", "documents"],
    "additionalProperties": True,
}
_SCORE_BODY: Final[Json] = {
    "type": "object",
    "properties": {"model": _MODEL, "text_1": _TEXTS, "text_2": _TEXTS},
    "required": ["model", "text_1", "text_2"],
    "additionalProperties": True,
}
_TOKENIZE_BODY: Final[Json] = {
    "type": "object",
    "properties": {
        "model": _MODEL,
        "prompt": {"type": "string", "description": "vLLM's: the text (or `messages`, a chat)"},
        "messages": {"type": "array", "items": {"type": "object"}},
        "add_special_tokens": {"type": "boolean"},
        "content": {"type": "string", "description": "llama.cpp's server's name for the text"},
    },
    "required": ["model"],
    "additionalProperties": True,
}
_DETOKENIZE_BODY: Final[Json] = {
    "type": "object",
    "properties": {
        "model": _MODEL,
        "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": MAX_REQUEST_TOKENS}},
    },
    "required": ["model", "tokens"],
    "additionalProperties": True,
}
#: The other paths vLLM serves its pooling APIs at (vllm/entrypoints/pooling: `/rerank`, `/v2/rerank`
#: for Cohere's v2 clients, `/score`), each served as its capability's own path.
CAPABILITY_ALIASES: Final = {"/rerank": Capability.RERANK, "/v2/rerank": Capability.RERANK, "/score": Capability.SCORE}


def _served(
    path: str,
    summary: str,
    body: Json,
    *,
    answer: Json = _ANY_OBJECT,
    media: str = "application/json",
    also: tuple[str, ...] = (),
    form: bool = False,
    error_shape: Any = None,
) -> Route:
    """A unary route passed only to a runtime whose adapter records serving its capability (rerank,
    score, the tokenizers, media: `Capability.gated`); 404 `api_not_served` when none does."""
    return Route(
        method="POST",
        path=path,
        roles=INFERENCE,
        summary=summary,
        tag="openai",
        body=body,
        body_kind="required",
        answer=answer,
        media=media,
        also=also,
        params=_HEADERS,
        errors=(*_SERVING, ApiNotServed),
        error_shape=error_shape,
        body_media="multipart/form-data" if form else "application/json",
    )


def _pooling(path: str, summary: str, body: Json) -> Route:
    """A rerank, score or tokenizer route; errors in OpenAI's shape outside /v1/ too, as vLLM answers there."""
    return _served(path, summary, body, error_shape=OpenAIError)


_POOLING_ROUTES: Final = (
    _pooling("/v1/rerank", "Rerank documents for a query (vLLM's, llama.cpp's and Cohere's shape)", _RERANK_BODY),
    _pooling("/rerank", "Rerank (the same as /v1/rerank)", _RERANK_BODY),
    _pooling("/v2/rerank", "Rerank, for Cohere v2 clients (the same as /v1/rerank)", _RERANK_BODY),
    _pooling("/v1/score", "Score text pairs (vLLM's shape)", _SCORE_BODY),
    _pooling("/score", "Score text pairs (the same as /v1/score)", _SCORE_BODY),
    _pooling("/tokenize", "Tokenize text with the model's tokenizer (the runtime's shape)", _TOKENIZE_BODY),
    _pooling("/detokenize", "Turn token ids back into text (the runtime's shape)", _DETOKENIZE_BODY),
)

_CONTENT: Final[Json] = {"type": ["string", "array"], "description": "a string, or a list of content blocks"}
_MESSAGES_BODY: Final[Json] = {
    "type": "object",
    "properties": {
        "model": {"type": "string", "minLength": 1, "maxLength": MAX_MODEL_CHARS, "description": "an alias"},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": MAX_REQUEST_TOKENS},
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {"role": {"enum": ["user", "assistant"]}, "content": _CONTENT},
                "required": ["role", "content"],
            },
        },
        "system": _CONTENT,
        "stream": {"type": "boolean", "default": False},
        "stop_sequences": {"type": "array", "items": {"type": "string", "minLength": 1}},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0},
        "tools": {"type": "array", "items": {"type": "object"}},
        "tool_choice": {"type": "object"},
        "metadata": {"type": "object"},
        "thinking": {"type": "object", "description": "only {type: disabled}: extended thinking does not translate"},
        "service_tier": {"enum": ["auto", "standard_only"]},
        "cache_control": {"type": "object", "description": "a prompt-caching hint: taken and ignored"},
    },
    "required": ["model", "max_tokens", "messages"],
    "additionalProperties": False,
}
_RESPONSES_BODY: Final[Json] = {
    "type": "object",
    "properties": {
        "model": {"type": "string", "minLength": 1, "maxLength": MAX_MODEL_CHARS, "description": "an alias"},
        "input": {"type": ["string", "array"], "description": "a string, or a list of input items"},
        "instructions": {"type": "string"},
        "stream": {"type": "boolean", "default": False},
        "stream_options": {"type": "object"},
        "max_output_tokens": {"type": "integer", "minimum": 1, "maximum": MAX_REQUEST_TOKENS},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "tools": {"type": "array", "items": {"type": "object"}, "description": "function tools only"},
        "tool_choice": {"type": ["string", "object"]},
        "parallel_tool_calls": {"type": "boolean"},
        "text": {"type": "object", "description": "format: text, json_object or json_schema"},
        "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
        "user": {"type": "string"},
        "safety_identifier": {"type": "string"},
        "prompt_cache_key": {"type": "string"},
        "service_tier": {"enum": ["auto", "default"]},
        "truncation": {"enum": ["disabled"]},
        "include": {"type": "array", "maxItems": 0},
        "store": {"type": "boolean", "description": "only false: no runtime here keeps a response"},
    },
    "required": ["model", "input"],
    "additionalProperties": False,
}
_COUNT_TOKENS_BODY: Final[Json] = {
    "type": "object",
    "properties": {k: _MESSAGES_BODY["properties"][k] for k in ("model", "messages", "system", "tools", "tool_choice")},
    "required": ["model", "messages"],
    "additionalProperties": True,
}
#: OpenAI's transcription and translation form (its API reference); other fields go to the runtime.
_AUDIO_FORM: Final[Json] = {
    "type": "object",
    "properties": {
        "file": {"type": "string", "format": "binary", "description": "the audio (a WAV is metered by its own length)"},
        "model": _MODEL,
        "language": {"type": "string"},
        "prompt": {"type": "string"},
        "response_format": {"enum": ["json", "verbose_json", "text", "srt", "vtt"], "default": "json"},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["file", "model"],
}
_SPEECH_BODY: Final[Json] = {
    "type": "object",
    "properties": {
        "model": _MODEL,
        "input": {"type": "string", "minLength": 1, "maxLength": 4096},
        "voice": {"type": ["string", "object"]},
        "instructions": {"type": "string"},
        "response_format": {"enum": ["mp3", "opus", "aac", "flac", "wav", "pcm"], "default": "mp3"},
        "speed": {"type": "number", "minimum": 0.25, "maximum": 4.0},
        "stream_format": {"enum": ["audio"]},
    },
    "required": ["model", "input", "voice"],
    "additionalProperties": True,
}
_IMAGE_BODY: Final[Json] = {
    "type": "object",
    "properties": {
        "model": _MODEL,
        "prompt": {"type": "string", "minLength": 1},
        "n": {"type": "integer", "minimum": 1, "maximum": 10, "default": 1},
        "size": {"type": "string"},
        "quality": {"type": "string"},
        "response_format": {"enum": ["url", "b64_json"]},
    },
    "required": ["model", "prompt"],
    "additionalProperties": True,
}
_TRANSCRIPT: Final[Json] = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
_IMAGES: Final[Json] = {
    "type": "object",
    "properties": {"created": {"type": "integer"}, "data": {"type": "array", "items": {"type": "object"}}},
    "required": ["data"],
}


_STORED_QUERY: Final = (
    Param(name="stream", schema={"enum": ["false"]}, description="only false: nexa routes no background response"),
)


def _stored(route: StoredRoute) -> Route:
    """A stored response's own route (`stored.STORED_ROUTES`): to the replica keeping it (vLLM serves
    retrieve and cancel), or refused with `api_not_served` saying what to do instead."""
    what = f"{route.sdk}: "
    what += (
        "passed to the replica keeping the stored response (counted as a request, metered in no tokens)"
        if route.served
        else f"not served ({route.instead})"
    )
    return Route(
        method=route.method.value,
        path=STORED_RULE + route.suffix,
        roles=INFERENCE,
        summary=f"Stored response (OpenAI's Responses API), {what}",
        tag="openai",
        body_kind="none",
        answer=_ANY_OBJECT,
        params=(
            (*_HEADERS, *(_STORED_QUERY if route.method is RuntimeMethod.GET and not route.suffix else ()))
            if route.served
            else ()
        ),
        errors=(*_SERVING, ResponseNotFound, StoredResponseLost) if route.served else (ResponseNotFound, ApiNotServed),
    )


_ANTHROPIC_HEADERS: Final = (
    Param(
        name="x-api-key",
        schema=str,
        where="header",
        description="the API key, as Anthropic's clients send it (Authorization: Bearer works too)",
    ),
    Param(name="anthropic-version", schema=str, where="header", description="accepted, not checked"),
)

#: Every inference route, declared once.
ROUTES: Final[tuple[Route, ...]] = (
    Route(
        method="GET",
        path="/v1/models",
        roles=INFERENCE,
        summary="Served models (OpenAI)",
        tag="openai",
        answer=_OPENAI_MODELS,
    ),
    _generate(
        "/v1/chat/completions",
        "Chat completion (OpenAI)",
        "messages",
        {"type": "array", "items": {"type": "object"}, "minItems": 1},
        stream=True,
    ),
    _generate("/v1/completions", "Completion (OpenAI)", "prompt", {"type": ["string", "array"]}, stream=True),
    _generate("/v1/embeddings", "Embeddings (OpenAI)", "input", {"type": ["string", "array"]}, stream=False),
    Route(
        method="POST",
        path="/v1/messages",
        roles=INFERENCE,
        summary=(
            "Message (Anthropic's Messages API: passed through to runtimes that serve it, else translated to a"
            " chat completion; errors in Anthropic's shape)"
        ),
        tag="anthropic",
        body=_MESSAGES_BODY,
        body_kind="required",
        answer=_ANY_OBJECT,
        also=(_SSE,),
        params=(*_ANTHROPIC_HEADERS, *_HEADERS),
        errors=_SERVING,
        error_shape=AnthropicError,
    ),
    Route(
        method="POST",
        path="/v1/messages/count_tokens",
        roles=INFERENCE,
        summary="Count a message's tokens (Anthropic's; passed through to runtimes that serve it, else 404)",
        tag="anthropic",
        body=_COUNT_TOKENS_BODY,
        body_kind="required",
        answer={"type": "object", "properties": {"input_tokens": {"type": "integer"}}, "required": ["input_tokens"]},
        params=(*_ANTHROPIC_HEADERS, *_HEADERS),
        errors=(*_SERVING, NotFound, ApiNotServed),
        error_shape=AnthropicError,
    ),
    Route(
        method="POST",
        path="/v1/responses",
        roles=INFERENCE,
        summary=(
            "Response (OpenAI's Responses API: passed through to runtimes that serve it, else translated to a"
            " chat completion; previous_response_id goes to the replica keeping it, where one does)"
        ),
        tag="openai",
        body=_RESPONSES_BODY,
        body_kind="required",
        answer=_ANY_OBJECT,
        also=(_SSE,),
        params=_HEADERS,
        errors=(*_SERVING, ResponseNotFound, StoredResponseLost),
    ),
    *(_stored(route) for route in STORED_ROUTES),
    *_POOLING_ROUTES,
    _served(
        "/v1/audio/transcriptions",
        "Transcription (OpenAI): an audio upload to text; metered in seconds of audio",
        _AUDIO_FORM,
        answer=_TRANSCRIPT,
        also=("text/plain", "text/vtt"),
        form=True,
    ),
    _served(
        "/v1/audio/translations",
        "Translation (OpenAI): an audio upload to English text; metered in seconds of audio",
        _AUDIO_FORM,
        answer=_TRANSCRIPT,
        also=("text/plain", "text/vtt"),
        form=True,
    ),
    _served(
        "/v1/audio/speech",
        "Speech (OpenAI): text to audio, streamed back as it is made; metered in characters",
        _SPEECH_BODY,
        answer={"type": "string", "format": "binary"},
        media="audio/mpeg",
        also=("audio/ogg", "audio/aac", "audio/flac", "audio/wav", "audio/pcm"),
    ),
    _served("/v1/images/generations", "Image generation (OpenAI); metered in images", _IMAGE_BODY, answer=_IMAGES),
    Route(
        method="POST",
        path="/api/v1/workloads",
        roles=INFERENCE,
        summary="Run a workload (the nexa.v1 envelope)",
        tag="workloads",
        body=WorkloadCreate,
        body_kind="required",
        answer=WorkloadView,
        also=(_SSE,),
        errors=(*_SERVING, IdempotencyKeyReused, WorkloadAlreadyActive, Cancelled),
    ),
    Route(
        method="GET",
        path="/api/v1/workloads",
        roles=INFERENCE,
        summary="Your tenant's workloads, oldest first",
        tag="workloads",
        answer=WorkloadList,
        params=PAGE_QUERY,
    ),
    Route(
        method="GET",
        path=_WORKLOAD,
        roles=INFERENCE,
        summary="A workload's state",
        tag="workloads",
        answer=WorkloadView,
    ),
    Route(
        method="POST",
        path=_WORKLOAD + "/cancel",
        roles=INFERENCE,
        summary="Cancel a workload",
        tag="workloads",
        answer=WorkloadView,
        status=202,
    ),
    Route(
        method="GET",
        path=_WORKLOAD + "/receipt",
        roles=INFERENCE,
        summary="A finished workload's signed receipt",
        tag="workloads",
        answer=SignedReceipt,
        errors=(Conflict,),
    ),
)

#: Every inference route and the roles that may call it (the management routes: `http.resources.ROLES`).
INFERENCE_ROUTES: Final[dict[RouteKey, frozenset[Role]]] = {r.key: r.roles for r in ROUTES if r.roles is not None}

#: What every answer of the inference routes carries (`inference._Exchange` writes every one).
RESPONSE_HEADERS: Final[Json] = {
    OVERHEAD_HEADER: {
        "description": (
            "nexa's own time in this response, in ms (two decimals): the controller's time from the"
            " request's arrival to this response head, less admission queueing and the time it waited"
            " for the node's answer (a stream: its first output; otherwise the whole answer), plus the"
            " node's own time outside the runtime. A stream's figure is the overhead up to its first byte."
        ),
        "schema": {"type": "string", "pattern": r"^[0-9]+\.[0-9]{2}$"},
    },
}
