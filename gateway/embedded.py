"""Serve an ASGI app (the gateway's, a stub engine's) on a loopback socket inside the running
event loop: how bench scripts and tests run the real gateway in-process, over real HTTP.

`tokenfleet up` (gateway.cli) owns signals and the engines' lifetime; an embedded server owns
neither: signals stay with whoever runs the loop (pytest, a bench script's asyncio.run).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn

from engine_adapters.base import EngineAdapter
from engine_adapters.registry import build_adapters, launch_all, stop_all
from fleetcore.fleet_config import FleetConfig
from gateway.listener import bind_socket


# How long the shutdown waits for connections still open and requests still running before it
# cancels them. uvicorn's default is no bound: one connection left open (a client that never
# closed it, a request task stuck) held a test fixture's teardown for good (seen once in five CI
# runs, tests/test_e2e_dropin.py's module fleet). Every wait has a timeout.
SHUTDOWN_GRACE_S = 5  # seconds (uvicorn takes an int)


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Signals belong to the host process, not to the server it embeds.
        yield


@contextlib.asynccontextmanager
async def serve_app(app: object, host: str = "127.0.0.1") -> AsyncIterator[str]:
    """Serve `app` on a free port; yields its base URL and shuts it down afterwards."""
    sock = bind_socket(host, 0, backlog=1024)
    server = _EmbeddedServer(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
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


@dataclass
class ServedFleet:
    url: str  # the gateway's base URL (no /v1)
    app: Any  # the FastAPI app (`app.state.tokenfleet` is its GatewayContext)
    adapters: list[EngineAdapter]


@contextlib.asynccontextmanager
async def serve_fleet(config: FleetConfig, **app_options: Any) -> AsyncIterator[ServedFleet]:
    """The fleet's engines launched, the gateway over them served in-process; both stopped after.
    `app_options` go to `gateway.app.create_app`."""
    from gateway.app import create_app  # the app imports this module's neighbours; built on demand

    adapters = build_adapters(config)
    await launch_all(adapters)
    try:
        app = create_app(config, adapters, **app_options)
        async with serve_app(app) as url:
            yield ServedFleet(url, app, adapters)
    finally:
        await stop_all(adapters)
