"""Serve an ASGI app (the gateway's, a stub engine's) on a loopback socket inside the running
event loop: how bench scripts and tests run the real gateway in-process, over real HTTP.

`tokenfleet up` (gateway.cli) owns signals and the engines' lifetime; an embedded server owns
neither: signals stay with whoever runs the loop (pytest, a bench script's asyncio.run).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import uvicorn

from gateway.listener import bind_socket


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Signals belong to the host process, not to the server it embeds.
        yield


@contextlib.asynccontextmanager
async def serve_app(app: object, host: str = "127.0.0.1") -> AsyncIterator[str]:
    """Serve `app` on a free port; yields its base URL and shuts it down afterwards."""
    sock = bind_socket(host, 0, backlog=1024)
    server = _EmbeddedServer(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("server exited during start-up")
            await asyncio.sleep(0.01)
        port = sock.getsockname()[1]
        yield f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    finally:
        server.should_exit = True
        await task
        sock.close()
