"""A loopback HTTP server whose answers never end: what an engine that keeps sending looks like."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

CHUNK = 65536


@contextlib.asynccontextmanager
async def endless_body_server(status: bytes = b"200 OK", content_type: bytes = b"application/json",
                              fill: bytes = b" ") -> AsyncIterator[str]:
    """Serve on 127.0.0.1: every request gets `status` and a chunked body of `fill` bytes, 64 KiB a
    chunk, until its client goes. Yields the base URL."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: " + content_type
                         + b"\r\nTransfer-Encoding: chunked\r\n\r\n")
            while True:
                writer.write(b"%x\r\n%s\r\n" % (CHUNK, fill * CHUNK))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
