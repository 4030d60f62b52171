"""The routes served by translating their API to a chat completion and back: Anthropic's Messages
API (`messages`) and OpenAI's Responses API (`responses`), by path. `serve` runs the call a checked
request made and answers it: the API's answer object, or its event stream (`translation.ChatEvents`),
ended by the API's own error event when the call fails after the stream opened.
"""

from __future__ import annotations

from typing import Any, Final, Protocol

from nexa.contracts.gateway import Api
from nexa.control.datapath import messages, responses
from nexa.control.datapath.gateway import Call
from nexa.control.datapath.translation import Translated, Translation

#: Every translated route, by path.
TRANSLATIONS: Final[dict[str, Translation[Any]]] = {
    messages.MESSAGES_PATH: Translation(
        api=Api.MESSAGES, to_chat=messages.to_chat, answer=messages.to_message, events=messages.Events
    ),
    responses.RESPONSES_PATH: Translation(
        api=Api.RESPONSES, to_chat=responses.to_chat, answer=responses.to_response, events=responses.Events
    ),
}


class Exchange(Protocol):
    """What `serve` answers through (`inference._Exchange`)."""

    @property
    def rid(self) -> str: ...
    async def json(self, status: int, obj: object) -> int: ...
    async def start_stream(self, status: int) -> None: ...
    async def chunk(self, data: bytes, *, more: bool = True) -> None: ...


async def serve(x: Exchange, call: Call, translation: Translation[Any], req: Translated) -> int:
    """Run `call` (made for `req`) and answer it in the API's shape; the status answered."""
    async with call as answer:
        if not req.stream:
            await answer.read_all()
            if answer.error is not None:
                raise answer.error
            return await x.json(200, translation.answer(answer.answer, req, x.rid, call.progress))
        events = translation.events(req, x.rid)
        await x.start_stream(200)
        await x.chunk(events.start())
        async for chunk in answer:
            if out := events.feed(chunk):
                await x.chunk(out)
            if events.failed:
                break  # what the runtime sent does not translate: the rest is cancelled
        await x.chunk(events.end(answer.error, call.progress), more=False)
        return 200
