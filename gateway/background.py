"""Stopping the gateway's background tasks (pollers, KV followers, the placement loop)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

# How long one cancellation gets to land before it is sent again.
_RECANCEL_S = 0.1


async def cancel_and_wait(tasks: Iterable[asyncio.Task[object] | None]) -> None:
    """Cancel every task and wait until each has ended, whatever it raised.

    A cancellation is repeated until the task is done: on Python 3.11 `asyncio.wait_for` can
    swallow one that lands as its inner call completes, and a polling loop would go on (and
    a plain `await task` wait forever)."""
    pending = {t for t in tasks if t is not None}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=_RECANCEL_S)
