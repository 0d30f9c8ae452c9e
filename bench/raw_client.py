"""A client connection of raw sockets for the server benchmarks (bench/server_cycle_cost.py,
bench/server_cycle_floor.py): one request at a time, its answer read until the chunked
body's end. No HTTP library: it costs the shared cores little and handles no connection of
its own accord, so what the server does is what is measured."""

from __future__ import annotations

import asyncio


class StreamClient(asyncio.Protocol):
    """One connection; `ask(request)` sends it and returns the whole chunked answer."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.done: asyncio.Future[bytes] | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # the server closed it

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.done is not None and self.buf.endswith(b"\r\n0\r\n\r\n"):
            self.done.set_result(bytes(self.buf))
            self.buf.clear()
            self.done = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError(f"connection lost mid-answer: {bytes(self.buf[:200])!r}"))
        if not self.closed.done():
            self.closed.set_result(None)

    async def ask(self, request: bytes, timeout_s: float = 30.0) -> bytes:
        assert self.transport is not None
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return await asyncio.wait_for(self.done, timeout_s)
