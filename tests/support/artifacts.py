"""A streamed body for `httpx.MockTransport` answers, as an S3 store sends one."""

from __future__ import annotations


class Chunks:
    """A streamed body in 64 KiB pieces; a plain iterator, so abandoning it warns about nothing."""

    def __init__(self, data: bytes) -> None:
        self._view = memoryview(data)

    def __aiter__(self) -> Chunks:
        return self

    async def __anext__(self) -> bytes:
        if not self._view:
            raise StopAsyncIteration
        piece, self._view = self._view[:65536], self._view[65536:]
        return bytes(piece)
