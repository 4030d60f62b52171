"""OpenAI's Responses API (`POST /v1/responses`) translated to and from chat completions. Pure: no I/O.

`to_chat` checks a Responses request and makes the chat-completions body a runtime that serves only
chat completions answers: `input` (a string, or items: messages with `input_text`/`input_image`
content, `function_call` and `function_call_output` items), `instructions` (the system prompt),
function `tools`, `tool_choice`, `parallel_tool_calls`, `max_output_tokens`, `temperature`,
`top_p`, `text.format` (`json_schema`, `json_object`: the chat `response_format`). Server-side state
(`store: true`, `previous_response_id`, `conversation`, `background`) is refused naming the field,
as no runtime here keeps it, and so is what does not map (built-in tools, reasoning, files, unknown
fields): never dropped. `to_response` makes the Response object from a unary chat completion;
`Events` turns a chat-completions stream into the Responses event grammar (`response.created`,
`response.in_progress`, `response.output_item.added`, `response.content_part.added`,
`response.output_text.delta`/`.done`, `response.content_part.done`,
`response.function_call_arguments.delta`/`.done`, `response.output_item.done`, then
`response.completed` or `response.incomplete`), each with its `sequence_number`, and ends it with
an `error` event and `response.failed` when the runtime's stream fails or does not translate.

Status: a `length` finish is `incomplete` (`incomplete_details.reason` `max_output_tokens`), a
`content_filter` one `incomplete` (`content_filter`), anything else `completed`. Usage is
`input_tokens`/`output_tokens`. Errors are OpenAI's shape (the other `/v1` routes'), `param` naming
the field. Nothing here logs or keeps a payload.
"""

from __future__ import annotations

import time
from typing import Any, Final

import attrs

from nexa.contracts.gateway import MAX_REQUEST_TOKENS, Capability, body_problems, model_problem
from nexa.control.datapath.calls import Progress
from nexa.control.datapath.translation import (
    ChatEvents,
    number,
    read_answer,
    refuse,
    sse,
    unsupported,
    whole,
)
from nexa.control.http.common import status_for
from nexa.errors import ContractError, NexaError

Json = dict[str, Any]

RESPONSES_PATH: Final = "/v1/responses"
#: Fields of a Responses request this translation reads; any other is refused by name.
_KNOWN: Final = frozenset(
    {
        "model",
        "input",
        "instructions",
        "stream",
        "stream_options",
        "max_output_tokens",
        "temperature",
        "top_p",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "metadata",
        "user",
        "safety_identifier",
        "prompt_cache_key",
        "service_tier",
        "truncation",
        "include",
        # Refused unless empty (the server-side state and what does not map):
        "store",
        "previous_response_id",
        "conversation",
        "background",
        "prompt",
        "reasoning",
        "top_logprobs",
        "max_tool_calls",
    }
)
#: Server-side state no runtime here keeps: refused when set.
_STATE: Final = ("previous_response_id", "conversation", "prompt", "reasoning", "top_logprobs", "max_tool_calls")
#: Input items of OpenAI's built-in tools and state, which a chat completion cannot carry.
_HOSTED_ITEMS: Final = frozenset(
    {
        "reasoning",
        "item_reference",
        "web_search_call",
        "file_search_call",
        "computer_call",
        "computer_call_output",
        "image_generation_call",
        "code_interpreter_call",
        "local_shell_call",
        "local_shell_call_output",
        "shell_call",
        "shell_call_output",
        "apply_patch_call",
        "apply_patch_call_output",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "mcp_call",
        "custom_tool_call",
        "custom_tool_call_output",
        "compaction",
    }
)
_ROLES: Final = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TOOL_CHOICES: Final = ("auto", "none", "required")
_INCOMPLETE: Final = {"length": "max_output_tokens", "content_filter": "content_filter"}
_OPENAI_TYPES: Final = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


@attrs.frozen(kw_only=True)
class Request:
    """A checked Responses request: what the gateway runs (`chat`), and what its answer echoes."""

    model: str
    stream: bool
    #: The chat-completions body (without `model` and `stream`).
    chat: Json
    #: Echoed in the Response object, as OpenAI does.
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: tuple[Json, ...] = ()
    tool_choice: object = "auto"
    parallel_tool_calls: bool = True
    text: Json = attrs.field(factory=lambda: {"format": {"type": "text"}})
    metadata: Json = attrs.field(factory=dict)


def to_chat(body: Json) -> Request:
    """The checked request and its chat-completions body; ContractError (400) naming what is wrong."""
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise refuse(unknown[0], "not a Responses API field this gateway takes")
    model = body.get("model")
    problem = model_problem(model)
    if problem is not None or not isinstance(model, str):
        raise refuse("model", problem or "required")
    _state(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise refuse("stream", "true or false")
    if (options := body.get("stream_options")) is not None and (not stream or not isinstance(options, dict)):
        raise refuse("stream_options", "an object, only with stream: true")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise refuse("instructions", "a string")
    messages: list[Json] = [{"role": "system", "content": instructions}] if instructions else []
    messages += _input(body.get("input"))
    chat: Json = {"messages": messages}
    chat |= _options(body)
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    text = _text(body.get("text"))
    metadata = _ignored(body)
    if problems := body_problems(Capability.CHAT, chat):  # what every chat completion is checked for
        raise ContractError("invalid request: " + "; ".join(problems), problems=tuple(problems))
    return Request(
        model=model,
        stream=stream,
        chat=chat,
        instructions=instructions,
        max_output_tokens=body.get("max_output_tokens"),
        temperature=body.get("temperature"),
        top_p=body.get("top_p"),
        tools=tuple(tools),
        tool_choice=choice if choice is not None else "auto",
        parallel_tool_calls=parallel if parallel is not None else True,
        text=text,
        metadata=metadata,
    )


def _options(body: Json) -> Json:
    """The chat body's fields besides its messages: length, sampling, tools, the answer's format."""
    chat: Json = {}
    limit = body.get("max_output_tokens")
    if limit is not None:
        if not whole(limit, 1, MAX_REQUEST_TOKENS):
            raise refuse("max_output_tokens", f"an integer from 1 to {MAX_REQUEST_TOKENS}")
        chat["max_tokens"] = limit
    for name, high in (("temperature", 2.0), ("top_p", 1.0)):
        if (value := body.get(name)) is not None:
            if not number(value, 0.0, high):
                raise refuse(name, f"a number from 0 to {high:g}")
            chat[name] = value
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = [_function(t) for t in tools]
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"] = _tool_choice(choice, has_tools=bool(tools))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise refuse("parallel_tool_calls", "true or false")
        chat["parallel_tool_calls"] = parallel
    text = _text(body.get("text"))
    if (fmt := _response_format(text["format"])) is not None:
        chat["response_format"] = fmt
    return chat


def _state(body: Json) -> None:
    """Refuse what needs state a runtime here does not keep (stored responses, conversations)."""
    if body.get("store") is True:
        raise unsupported("store", "store: true (a stored response: no runtime here keeps one; send store: false)")
    if body.get("store") not in (None, False):
        raise refuse("store", "true or false")
    if body.get("background") not in (None, False):
        raise unsupported("background", "background: true (needs a stored response)")
    for name in _STATE:
        if body.get(name) is not None:
            raise unsupported(name, f"{name} (state or a feature no runtime here keeps)")


def _ignored(body: Json) -> Json:
    """Check the fields that change nothing the runtime does; the metadata echoed."""
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise refuse("metadata", "an object of strings")
    for name in ("user", "safety_identifier", "prompt_cache_key"):
        if body.get(name) is not None and not isinstance(body.get(name), str):
            raise refuse(name, "a string")
    if body.get("service_tier") not in (None, "auto", "default"):
        raise unsupported("service_tier", "a service tier other than auto or default")
    if body.get("truncation") not in (None, "disabled"):
        raise unsupported("truncation", "truncation other than disabled")
    include = body.get("include")
    if include is not None and not isinstance(include, list):
        raise refuse("include", "a list")
    if include:
        raise unsupported("include", "extra output data (include)")
    return dict(metadata or {})


def _input(value: object) -> list[Json]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise refuse("input", "a string, or a list of input items, not empty")
    out: list[Json] = []
    for i, item in enumerate(value):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise refuse(at, "an input item object")
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, at))
        elif kind == "function_call":
            _function_call(out, item, at)
        elif kind == "function_call_output":
            out.append(_call_output(item, at))
        elif isinstance(kind, str) and kind in _HOSTED_ITEMS:
            raise unsupported(f"{at}.type", f"a {kind} item")
        else:
            raise refuse(f"{at}.type", "message, function_call or function_call_output")
    return out


def _message(item: Json, at: str) -> Json:
    extra = sorted(set(item) - {"type", "role", "content", "id", "status", "phase"})  # as output messages echo
    if extra:
        raise refuse(f"{at}.{extra[0]}", "not a message field (role, content)")
    role = _ROLES.get(str(item.get("role")))
    if role is None:
        raise refuse(f"{at}.role", "user, assistant, system or developer")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise refuse(f"{at}.content", "a string or a list of content parts")
    parts = [_part(part, f"{at}.content[{j}]", role) for j, part in enumerate(content)]
    if role != "user":  # the chat API's system and assistant messages take text
        return {"role": role, "content": "".join(p["text"] for p in parts)}
    return {"role": role, "content": parts}


def _part(part: object, at: str, role: str) -> Json:
    kind = part.get("type") if isinstance(part, dict) else None
    if not isinstance(part, dict):
        raise refuse(at, "a content part object")
    texts = ("output_text", "refusal") if role == "assistant" else ("input_text",)
    if kind in texts:
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise refuse(f"{at}.text", "a string")
        return {"type": "text", "text": text}
    if kind == "input_image" and role == "user":
        url, detail = part.get("image_url"), part.get("detail")
        if part.get("file_id") is not None:
            raise unsupported(f"{at}.file_id", "an image by file id (the Files API)")
        if not isinstance(url, str) or not url:
            raise refuse(f"{at}.image_url", "the image's URL or data: URL")
        image: Json = {"url": url}
        if detail is not None:
            if detail not in ("auto", "low", "high"):
                raise refuse(f"{at}.detail", "auto, low or high")
            image["detail"] = detail
        return {"type": "image_url", "image_url": image}
    if kind in ("input_file", "input_audio"):
        raise unsupported(f"{at}.type", f"an {kind} part")
    raise refuse(f"{at}.type", " or ".join((*texts, "input_image") if role == "user" else texts))


def _function_call(out: list[Json], item: Json, at: str) -> None:
    """A `function_call` item: a tool call on the assistant message before it (made when there is none)."""
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    if not (isinstance(call_id, str) and call_id and isinstance(name, str) and name and isinstance(arguments, str)):
        raise refuse(at, "a function_call item has a call_id, a name and arguments (a JSON text)")
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    if not out or out[-1]["role"] != "assistant":
        out.append({"role": "assistant", "content": None})
    out[-1].setdefault("tool_calls", []).append(call)


def _call_output(item: Json, at: str) -> Json:
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str) or not call_id:
        raise refuse(f"{at}.call_id", "the call_id of the function_call it answers")
    if isinstance(output, list):
        output = "".join(_part(p, f"{at}.output[{j}]", "tool")["text"] for j, p in enumerate(output))
    if not isinstance(output, str):
        raise refuse(f"{at}.output", "a string or a list of input_text parts")
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def _tools(tools: object) -> list[Json]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise refuse("tools", "a list of tools")
    out = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or not isinstance(kind, str):
            raise refuse(at, "a tool object with a type")
        if kind != "function":
            raise unsupported(f"{at}.type", f"the built-in tool {kind!r}")
        name, schema, description = tool.get("name"), tool.get("parameters"), tool.get("description")
        if not isinstance(name, str) or not name or not isinstance(schema, dict | None):
            raise refuse(at, "a function tool has a name and a parameters object")
        if description is not None and not isinstance(description, str):
            raise refuse(f"{at}.description", "a string")
        if tool.get("strict") not in (None, True, False):
            raise refuse(f"{at}.strict", "true or false")
        out.append(tool)
    return out


def _function(tool: Json) -> Json:
    function: Json = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object"}}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    if isinstance(tool.get("strict"), bool):
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _tool_choice(choice: object, *, has_tools: bool) -> object:
    if choice in _TOOL_CHOICES:
        if choice != "none" and not has_tools:
            raise refuse("tool_choice", "needs tools")
        return choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or not isinstance(kind, str):
        raise refuse("tool_choice", "auto, none, required, or {type: function, name}")
    if kind != "function":
        raise unsupported("tool_choice", f"a {kind} tool choice")
    name = choice.get("name")
    if not isinstance(name, str) or not name or not has_tools:
        raise refuse("tool_choice.name", "the name of an offered function tool")
    return {"type": "function", "function": {"name": name}}


def _text(text: object) -> Json:
    if text is None:
        return {"format": {"type": "text"}}
    if not isinstance(text, dict) or sorted(set(text) - {"format", "verbosity"}):
        raise refuse("text", "an object with a format")
    if text.get("verbosity") is not None:
        raise unsupported("text.verbosity", "a verbosity")
    fmt = text.get("format") or {"type": "text"}
    if not isinstance(fmt, dict):
        raise refuse("text.format", "an object")
    return {"format": fmt}


def _response_format(fmt: Json) -> Json | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise refuse("text.format.type", "text, json_schema or json_object")
    name, schema = fmt.get("name"), fmt.get("schema")
    if not isinstance(name, str) or not name or not isinstance(schema, dict):
        raise refuse("text.format", "a json_schema format has a name and a schema object")
    json_schema: Json = {"name": name, "schema": schema}
    for key, kinds in (("description", str), ("strict", bool)):
        if (value := fmt.get(key)) is not None:
            if not isinstance(value, kinds):
                raise refuse(f"text.format.{key}", "a " + kinds.__name__)
            json_schema[key] = value
    return {"type": "json_schema", "json_schema": json_schema}


# ---- answers ------------------------------------------------------------------------------------


def response_id(request_id: str) -> str:
    return "resp_" + request_id.removeprefix("req_")


def status_of(finish: object) -> tuple[str, Json | None]:
    """The Response's `status` and `incomplete_details` for a chat choice's `finish_reason`."""
    reason = _INCOMPLETE.get(finish) if isinstance(finish, str) else None
    return ("incomplete", {"reason": reason}) if reason else ("completed", None)


def _usage(input_tokens: int, output_tokens: int) -> Json:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def _response(req: Request, request_id: str, created: float, status: str, output: list[Json], **rest: Any) -> Json:
    return {
        "id": response_id(request_id),
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "error": rest.get("error"),
        "incomplete_details": rest.get("incomplete"),
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata,
        "model": req.model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": None,
        "reasoning": None,
        "service_tier": "default",
        "store": False,
        "temperature": req.temperature,
        "text": req.text,
        "tool_choice": req.tool_choice,
        "tools": list(req.tools),
        "top_p": req.top_p,
        "truncation": "disabled",
        "usage": rest.get("usage"),
    }


def _part_of(text: str) -> Json:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(request_id: str, content: list[Json], status: str) -> Json:
    ident = "msg_" + request_id.removeprefix("req_")
    return {"id": ident, "type": "message", "role": "assistant", "status": status, "content": content}


def _call_item(request_id: str, index: int, call_id: str | None, name: str, arguments: str, *, status: str) -> Json:
    return {
        "id": f"fc_{request_id.removeprefix('req_')}_{index}",
        "type": "function_call",
        "call_id": call_id or f"call_{request_id.removeprefix('req_')}_{index}",
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def to_response(answer: Json | None, req: Request, request_id: str, progress: Progress) -> Json:
    """The Response object for a checked unary chat completion (`calls.Answer.answer`); the call's
    token counts (`progress`, as metered) when the answer carries no usage. An answer that does not
    translate is RuntimeFailed, and the call's status (what is metered) says so."""
    reply = read_answer(answer, progress)
    status, incomplete = status_of(reply.finish)
    output = [_message_item(request_id, [_part_of(reply.text)], status)] if reply.text else []
    for i, call in enumerate(reply.calls):
        output.append(_call_item(request_id, i, call.id, call.name, call.arguments, status="completed"))
    usage = _usage(*reply.usage)
    return _response(req, request_id, time.time(), status, output, incomplete=incomplete, usage=usage)


def error_object(exc: NexaError, request_id: str, param: str | None) -> Json:
    """nexa's error in OpenAI's error object (`{"message", "type", "param", "code"}`), typed by status."""
    status = status_for(exc)
    kind = _OPENAI_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"message": f"{exc.message} (request {request_id})", "type": kind, "param": param, "code": exc.code}


class Events(ChatEvents):
    """A chat-completions stream (`translation.ChatEvents`) as the Responses event grammar: `start`
    writes `response.created` and `response.in_progress`; each text is a `message` output item with
    one `output_text` part, each tool call a `function_call` item; `end` writes `response.completed`
    (or `response.incomplete`), or an `error` event and `response.failed`."""

    def __init__(self, req: Request, request_id: str) -> None:
        super().__init__(request_id)
        self._req = req
        self._created = time.time()
        self._seq = -1
        #: The finished output items, and the open one (at index `len(self._output)`).
        self._output: list[Json] = []
        self._item: Json = {}

    def start(self) -> bytes:
        snapshot = _response(self._req, self._rid, self._created, "in_progress", [])
        return self._emit("response.created", response=snapshot) + self._emit("response.in_progress", response=snapshot)

    def _emit(self, kind: str, **data: Any) -> bytes:
        self._seq += 1
        return sse(kind, {"type": kind, "sequence_number": self._seq, **data})

    def _at(self) -> Json:
        return {"item_id": self._item["id"], "output_index": len(self._output)}

    def _begin_text(self) -> list[bytes]:
        self._item = _message_item(self._rid, [], "in_progress")
        if self._output:  # a second message item (text after a tool call) gets its own id
            self._item["id"] += f"_{len(self._output)}"
        added = self._emit("response.output_item.added", output_index=len(self._output), item=self._item)
        part = self._emit("response.content_part.added", **self._at(), content_index=0, part=_part_of(""))
        return [added, part]

    def _text(self, text: str) -> list[bytes]:
        return [self._emit("response.output_text.delta", **self._at(), content_index=0, delta=text, logprobs=[])]

    def _begin_tool(self, index: int, ident: str | None, name: str) -> list[bytes]:
        self._item = _call_item(self._rid, index, ident, name, "", status="in_progress")
        return [self._emit("response.output_item.added", output_index=len(self._output), item=self._item)]

    def _arguments(self, piece: str) -> list[bytes]:
        return [self._emit("response.function_call_arguments.delta", **self._at(), delta=piece)]

    def _end_block(self, tool: bool, whole: str) -> list[bytes]:
        at = self._at()
        if tool:
            name = self._item["name"]
            out = [self._emit("response.function_call_arguments.done", **at, arguments=whole, name=name)]
            self._item = self._item | {"arguments": whole or "{}", "status": "completed"}
        else:
            part = _part_of(whole)
            out = [
                self._emit("response.output_text.done", **at, content_index=0, text=whole, logprobs=[]),
                self._emit("response.content_part.done", **at, content_index=0, part=part),
            ]
            self._item = self._item | {"content": [part], "status": status_of(self.finish)[0]}
        out.append(self._emit("response.output_item.done", output_index=len(self._output), item=self._item))
        self._output.append(self._item)
        return out

    def _last(self, prompt: int, completion: int) -> list[bytes]:
        status, incomplete = status_of(self.finish)
        usage = _usage(prompt, completion)
        final = _response(self._req, self._rid, self._created, status, self._output, incomplete=incomplete, usage=usage)
        return [self._emit("response.completed" if status == "completed" else "response.incomplete", response=final)]

    def _error(self, exc: NexaError) -> bytes:
        error = error_object(exc, self._rid, None)
        failed = _response(
            self._req,
            self._rid,
            self._created,
            "failed",
            self._output,
            error={"code": exc.code, "message": error["message"]},
        )
        event = self._emit("error", code=exc.code, message=error["message"], param=None)
        return event + self._emit("response.failed", response=failed)
