"""A relayed stream written straight to the client's transport, past uvicorn's ASGI `send`.

Through ASGI each piece of a streamed response is a message dict handed to the server cycle's
`send` coroutine, which checks the message's type, runs two regular expressions over every
header of the head, frames the body chunk, and writes the head and every chunk with a system
call of its own. A relayed stream's head is the same every time but for a few values, and its
body is one chunk per upstream read: `DirectSend` writes it as uvicorn's
`RequestResponseCycle.send` would, byte for byte (the same default headers first, the same
header checks and `connection`/`transfer-encoding` rules, the same chunked framing, the same
end of the response: `response_complete`, the cycle's event, close unless kept alive, the
pipelined request's start), with no message dict and no coroutine per chunk, and the head in
the same write as the first chunk when the stream has it at hand (what `gateway.head_hold`
did under uvicorn's send).

`GuardedHttpToolsProtocol` puts one in the scope of each request it serves (`SCOPE_KEY`); the
relay uses it only when the `send` it was given is that cycle's own (nothing wraps it), and
otherwise speaks ASGI as before (other servers, the FastAPI stack's wrapped sends, tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE, RequestResponseCycle

SCOPE_KEY = "tokenfleet.direct_send"

Headers = Sequence[tuple[bytes, bytes]]


class DirectSend:
    """One request's response, written straight to its transport (module docstring)."""

    __slots__ = ("cycle", "_held")

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self.cycle = cycle
        self._held = b""  # the head, kept for the first chunk's write

    def serves(self, send: Any) -> bool:
        """Whether `send` is this cycle's own (then what it would write, this writes)."""
        return bool(send == self.cycle.send)

    @property
    def paused(self) -> bool:
        """The transport's buffer is over its high-water mark: `await drain()` before writing."""
        return self.cycle.flow.write_paused and not self.cycle.disconnected

    async def drain(self) -> None:
        await self.cycle.flow.drain()

    def start(self, status: int, headers: Headers, hold: bool) -> None:
        """The head, as `http.response.start` would write it; `hold`: kept back for the first
        `body` write, or `flush`. Raises RuntimeError on an invalid header, as uvicorn's send."""
        c = self.cycle
        if c.disconnected:
            return
        if c.response_started:
            raise RuntimeError("Response already started.")
        c.response_started = True
        c.waiting_for_100_continue = False
        content = [STATUS_LINE[status]]
        has_connection_close = False
        for name, value in (*c.default_headers, *headers):
            if HEADER_RE.search(name):
                raise RuntimeError("Invalid HTTP header name.")
            if HEADER_VALUE_RE.search(value):
                raise RuntimeError("Invalid HTTP header value.")
            name = name.lower()
            if name == b"content-length" and c.chunked_encoding is None:
                # Not chunked: not what this writer frames. A relayed stream never sets one.
                raise RuntimeError("DirectSend writes chunked bodies only.")
            if name == b"transfer-encoding" and value.lower() == b"chunked":
                c.expected_content_length = 0
                c.chunked_encoding = True
            elif name == b"connection":
                if b"close" in [token.lower().strip() for token in value.split(b",")]:
                    c.keep_alive = False
                    has_connection_close = True
            content.extend((name, b": ", value, b"\r\n"))
        if not c.keep_alive and not has_connection_close:
            content.append(b"connection: close\r\n")
        if c.chunked_encoding is None and c.scope["method"] != "HEAD" and status not in (204, 304):
            c.chunked_encoding = True
            content.append(b"transfer-encoding: chunked\r\n")
        if not c.chunked_encoding:
            raise RuntimeError("DirectSend writes chunked bodies only.")
        content.append(b"\r\n")
        head = b"".join(content)
        if hold:
            self._held = head
        else:
            c.transport.write(head)

    def body(self, chunk: bytes, more: bool) -> None:
        """One body chunk (with the held head before it, and the body's end after it when not
        `more`), in one write; the end completes the response as uvicorn's send does."""
        c = self.cycle
        if c.disconnected:
            return
        if c.response_complete or not c.response_started:
            raise RuntimeError("Unexpected body: the response is not started, or already complete.")
        # uvicorn's framing: size, chunk, CRLF; nothing for an empty chunk; the terminator last
        data = b"".join((self._held, b"%x\r\n" % len(chunk), chunk, b"\r\n", b"" if more else b"0\r\n\r\n")) \
            if chunk else self._held + (b"" if more else b"0\r\n\r\n")
        self._held = b""
        if data:
            c.transport.write(data)
        if not more:
            c.response_complete = True
            c.message_event.set()
            if not c.keep_alive:
                c.transport.close()
            c.on_response()

    def flush(self) -> None:
        """Write a head still held (the stream ended, or failed, before its first chunk)."""
        if self._held:
            held, self._held = self._held, b""
            if not self.cycle.disconnected:
                self.cycle.transport.write(held)
