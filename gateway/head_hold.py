"""One write for a streamed response's head and its first events.

uvicorn writes an ASGI response's head (status line and headers) to the socket as soon as the
app sends `http.response.start`, and each body message in a write of its own. A relayed
stream's first events are already read when its head goes out (the relay answers only once
the engine's first event is in), so head and first events leave back to back: two system
calls and, on most paths, two TCP segments for what is one piece of news to the client.

`HeadHold` stands in for the transport of one request's response (`GuardedHttpToolsProtocol`
puts it under uvicorn's cycle and in the scope as `tokenfleet.head_hold`). `hold()` asks it to
keep the next write (the head) back; the write after that carries both, in one call. `release()`
writes what is still held; closing the transport releases first. The bytes on the wire and their
order are the same; only where one write ends differs. The relay holds only when its first chunk
is at hand and releases in a `finally`, so a head is never kept past the coroutine step that
sent it.
"""

from __future__ import annotations

import asyncio
from typing import Any

SCOPE_KEY = "tokenfleet.head_hold"


class HeadHold:
    """A transport wrapper that can keep one write back until the next (module docstring)."""

    __slots__ = ("_transport", "_held", "_holding")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._held: bytes | None = None
        self._holding = False

    def hold(self) -> None:
        """Keep the next write back until the one after it, or `release`, or `close`."""
        self._holding = True

    def release(self) -> None:
        self._holding = False
        if self._held is not None:
            held, self._held = self._held, None
            self._transport.write(held)

    def write(self, data: bytes) -> None:
        if self._held is not None:  # the write after the held one: both in one
            data, self._held, self._holding = self._held + data, None, False
        elif self._holding:
            self._held = bytes(data)
            return
        self._transport.write(data)

    def close(self) -> None:
        self.release()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:  # everything else is the transport's own
        return getattr(self._transport, name)
