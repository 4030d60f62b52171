"""What the APIs the gateway translates to chat completions share (`messages`: Anthropic's Messages
API; `responses`: OpenAI's Responses API). Pure: no I/O.

Requests: the refusals (`refuse`: a 400 naming the field; `unsupported`: what does not translate,
`field_not_supported`) and the value checks. Answers: `read_answer` checks a unary chat completion
(one choice, its text and tool calls, the finish reason, usage) and `ChatEvents` reads a
chat-completions stream (whole SSE events, as `calls.Answer` yields them): it opens and closes one
block at a time (text, or a tool call by the chat index) and asks its subclass for that API's events,
checks every event's shape, and ends the stream with the API's own error event when the call failed or
the runtime said something that does not translate. Never raises on what the runtime sent; nothing
here logs or keeps a payload.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Final, Generic, Protocol, TypeVar

import attrs

from nexa.contracts.gateway import Api
from nexa.control.datapath import answers
from nexa.control.datapath.calls import Progress
from nexa.control.datapath.metering import token_count_ok
from nexa.errors import ContractError, FieldNotSupported, NexaError, RuntimeFailed

Json = dict[str, Any]

#: How many tool calls one answer may make (a chat index beyond is a hostile stream).
MAX_TOOL_INDEX: Final = 1024


def refuse(field: str, why: str) -> ContractError:
    """A 400 naming the field (its problem's text starts with it: `param_of` reads it back)."""
    return ContractError(f"{field}: {why}", problems=(f"{field}: {why}",))


def unsupported(field: str, what: str) -> FieldNotSupported:
    return FieldNotSupported(
        f"{field}: {what} does not translate to the chat completions the runtime serves; leave it out",
        field=field,
    )


def param_of(exc: NexaError) -> str | None:
    """The request field a 400 names, for the error's `param`, or None."""
    if isinstance(exc, FieldNotSupported):
        return exc.field
    if isinstance(exc, ContractError) and exc.problems:
        head = exc.problems[0].split(":", 1)[0]
        if head and " " not in head and not head.startswith("("):
            return head
    return None


def whole(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def number(value: object, low: float, high: float) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and low <= value <= high


def sse(event: str, data: Json) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def tool_arguments(arguments: object) -> Json:
    """A tool call's arguments (a JSON text) as an object; RuntimeFailed otherwise."""
    parsed = answers.event_json(arguments.encode()) if isinstance(arguments, str) else None
    if arguments == "":
        parsed = {}
    if not isinstance(parsed, dict):
        raise RuntimeFailed("the runtime's answer is unusable (a tool call's arguments are not a JSON object)")
    return parsed


# ---- unary answers ------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ToolCall:
    #: The runtime's call id, or None when it gave none.
    id: str | None
    name: str
    #: The arguments as the runtime wrote them (a JSON object's text), and parsed.
    arguments: str
    input: Json


@attrs.frozen(kw_only=True)
class Reply:
    """A checked unary chat completion's first choice."""

    text: str
    calls: tuple[ToolCall, ...]
    finish: object
    #: vLLM's `stop_reason`: the stop string that matched, when it says.
    matched: object
    #: (prompt, completion) tokens: the answer's usage, else the call's as metered.
    usage: tuple[int, int]


def read_answer(answer: Json | None, progress: Progress) -> Reply:
    """The first choice of a unary chat completion (`calls.Answer.answer`); RuntimeFailed when it
    does not translate, and the call's status (what is metered) then says so."""
    try:
        return _read_answer(answer, progress)
    except RuntimeFailed as exc:
        progress.status = exc.code
        raise


def _read_answer(answer: Json | None, progress: Progress) -> Reply:
    choices = (answer or {}).get("choices") or []
    if not choices:
        raise RuntimeFailed("the runtime's answer is unusable (no choice)")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        raise RuntimeFailed("the runtime's answer is unusable (a choice without a message)")
    text = message.get("content")
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise RuntimeFailed("the runtime's answer is unusable (tool_calls is not a list)")
    made = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RuntimeFailed("the runtime's answer is unusable (a tool call without a function name)")
        ident = call.get("id") if isinstance(call.get("id"), str) and call.get("id") else None
        arguments = function.get("arguments")
        parsed = tool_arguments(arguments)
        made.append(ToolCall(id=ident, name=function["name"], arguments=arguments if arguments else "{}", input=parsed))
    usage = (answer or {}).get("usage")
    usage = usage if isinstance(usage, dict) else {}
    return Reply(
        text=text if isinstance(text, str) else "",
        calls=tuple(made),
        finish=choice.get("finish_reason"),
        matched=choice.get("stop_reason"),
        usage=(
            int(usage.get("prompt_tokens") or progress.prompt_tokens),
            int(usage.get("completion_tokens") or progress.completion_tokens),
        ),
    )


# ---- streams ------------------------------------------------------------------------------------


class ChatEvents:
    """A chat-completions stream as another API's events. `feed` translates what the runtime sent;
    `end` closes the open block and writes the last events, or the API's error event when the call
    failed (`error`) or the runtime said something that does not translate. A subclass writes its
    API's events in the hooks (`_begin_text`, `_text`, `_begin_tool`, `_arguments`, `_end_block`,
    `_last`, `_error`); this class checks what the runtime sent and keeps the order."""

    def __init__(self, request_id: str) -> None:
        self._rid = request_id
        self._rest = b""
        #: The open block: `text`, or the chat index of a tool call.
        self._open: str | int | None = None
        #: The open block's pieces (its text, or its arguments), and the tool calls seen, by chat index.
        self._pieces: list[str] = []
        self._tools: set[int] = set()
        self.finish: object = None
        self.matched: object = None
        self.usage: tuple[int, int] | None = None
        #: What ended the translation early (its error event already written).
        self.failed: NexaError | None = None
        self._ended = False

    # ---- hooks (the API's events)

    def _begin_text(self) -> list[bytes]:
        raise NotImplementedError

    def _text(self, text: str) -> list[bytes]:
        raise NotImplementedError

    def _begin_tool(self, index: int, ident: str | None, name: str) -> list[bytes]:
        raise NotImplementedError

    def _arguments(self, piece: str) -> list[bytes]:
        raise NotImplementedError

    def _end_block(self, tool: bool, whole: str) -> list[bytes]:
        """Close the open block, given all its text (or its arguments, checked to be an object)."""
        raise NotImplementedError

    def _last(self, prompt: int, completion: int) -> list[bytes]:
        """The stream's last events, after a clean end (`finish`, `matched` are the runtime's)."""
        raise NotImplementedError

    def _error(self, exc: NexaError) -> bytes:
        raise NotImplementedError

    # ---- the stream

    def feed(self, chunk: bytes) -> bytes:
        if self.failed is not None or self._ended:
            return b""
        events, self._rest = answers.split_events(self._rest + chunk)
        out: list[bytes] = []
        for event in events:
            try:
                self._event(event, out)  # what it wrote before failing is sent, then the error
            except NexaError as exc:
                out.append(self._fail(exc))
                break
        return b"".join(out)

    def end(self, error: NexaError | None, progress: Progress) -> bytes:
        """The stream's last events; the call's token counts (`progress`) when the runtime sent no usage."""
        out = b""
        if error is None and self.failed is None and self._rest.strip():
            self._rest, tail = b"", self._rest + b"\n\n"  # a last event without its blank line
            out = self.feed(tail)
        if self.failed is not None and progress.status == "ok":
            progress.status = self.failed.code  # the call ends as the client saw it end
        if self.failed is not None or self._ended:
            return out
        if error is not None:
            return out + self._fail(error)
        try:
            closed = self._close()
        except NexaError as exc:
            progress.status = exc.code
            return out + self._fail(exc)
        prompt, completion = self.usage or (progress.prompt_tokens, progress.completion_tokens)
        self._ended = True
        return out + b"".join([*closed, *self._last(prompt, completion)])

    def _fail(self, exc: NexaError) -> bytes:
        self.failed = exc
        return self._error(exc)

    def _event(self, event: bytes, out: list[bytes]) -> None:
        data = [line[5:].removeprefix(b" ") for line in event.splitlines() if line.startswith(b"data:")]
        if not data or b"\n".join(data).strip() == b"[DONE]":
            return
        obj = answers.event_json(b"\n".join(data))
        if not isinstance(obj, dict):
            raise self.bad("an event whose data is not a JSON object")
        usage = obj.get("usage")
        if isinstance(usage, dict):
            prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
            if not (token_count_ok(prompt) and token_count_ok(completion)):
                raise self.bad("a usage that is not token counts")
            self.usage = (int(prompt), int(completion))
        choices = obj.get("choices")
        if not isinstance(choices, list):
            raise self.bad("an event without choices")
        for choice in choices[:1]:  # these APIs answer one choice; the request asked for one
            if not isinstance(choice, dict):
                raise self.bad("a choice that is not an object")
            delta = choice.get("delta") or {}
            if not isinstance(delta, dict):
                raise self.bad("a delta that is not an object")
            text = delta.get("content")
            if isinstance(text, str) and text:
                if self._open != "text":
                    out += [*self._close(), *self._begin_text()]
                    self._open = "text"
                self._pieces.append(text)
                out += self._text(text)
            self._tool_calls(delta.get("tool_calls"), out)
            if choice.get("finish_reason") is not None:
                self.finish, self.matched = choice.get("finish_reason"), choice.get("stop_reason")

    def _tool_calls(self, calls: object, out: list[bytes]) -> None:
        if calls is None:
            return
        if not isinstance(calls, list):
            raise self.bad("tool_calls that is not a list")
        for call in calls:
            if not isinstance(call, dict) or not isinstance(function := call.get("function") or {}, dict):
                raise self.bad("a tool call delta that is not an object with a function")
            index = call.get("index", 0)
            if not whole(index, 0, MAX_TOOL_INDEX):
                raise self.bad("a tool call delta without an index")
            if index != self._open:
                name, ident = function.get("name"), call.get("id")
                if not isinstance(name, str) or not name or index in self._tools:
                    raise self.bad("a new tool call without a function name")
                self._tools.add(index)
                ident = ident if isinstance(ident, str) and ident else None
                out += [*self._close(), *self._begin_tool(index, ident, name)]
                self._open = index
            piece = function.get("arguments")
            if piece is not None and not isinstance(piece, str):
                raise self.bad("tool call arguments that are not text")
            if piece:
                self._pieces.append(piece)
                out += self._arguments(piece)

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        tool = isinstance(self._open, int)
        whole_text = "".join(self._pieces)
        if tool:
            tool_arguments(whole_text)  # a tool's input must be a JSON object
        out = self._end_block(tool, whole_text)
        self._open, self._pieces = None, []
        return out

    def bad(self, problem: str) -> RuntimeFailed:
        return RuntimeFailed(f"the runtime's stream does not translate ({problem})")


# ---- serving ------------------------------------------------------------------------------------


class Translated(Protocol):
    """A checked request of a translated API: what the gateway runs."""

    @property
    def model(self) -> str: ...
    @property
    def stream(self) -> bool: ...
    #: The chat-completions body (without `model` and `stream`).
    @property
    def chat(self) -> Json: ...


R = TypeVar("R", bound=Translated)


class Events(Protocol):
    failed: NexaError | None

    def start(self) -> bytes: ...
    def feed(self, chunk: bytes) -> bytes: ...
    def end(self, error: NexaError | None, progress: Progress) -> bytes: ...


@attrs.frozen(kw_only=True)
class Translation(Generic[R]):
    """One API the gateway serves by translating it to and from chat completions."""

    api: Api
    #: The request body to the checked request (ContractError naming what is wrong).
    to_chat: Callable[[Json], R]
    #: A unary chat completion's answer (`calls.Answer.answer`) to the API's answer.
    answer: Callable[[Json | None, R, str, Progress], Json]
    #: The stream's translator, for a request and its request id.
    events: Callable[[R, str], Events]
