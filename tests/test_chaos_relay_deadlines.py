"""`UpstreamWatch`, the per-dispatch deadline the relay puts on every wait for an engine."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from gateway.deadlines import Deadlines, Interrupted, UpstreamStalled, UpstreamWatch


async def test_many_quick_reads_cost_one_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = asyncio.get_running_loop()
    armed: list[float] = []
    real_call_at = loop.call_at

    def counting_call_at(when: float, cb: Any, *args: Any, **kw: Any) -> asyncio.TimerHandle:
        armed.append(when)
        return real_call_at(when, cb, *args, **kw)

    monkeypatch.setattr(loop, "call_at", counting_call_at)
    watch = UpstreamWatch(idle_s=5.0)
    for i in range(1000):
        assert await watch.wait(asyncio.sleep(0, i)) == i
    watch.close()
    assert len(armed) == 1, "a timer per read would cost the relay a heap push per token"


async def test_a_wait_past_its_idle_deadline_stalls() -> None:
    watch = UpstreamWatch(idle_s=0.2)
    await watch.wait(asyncio.sleep(0.1))  # in time
    t0 = time.monotonic()
    with pytest.raises(UpstreamStalled) as e:
        await watch.wait(asyncio.sleep(5))
    assert 0.19 < time.monotonic() - t0 < 1.0
    assert e.value.phase == "idle" and e.value.waited_s >= 0.19
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]  # nothing left pending
    assert await watch.wait(asyncio.sleep(0, "next")) == "next"  # the watch is usable again
    watch.close()


async def test_explicit_deadline_and_keep_waiting() -> None:
    watch = UpstreamWatch(idle_s=10.0)
    t0 = time.monotonic()
    with pytest.raises(UpstreamStalled) as e:
        await watch.wait(asyncio.sleep(5), deadline=watch.now() + 0.1, phase="first_byte")
    assert e.value.phase == "first_byte" and time.monotonic() - t0 < 1.0
    # past the deadline, alive for 3 more checks, then not
    checks: list[float] = []

    def alive() -> bool:
        checks.append(time.monotonic())
        return len(checks) <= 3

    t0 = time.monotonic()
    with pytest.raises(UpstreamStalled):
        await watch.wait(asyncio.sleep(5), deadline=watch.now() + 0.1, keep_waiting=alive, recheck_s=0.05)
    assert len(checks) == 4 and 0.24 < time.monotonic() - t0 < 1.5
    # a live engine's answer that comes after the deadline is taken
    assert await watch.wait(asyncio.sleep(0.3, "late"), deadline=watch.now() + 0.05,
                            keep_waiting=lambda: True, recheck_s=0.05) == "late"
    watch.close()


async def test_interrupt_ends_the_pending_wait_and_every_later_one() -> None:
    watch = UpstreamWatch(idle_s=10.0)
    reason = Interrupted("gateway_shutdown", "bye")
    asyncio.get_running_loop().call_later(0.05, watch.interrupt, reason)
    with pytest.raises(Interrupted) as e:
        await watch.wait(asyncio.sleep(5))
    assert e.value is reason
    with pytest.raises(Interrupted):
        await watch.wait(asyncio.sleep(0))
    watch.close()


async def test_someone_elses_cancel_is_not_turned_into_a_stall() -> None:
    watch = UpstreamWatch(idle_s=10.0)
    task = asyncio.create_task(watch.wait(asyncio.sleep(5)))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    watch.close()


def test_first_byte_deadline_is_floor_or_factor_times_prediction() -> None:
    d = Deadlines(connect_s=5, first_byte_floor_s=30, first_byte_factor=10, idle_s=30)
    assert d.first_byte_s(None) == 30 and d.first_byte_s(0.5) == 30 and d.first_byte_s(7.0) == 70
