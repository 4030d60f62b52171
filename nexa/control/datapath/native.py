"""Anthropic's Messages API, OpenAI's Responses API and Anthropic's token count passed through as
they are to runtimes that serve them natively (vLLM: `Adapter.native_apis`), instead of being
translated to chat completions (`translated`).

The gateway passes a request through when every Ready replica of its model serves the API itself
(`Gateway.passes_through`); the body goes unchanged but for `model` (the served model's name, as
every call) and `stream`, and the answer comes back as the runtime made it, checked on the way
(`answers.unary_answer`, `answers.check_native_event`), with nexa's metering reading its usage in
the API's own names (`input_tokens`, `output_tokens`). A failure after a stream opened ends it with
the API's own error event.

Stored responses. Where a replica's runtime keeps Responses API responses (vLLM started with
`VLLM_ENABLE_RESPONSES_API_STORE=1`: `settings.responses_store`), the id of each response it
answered with `store` not false (OpenAI's default is true) is read from the answer (the unary body,
or the stream's `response.created`) and recorded with the tenant and the replica (`pins`) before the
answer ends; a request naming it as `previous_response_id`, or in the path of a stored response's
own route (`stored.STORED_ROUTES`: retrieve and cancel, which vLLM serves; `serve_stored`), goes to
that replica alone (`Work.pin`), or is refused: ResponseNotFound (not the tenant's, or not
recorded), StoredResponseLost (its replica is gone or not Ready; never routed elsewhere), and
ApiNotServed for a route vLLM does not serve (delete, input items). Where no Ready replica keeps
responses, `previous_response_id` is refused by name (FieldNotSupported), as are `conversation`
and `background` everywhere (nexa serves no Conversations API, and a background response would
go on generating after its request ended, where nexa could neither meter it nor hold it to the
tenant's quotas and deadline). Nothing here reads or logs a payload beyond those fields.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, Final, NamedTuple, Protocol

from nexa.adapters.vllm import VLLM
from nexa.contracts import codec
from nexa.contracts.domain import TenantId
from nexa.contracts.gateway import Api, Capability, body_problems, model_problem
from nexa.contracts.wire import RuntimeMethod
from nexa.control import store as st
from nexa.control.datapath import messages, responses
from nexa.control.datapath.calls import RuntimeRoute
from nexa.control.datapath.gateway import Call, Gateway
from nexa.control.datapath.pins import Pins
from nexa.control.datapath.stored import StoredRoute
from nexa.control.datapath.translation import sse
from nexa.errors import ApiNotServed, ContractError, FieldNotSupported, NexaError, NotFound, ResponseNotFound

Json = dict[str, Any]

#: The native API of each translated route, and of the token count.
NATIVE: Final = {
    messages.MESSAGES_PATH: Capability.MESSAGES,
    responses.RESPONSES_PATH: Capability.RESPONSES,
    messages.COUNT_TOKENS_PATH: Capability.MESSAGE_TOKENS,
}
#: Responses API fields that need state nexa does not route to: refused on pass-through.
_STATEFUL: Final = ("conversation", "background")
#: Why each is refused, and what to send instead.
_WHY_STATEFUL: Final = {
    "previous_response_id": "no Ready replica of this model keeps stored responses (vLLM keeps them with"
    " settings.responses_store: true); send the whole conversation as input items instead",
    "conversation": "nexa serves no Conversations API; send the whole conversation as input items instead,"
    " or continue a stored response with previous_response_id",
    # It would go on generating after the request that made it ended: no relay carries its tokens.
    "background": "a background response runs on after its request has ended, where nexa could neither"
    " meter its tokens nor hold it to your quotas and deadline; send the whole conversation as input"
    " items instead, without background (stream a long answer)",
}
#: How much of a stream is read for its response's id (`response.created` comes first).
_ID_SCAN_BYTES: Final = 65_536
#: A stored response's own routes, as the API documents them.
RESPONSES_ROUTE: Final = "/v1/responses/{response_id}"
#: The most of a response id an error message quotes.
MAX_QUOTED_ID: Final = 64


class Exchange(Protocol):
    """What `serve` answers through (`inference._Exchange`)."""

    @property
    def rid(self) -> str: ...
    async def raw(self, status: int, payload: bytes, content_type: bytes) -> int: ...
    async def start_stream(self, status: int) -> None: ...
    async def chunk(self, data: bytes, *, more: bool = True) -> None: ...


def stateful_problem(capability: Capability, body: Json, *, keeps: bool = False) -> None:
    """Refuse (FieldNotSupported) what routing would need state nexa does not route to for: a
    conversation, a background response, and `previous_response_id` unless a replica `keeps` responses."""
    if capability is not Capability.RESPONSES:
        return
    for name in _STATEFUL if keeps else ("previous_response_id", *_STATEFUL):
        if body.get(name) not in (None, False):
            raise FieldNotSupported(f"{name}: {_WHY_STATEFUL[name]}", field=name)


async def pin_for(pins: Pins, tenant: TenantId, body: Json) -> str | None:
    """The replica a request continuing a stored response must go to (`previous_response_id`);
    None when it continues none. ContractError for an id that is not a string; ResponseNotFound for
    one not recorded for `tenant` (another tenant's is never routed)."""
    previous = body.get("previous_response_id")
    if previous is None:
        return None
    if not isinstance(previous, str) or not previous:
        raise ContractError("previous_response_id: a response's id", problems=("previous_response_id",))
    pin = await pins.find(tenant, previous)
    if pin is None:
        raise ResponseNotFound(
            "previous_response_id: no response by that id is stored for you (it may have expired, or been made"
            " with store: false); send the whole conversation as input items instead"
        )
    return pin.replica_id


async def stored_pin(
    pins: Pins, tenant: TenantId, route: StoredRoute, response_id: str, query: Callable[[str], str | None]
) -> st.Pin:
    """Where the stored response a request on its own `route` names is kept, checked: ResponseNotFound
    when it is not `tenant`'s (never routed), ApiNotServed for a route the runtime does not serve,
    FieldNotSupported for streaming a retrieve again (`query`: the request's query parameters)."""
    pin = await pins.find(tenant, response_id)
    if pin is None:
        raise ResponseNotFound(
            f"{response_id[:MAX_QUOTED_ID]}: no response by that id is stored for you (it may have expired,"
            " or been made with store: false or by a replica that keeps none)"
        )
    if not route.served:
        raise ApiNotServed(f"{route.method} {RESPONSES_ROUTE}{route.suffix} ({route.sdk}): {route.instead}")
    if route.method is RuntimeMethod.GET and (query("stream") not in (None, "false") or query("starting_after")):
        raise FieldNotSupported(
            "stream: a stored response streams again only when made in the background, which nexa does not"
            " route; retrieve it whole",
            field="stream",
        )
    return pin


def stored_route(route: StoredRoute, response_id: str) -> RuntimeRoute:
    """The runtime's own route for `route` on response `response_id` (an id `stored.response_id_ok`)."""
    return RuntimeRoute(method=route.method, path=f"{responses.RESPONSES_PATH}/{response_id}{route.suffix}")


async def serve(
    x: Exchange, call: Call, capability: Capability, *, stream: bool, remember: Remember | None = None
) -> int:
    """Run `call` and pass its answer on as the runtime made it; the status answered. `remember`,
    when given, gets the answer's response id once it ended well (a stored response), before the
    client has it all: a unary answer's before it is sent, a stream's before its last byte."""
    reader = _IdReader() if remember is not None else None
    async with call as answer:
        if not stream:
            body = await answer.read_all()
            if answer.error is not None:
                raise answer.error
            if reader is not None and remember is not None and (ident := reader.unary(body)):
                await remember(call, ident)
            return await x.raw(200, body, b"application/json")
        await x.start_stream(200)
        async for chunk in answer:
            if reader is not None:
                reader.feed(chunk)
            await x.chunk(chunk)
        if answer.error is None and reader is not None and remember is not None and reader.found:
            await remember(call, reader.found)
        await x.chunk(b"" if answer.error is None else error_event(capability, answer.error, x.rid), more=False)
        return 200


class Remember(Protocol):
    """Takes a stored response's id once the call that made it ended well."""

    async def __call__(self, call: Call, response_id: str, /) -> None: ...


def remembering(pins: Pins, tenant: TenantId) -> Remember:
    """What `serve` calls with a response's id: recorded where the replica that answered keeps
    responses (`ServingReplica.keeps_responses`), for `tenant` alone, with the model it named."""

    async def remember(call: Call, response_id: str) -> None:
        replica = call.progress.replica
        if replica is not None and replica.keeps_responses:
            pin = st.Pin(
                model=call.work.model, deployment=replica.deployment, replica_id=replica.replica_id, made_at=time.time()
            )
            await pins.remember(tenant, response_id, pin)

    return remember


class _IdReader:
    """A Responses answer's id: its unary body's, or its stream's first `response.*` event's
    (`response.created`), read from at most `_ID_SCAN_BYTES` of the stream."""

    def __init__(self) -> None:
        self.found = ""
        self._buffer = b""

    @staticmethod
    def unary(body: bytes) -> str:
        try:
            answer = json.loads(body)
        except ValueError:
            return ""
        ident = answer.get("id") if isinstance(answer, dict) and answer.get("object") == "response" else None
        return ident if isinstance(ident, str) else ""

    def feed(self, chunk: bytes) -> None:
        if self.found or len(self._buffer) > _ID_SCAN_BYTES:
            return
        self._buffer += chunk
        *events, self._buffer = self._buffer.replace(b"\r\n", b"\n").split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self.found = self._event_id(line[5:])
                    if self.found:
                        return

    @staticmethod
    def _event_id(data: bytes) -> str:
        try:
            event = json.loads(data)
        except ValueError:
            return ""
        response = event.get("response") if isinstance(event, dict) else None
        ident = response.get("id") if isinstance(response, dict) else None
        return ident if isinstance(ident, str) else ""


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
    #: The replica keeping the stored response it continues (`pin_for`); None: any.
    pin: str | None = None
    #: A replica of its model keeps responses: the answer's id is to be remembered (`remembering`).
    stores: bool = False


async def passed(
    gateway: Gateway, pins: Pins, path: str, body: Json, *, translated: bool, tenant: TenantId
) -> Passed | None:
    """The request at `path` to pass through when every Ready replica of its model serves the API
    itself (checked as every request is: model, stream, numbers; `stateful_problem`, and the
    replica a `previous_response_id` pins it to); None when it is to be translated instead. A
    route that is not `translated` is served natively or not at all: NotFound in its API's shape,
    saying where it is served."""
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
    keeps = capability is Capability.RESPONSES and gateway.keeps_responses(model)
    stateful_problem(capability, body, keeps=keeps)
    if problems := body_problems(capability, body):
        raise ContractError("invalid request: " + "; ".join(problems), problems=tuple(problems))
    pin = await pin_for(pins, tenant, body) if keeps else None
    api = Api.RESPONSES if capability is Capability.RESPONSES else Api.MESSAGES
    stores = keeps and body.get("store") is not False
    return Passed(api=api, capability=capability, model=model, body=body, stream=stream, pin=pin, stores=stores)
