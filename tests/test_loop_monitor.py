"""The event-loop stall monitor: a real loop blocked by a real `time.sleep` shows up as a stall of
about that size, an idle loop reports none, and the gateway exports both on /metrics."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import aiohttp
import pytest

import uvicorn

from fleetcore.fleet_config import GatewaySettings
from gateway import loop_monitor as lm
from gateway.app import create_app
from gateway.loop_monitor import HISTORY_S, LoopMonitor
from gateway.embedded import serve_app
from gateway.listener import bind_socket, build_listeners, protocol_class

needs_thread_rusage = pytest.mark.skipif(lm._RUSAGE_THREAD is None, reason="idle ticking needs RUSAGE_THREAD")

INTERVAL_S = 0.01
DEADLINE_S = 10.0


async def _wait_ticks(monitor: LoopMonitor, n: int) -> None:
    """Yield to the loop until the monitor has ticked `n` more times (bounded by a deadline)."""
    target = monitor.ticks + n
    deadline = time.monotonic() + DEADLINE_S
    while monitor.ticks < target:
        assert time.monotonic() < deadline, f"monitor ticked {monitor.ticks}, wanted {target}"
        await asyncio.sleep(INTERVAL_S / 2)


async def test_blocking_sleep_shows_up_as_a_stall_of_that_size() -> None:
    monitor = LoopMonitor(INTERVAL_S)
    monitor.start()
    try:
        await _wait_ticks(monitor, 3)
        t0 = time.monotonic()
        time.sleep(0.25)  # the stall under test: blocks the loop, as a blocking call in a handler would
        blocked = time.monotonic() - t0
        # Still inside the stall (no tick could run): the overdue tick already counts.
        in_progress = monitor.max_lag_since(t0)
        assert blocked - INTERVAL_S - 0.005 <= in_progress <= blocked + 0.005
        await _wait_ticks(monitor, 1)
        seen = monitor.max_lag_since(t0)
        # At least the stall less one tick interval; at most the stall plus the one loop
        # iteration between its end and the tick (generous on a shared 2-core machine).
        assert blocked - INTERVAL_S - 0.005 <= seen <= blocked + 0.1
        assert monitor.max_lag_s == pytest.approx(seen)
        assert monitor.recent_max_s() == pytest.approx(seen)
        # time.sleep holds the loop without using the CPU: none of that lag is busy lag.
        assert monitor.max_busy_lag_s < 0.05
        # After the stall, the loop is responsive again: nothing since.
        t1 = time.monotonic()
        await _wait_ticks(monitor, 5)
        assert monitor.max_lag_since(t1) < 0.1
    finally:
        monitor.stop()
    assert not monitor.running
    ticks = monitor.ticks
    await asyncio.sleep(5 * INTERVAL_S)
    assert monitor.ticks == ticks  # stopped means stopped


async def test_idle_loop_reports_no_stall() -> None:
    monitor = LoopMonitor(INTERVAL_S)
    t0 = time.monotonic()
    monitor.start()
    try:
        await _wait_ticks(monitor, 100)  # ~1 s of ticks
    finally:
        monitor.stop()
    # Honest bounds for a loop doing nothing on a machine shared with other work: the OS may
    # preempt us for a few ms now and then, but no tick comes near the soak's 100 ms stall
    # target, and the typical tick is on time to well under a millisecond or two.
    assert monitor.max_lag_s < 0.1
    assert monitor.max_lag_since(t0) < 0.1
    assert monitor.lag_sum_s / monitor.ticks < 0.005
    assert sum(monitor.bucket_counts) == monitor.ticks
    # Ticks are due every interval: 100 of them cannot fit in much less than 100 intervals.
    assert time.monotonic() - t0 >= 100 * INTERVAL_S * 0.9


async def test_busy_lag_counts_a_loop_held_by_computation() -> None:
    """A loop held by CPU work (as a long tokenization would) shows up as busy lag, as far as
    the process really got the CPU (on a shared machine the OS may take some of it)."""
    monitor = LoopMonitor(INTERVAL_S)
    monitor.start()
    try:
        await _wait_ticks(monitor, 3)
        t0, cpu0 = time.monotonic(), time.process_time()
        while time.monotonic() - t0 < 0.25:
            pass  # spin: the loop is held, and the process is on the CPU whenever the OS lets it
        spun, cpu = time.monotonic() - t0, time.process_time() - cpu0
        await _wait_ticks(monitor, 1)
    finally:
        monitor.stop()
    off_cpu = spun - cpu
    assert monitor.max_lag_s >= spun - INTERVAL_S - 0.005
    # Busy lag = lag less the time off the CPU: at least the spin's on-CPU share less a tick.
    assert monitor.max_busy_lag_s >= spun - off_cpu - INTERVAL_S - 0.01
    assert monitor.max_busy_lag_s <= monitor.max_lag_s


def test_max_lag_since_answers_for_the_window_asked() -> None:
    """`max_lag_since(t)`: the largest stall that ended at or after t, over a bounded history."""
    monitor = LoopMonitor(INTERVAL_S)
    for at, lag in ((100.0, 0.2), (101.0, 0.05), (102.0, 0.1), (103.0, 0.0004)):
        monitor._record(at, lag)
    assert monitor.max_lag_since(0.0) == 0.2
    assert monitor.max_lag_since(100.0) == 0.2
    assert monitor.max_lag_since(100.5) == 0.1
    assert monitor.max_lag_since(102.0) == 0.1
    assert monitor.max_lag_since(102.5) == 0.0  # jitter under 1 ms is no stall
    assert monitor.max_lag_s == 0.2 and monitor.ticks == 4
    # Kept history is a max-queue: dominated entries (the 0.05 before a 0.1) are gone.
    assert [lag for _, lag in monitor._history] == [0.2, 0.1]
    # Stalls older than the history horizon are forgotten by the window query, not by the max.
    monitor._record(102.0 + HISTORY_S + 1, 0.002)
    assert monitor.max_lag_since(0.0) == 0.002
    assert monitor.max_lag_s == 0.2


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


async def test_gateway_exports_loop_lag_and_stops_the_monitor(
        fake_adapter: Any, instance_factory: Any, config_factory: Any, refused_url: str) -> None:
    app = create_app(config_factory(), [fake_adapter([instance_factory("i0", refused_url)])])
    monitor = app.state.tokenfleet.loop_monitor
    assert monitor is not None and not monitor.running
    async with serve_app(app) as url:  # uvicorn on this test's own loop: the lifespan starts it
        assert monitor.running
        await _wait_ticks(monitor, 3)
        time.sleep(0.15)  # stall the gateway's loop
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            async with s.get(f"{url}/metrics") as r:
                assert r.status == 200
                text = await r.text()
    assert not monitor.running  # the lifespan stopped it
    assert _metric(text, "tokenfleet_event_loop_lag_max_seconds") >= 0.15 - INTERVAL_S - 0.005
    assert _metric(text, "tokenfleet_event_loop_lag_recent_max_seconds") >= 0.15 - INTERVAL_S - 0.005
    count = _metric(text, "tokenfleet_event_loop_lag_seconds_count")
    assert count >= 4
    assert _metric(text, 'tokenfleet_event_loop_lag_seconds_bucket{le="+Inf"}') == count
    assert _metric(text, 'tokenfleet_event_loop_lag_seconds_bucket{le="0.1"}') <= count - 1  # the stall
    assert _metric(text, "tokenfleet_event_loop_lag_seconds_sum") >= 0.15 - INTERVAL_S - 0.005
    assert _metric(text, "tokenfleet_event_loop_lag_busy_max_seconds") < 0.05  # a sleep, not work


# --- idle ticking (the gateway's monitor: `idle_interval_s`) -------------------------------------


async def _wait_idle(monitor: LoopMonitor, timeout_s: float = DEADLINE_S) -> None:
    """Sleep in long steps (short ones would be the activity that keeps the monitor fine) until idle."""
    deadline = time.monotonic() + timeout_s
    while not monitor.idle:
        assert time.monotonic() < deadline, "the monitor never judged the loop idle"
        await asyncio.sleep(0.3)


@needs_thread_rusage
async def test_an_idle_loop_is_ticked_at_the_idle_interval() -> None:
    monitor = LoopMonitor(INTERVAL_S, idle_interval_s=0.2)
    monitor.start()
    try:
        await _wait_idle(monitor)
        ticks, t0 = monitor.ticks, time.monotonic()
        await asyncio.sleep(1.0)  # one wakeup of ours: the loop is idle but for the monitor
        n, spent = monitor.ticks - ticks, time.monotonic() - t0
    finally:
        monitor.stop()
    assert monitor.idle is False  # stopped: not idle any more
    # ~5 ticks a second instead of ~100 (a tick a hair early or late either way)
    assert 1 <= n <= spent / 0.2 + 2
    assert monitor.idle_ticks >= n - 1


@needs_thread_rusage
async def test_a_loop_that_wakes_often_is_ticked_finely_and_its_stall_measured() -> None:
    monitor = LoopMonitor(INTERVAL_S, idle_interval_s=0.2)
    monitor.start()
    stop = asyncio.Event()

    async def busy() -> None:  # ~500 wakeups a second: a gateway serving
        while not stop.is_set():
            await asyncio.sleep(0.002)

    try:
        await _wait_idle(monitor)
        task = asyncio.create_task(busy())
        deadline = time.monotonic() + DEADLINE_S
        while monitor.idle:  # judged at the next idle tick at the latest
            assert time.monotonic() < deadline, "still idle while the loop wakes 500 times a second"
            await asyncio.sleep(0.01)
        await _wait_ticks(monitor, 3)
        assert not monitor.idle
        t0 = time.monotonic()
        time.sleep(0.15)  # a stall while busy: measured at the fine interval
        blocked = time.monotonic() - t0
        await _wait_ticks(monitor, 1)
        assert monitor.max_lag_since(t0) >= blocked - INTERVAL_S - 0.005
        stop.set()
        await task
    finally:
        monitor.stop()


@needs_thread_rusage
async def test_a_loop_held_by_computation_is_not_idle() -> None:
    """A loop that always has work never sleeps, so it wakes no one: its CPU share says busy."""
    monitor = LoopMonitor(INTERVAL_S, idle_interval_s=0.2)
    monitor.start()
    try:
        await _wait_idle(monitor)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and monitor.idle:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 0.02:
                pass  # 20 ms of CPU a step, no blocking call in between
            await asyncio.sleep(0)
        assert not monitor.idle
    finally:
        monitor.stop()


@needs_thread_rusage
async def test_poke_ends_idle_ticking_at_once() -> None:
    monitor = LoopMonitor(INTERVAL_S, idle_interval_s=5.0)  # an idle tick would come only after the test
    monitor.start()
    try:
        await _wait_idle(monitor)
        monitor.poke()
        assert not monitor.idle
        t0 = time.monotonic()
        time.sleep(0.1)
        blocked = time.monotonic() - t0
        assert monitor.current_lag_s() >= blocked - INTERVAL_S - 0.005  # the fine tick is overdue already
    finally:
        monitor.stop()


def test_idle_interval_below_the_interval_is_refused() -> None:
    with pytest.raises(ValueError):
        LoopMonitor(0.01, idle_interval_s=0.005)


@needs_thread_rusage
async def test_a_client_connecting_to_the_listener_pokes_the_monitor() -> None:
    """The listener (`tokenfleet up`'s protocol) tells the loop's monitor when a client's bytes arrive."""
    monitor = LoopMonitor(INTERVAL_S, idle_interval_s=5.0)
    monitor.start()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    sock = bind_socket("127.0.0.1", 0)
    listeners, _ = build_listeners(GatewaySettings(), sock, None, 4096)
    server = uvicorn.Server(uvicorn.Config(app, http=protocol_class(listeners), lifespan="off", log_level="warning"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await _wait_idle(monitor)
        assert lm.running_on(asyncio.get_running_loop()) is monitor
        reader, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        assert (await asyncio.wait_for(reader.readline(), DEADLINE_S)).startswith(b"HTTP/1.1 200")
        assert not monitor.idle  # poked: no idle tick (5 s) could have judged it meanwhile
        writer.close()
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, DEADLINE_S)
        sock.close()
        monitor.stop()
    assert lm.running_on(asyncio.get_running_loop()) is None


async def test_gateway_monitor_ticks_idle_and_forgets_start_up(
        fake_adapter: Any, instance_factory: Any, config_factory: Any, refused_url: str) -> None:
    app = create_app(config_factory(), [fake_adapter([instance_factory("i0", refused_url)])])
    monitor = app.state.tokenfleet.loop_monitor
    assert monitor.idle_interval_s == lm.IDLE_INTERVAL_S
    async with serve_app(app):
        # start-up's full collection held the loop, but the maxima begin with serving
        assert monitor.max_busy_lag_s < 0.05
        if lm._RUSAGE_THREAD is not None:
            await _wait_idle(monitor)


@needs_thread_rusage
async def test_a_hold_ticks_finely_and_gives_idle_ticking_back_at_once() -> None:
    """A health check in flight holds the monitor fine: a stall during it is measured to the fine
    interval (its deadline counts only responsive time), and idle ticking resumes when it ends."""
    monitor = LoopMonitor(INTERVAL_S, idle_interval_s=5.0)
    monitor.start()
    try:
        await _wait_idle(monitor)
        s0 = monitor.stalled_s()
        monitor.hold()
        assert not monitor.idle
        t0 = time.monotonic()
        time.sleep(0.3)  # blocked while the check is in flight
        blocked = time.monotonic() - t0
        assert monitor.stalled_s() - s0 >= blocked - INTERVAL_S - 0.005  # counted already, in progress
        await _wait_ticks(monitor, 1)
        stalled = monitor.stalled_s() - s0
        assert stalled >= blocked - INTERVAL_S - 0.005
        monitor.hold()  # nested: the first release keeps it fine
        monitor.release_hold()
        assert not monitor.idle
        monitor.release_hold()
        assert monitor.idle  # it was idle before the hold: idle again now, no window to wait for
        assert monitor.stalled_s() - s0 >= stalled  # no jump back
        monitor.hold()
        monitor.poke()  # work arrived meanwhile: the loop is not idle when the hold ends
        monitor.release_hold()
        assert not monitor.idle
    finally:
        monitor.stop()
