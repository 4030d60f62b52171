"""Anthropic's Messages API, OpenAI's Responses API and Anthropic's token count passed through as
they are to runtimes that serve them natively (vLLM: `Adapter.native_apis`), instead of being
translated to chat completions (`translated`).

The gateway passes a request through when every Ready replica of its model serves the API itself
(`Gateway.passes_through`); the body goes unchanged but for `model` (the served model's name, as
every call) and `stream`, and the answer comes back as the runtime made it, checked on the way
(`answers.unary_answer`, `answers.check_native_event`), with nexa's metering reading its usage in
the API's own names (`input_tokens`, `output_tokens`). What nexa does not do for a native runtime
is refused by name: a Responses API request that continues a stored response or conversation
(`previous_response_id`, `conversation`) or runs in the background, since routing is not pinned to
the replica that keeps it. A failure after a stream opened ends it with the API's own error event.
Nothing here reads or logs a payload beyond those fields.
"""

from __future__ import annotations

from typing import Any, Final, NamedTuple, Protocol

from nexa.adapters.vllm import VLLM
from nexa.contracts import codec
from nexa.contracts.gateway import Api, Capability, body_problems, model_problem
from nexa.control.datapath import messages, responses
from nexa.control.datapath.gateway import Call, Gateway
from nexa.control.datapath.translation import sse
from nexa.errors import ContractError, FieldNotSupported, NexaError, NotFound

Json = dict[str, Any]

#: The native API of each translated route, and of the token count.
NATIVE: Final = {
    messages.MESSAGES_PATH: Capability.MESSAGES,
    responses.RESPONSES_PATH: Capability.RESPONSES,
    messages.COUNT_TOKENS_PATH: Capability.MESSAGE_TOKENS,
}
#: Responses API fields that need the replica keeping a stored response: refused on pass-through.
_STATEFUL: Final = ("previous_response_id", "conversation", "background")


class Exchange(Protocol):
    """What `serve` answers through (`inference._Exchange`)."""

    @property
    def rid(self) -> str: ...
    async def raw(self, status: int, payload: bytes, content_type: bytes) -> int: ...
    async def start_stream(self, status: int) -> None: ...
    async def chunk(self, data: bytes, *, more: bool = True) -> None: ...


def stateful_problem(capability: Capability, body: Json) -> None:
    """Refuse (FieldNotSupported) what routing would need a stored response's replica for."""
    if capability is not Capability.RESPONSES:
        return
    for name in _STATEFUL:
        if body.get(name) not in (None, False):
            raise FieldNotSupported(
                f"{name}: stored responses are not routed to the replica that keeps them here; send the whole"
                " conversation as input items instead",
                field=name,
            )


async def serve(x: Exchange, call: Call, capability: Capability, *, stream: bool) -> int:
    """Run `call` and pass its answer on as the runtime made it; the status answered."""
    async with call as answer:
        if not stream:
            body = await answer.read_all()
            if answer.error is not None:
                raise answer.error
            return await x.raw(200, body, b"application/json")
        await x.start_stream(200)
        async for chunk in answer:
            await x.chunk(chunk)
        await x.chunk(b"" if answer.error is None else error_event(capability, answer.error, x.rid), more=False)
        return 200


def error_event(capability: Capability, exc: NexaError, request_id: str) -> bytes:
    """The API's own event for a failure after its stream opened."""
    if capability is Capability.MESSAGES:
        return sse("error", codec.api.unstructure(messages.error_body(exc, request_id)))
    error = responses.error_object(exc, request_id, None)
    return sse("error", {"type": "error", "code": exc.code, "message": error["message"], "param": None})


class Passed(NamedTuple):
    """A request to pass through: the `Work` it makes (`InferenceApp._work`'s arguments)."""

    api: Api
    capability: Capability
    model: str
    body: Json
    stream: bool


def passed(gateway: Gateway, path: str, body: Json, *, translated: bool) -> Passed | None:
    """The request at `path` to pass through when every Ready replica of its model serves the API
    itself (checked as every request is: model, stream, numbers; and `stateful_problem`); None when
    it is to be translated instead. A route that is not `translated` is served natively or not at
    all: NotFound in its API's shape, saying where it is served."""
    capability = NATIVE[path]
    model = body.get("model")
    if not (isinstance(model, str) and model_problem(model) is None and gateway.passes_through(model, capability)):
        if translated:
            return None
        raise NotFound(
            f"POST {path} is served only by runtimes that serve it themselves (vLLM since"
            f" {VLLM.native_apis[path]}); this model's do not: count the tokens from a message's usage instead"
        )
    del body["model"]
    stream = body.pop("stream", False)
    if not isinstance(stream, bool) or (stream and not capability.streams):
        raise ContractError(f"stream: true or false ({capability} answers do not stream)", problems=("stream",))
    stateful_problem(capability, body)
    if problems := body_problems(capability, body):
        raise ContractError("invalid request: " + "; ".join(problems), problems=tuple(problems))
    api = Api.RESPONSES if capability is Capability.RESPONSES else Api.MESSAGES
    return Passed(api=api, capability=capability, model=model, body=body, stream=stream)
