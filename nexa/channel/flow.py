"""Credit flow control on the data path, both halves of it: a request's answer travels in chunks,
at most `window` of them ahead of the credit its receiver returned.

The sender (a node's relay) holds a `SendWindow` per request: it may send `window` chunks, then one
more for each chunk credited back. The receiver (the controller's relay) holds a `CreditReturn` per
stream: it returns credit in batches of half a window as its consumer takes chunks, so a slow
client stops only its own request. One module for both, so the two ends agree on the arithmetic.
"""

from __future__ import annotations

import trio


class SendWindow:
    """The sender's half: how many chunks may go now, and a wait for credit when none may."""

    def __init__(self, window: int) -> None:
        #: Chunks that may be sent before any credit (a window below one is one).
        self.window = max(1, window)
        #: Chunks it may have sent in all: the window plus every credit since.
        self.allowed = self.window
        self.sent = 0
        #: Whether the sender waits for credit now.
        self.waiting = False
        self._credited = trio.Event()

    @property
    def unacknowledged(self) -> int:
        """Chunks sent beyond the credit returned (never above the window)."""
        return self.sent - (self.allowed - self.window)

    def credit(self, chunks: int) -> None:
        """The receiver returned `chunks` (ignored unless positive)."""
        if chunks > 0:
            self.allowed += chunks
            self._credited.set()

    async def room(self) -> None:
        """Wait until one more chunk may be sent (the window is used up: the receiver's credit)."""
        while self.sent >= self.allowed:
            self.waiting = True
            try:
                await self._credited.wait()
            finally:
                self.waiting = False
            self._credited = trio.Event()

    def sent_one(self) -> None:
        self.sent += 1


class CreditReturn:
    """The receiver's half: chunks its consumer took, returned as credit every half window."""

    def __init__(self, window: int) -> None:
        self._every = max(1, window // 2)
        #: Chunks taken by the consumer and not yet credited back.
        self._uncredited = 0

    def took(self, chunks: int = 1) -> int:
        """The consumer took `chunks`: the credit to send now (0: not yet)."""
        self._uncredited += chunks
        if self._uncredited < self._every:
            return 0
        credit, self._uncredited = self._uncredited, 0
        return credit
