"""An embedded gateway's shutdown is bounded: a request that never ends is cancelled after the grace
(`gateway.embedded.SHUTDOWN_GRACE_S`), not waited for (uvicorn's default waits for ever)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import httpx

from gateway import embedded


async def _never_answers(scope: dict[str, Any], receive: Any, send: Any, started: asyncio.Event) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    started.set()
    await asyncio.Event().wait()  # a request stuck for good


async def test_a_stuck_request_does_not_hold_the_shutdown() -> None:
    started = asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await _never_answers(scope, receive, send, started)

    async with httpx.AsyncClient() as client:
        served = embedded.serve_app(app)
        url = await served.__aenter__()
        request = asyncio.create_task(client.get(url, timeout=60))
        await asyncio.wait_for(started.wait(), 10)
        t0 = time.monotonic()
        await asyncio.wait_for(served.__aexit__(None, None, None), 20)  # without a grace: for ever
        assert time.monotonic() - t0 < embedded.SHUTDOWN_GRACE_S + 10
        request.cancel()
        with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
            await request
