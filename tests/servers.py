"""Run an ASGI app on a real loopback socket inside the test's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator

import uvicorn


class _QuietServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Signals belong to pytest, not to the server under test.
        yield


@contextlib.asynccontextmanager
async def serve_app(app: object, host: str = "127.0.0.1") -> AsyncIterator[str]:
    """Serve `app` on a free port; yields its base URL and shuts it down afterwards."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(1024)
    sock.setblocking(False)
    server = _QuietServer(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("server exited during start-up")
            await asyncio.sleep(0.01)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()
