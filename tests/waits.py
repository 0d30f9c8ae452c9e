"""Waiting on an event in tests: poll a condition until it holds, bounded by a deadline.

A test that sleeps and hopes something happened meanwhile either wastes the sleep or, on a
loaded machine, looks before the event and fails for no reason. `wait_until` waits for the
condition itself and, when the deadline passes first, fails saying what it waited for and the
last value it saw.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def wait_until(probe: Callable[[], T | Awaitable[T]], timeout_s: float, what: str,
                     ok: Callable[[T], Any] = bool, every_s: float = 0.02) -> T:
    """Call `probe` (sync or async) until `ok(value)` holds; return that value. Fails with `what`
    and the last value when `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if inspect.isawaitable(value):
            value = await value
        if ok(value):
            return value  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; last seen: {value!r}")
        await asyncio.sleep(every_s)
