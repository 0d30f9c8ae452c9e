"""gateway.liveness: the heartbeat a `--workers`/`--replicas` member's event loop sends, and the
supervisor's judgement of it (`Pulse`, pure: the clock is passed in). The supervisor acting on it,
with real processes: tests/test_replica_watch.py and tests/test_workers_liveness.py."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import os
import time

import pytest
from pydantic import ValidationError

from fleetcore.fleet_config import GatewaySettings
from gateway.liveness import BeatPipe, Pulse, beat_interval, heartbeat
from gateway.replicas import Replica
from tests.waits import wait_until


def _judge(timeout_s: float, beats: list[float], until: float) -> float | None:
    """Run the supervisor's looks (each after the wait the last one asked for) over a member that
    beat at `beats` (seconds from the ready line); when the member is judged silent, or None."""
    pulse = Pulse(timeout_s, 0.0)
    now, seen = 0.0, 0  # a look reads every beat written since the last one (`beats[:seen]` read)
    while now < until:
        written = bisect.bisect_right(beats, now)
        beaten, seen = written > seen, written
        wait_s = pulse.look(now, beaten)
        if wait_s <= 0:
            return now
        now += wait_s
    return None


@pytest.mark.parametrize("timeout_s", [1.0, 2.0, 30.0])
def test_a_member_that_beats_is_never_judged_silent_even_late(timeout_s: float) -> None:
    every = beat_interval(timeout_s)
    steady = [every * k for k in range(1, 2000)]
    assert _judge(timeout_s, steady, until=every * 1990) is None
    # its loop late by up to a quarter of the timeout on every beat: still alive
    late = [every * k + (timeout_s / 4) * (k % 2) for k in range(1, 2000)]
    assert _judge(timeout_s, late, until=every * 1990) is None


@pytest.mark.parametrize("timeout_s", [1.0, 2.0, 30.0])
@pytest.mark.parametrize("hang_at", [0.0, 3.3, 10.01])
def test_a_member_that_stops_beating_is_judged_silent_after_the_timeout_never_before(timeout_s: float,
                                                                                    hang_at: float) -> None:
    every = beat_interval(timeout_s)
    beats = [every * k for k in range(1, 10_000) if every * k <= hang_at]
    last = max(beats, default=0.0)  # the ready line, when it never beat
    judged = _judge(timeout_s, beats, until=hang_at + 10 * timeout_s)
    assert judged is not None
    # never before it was silent for the whole timeout; at most one look (a quarter) plus a beat late
    assert last + timeout_s <= judged <= last + timeout_s + timeout_s / 4 + every + 1e-9, (last, judged)


def test_the_supervisor_looks_a_few_times_per_timeout_not_per_beat() -> None:
    pulse = Pulse(30.0, 0.0)
    assert pulse.look(0.0, False) == pytest.approx(7.5)
    assert pulse.look(29.0, False) == pytest.approx(1.0)  # the next look exactly when it would be due
    assert pulse.look(29.5, True) == pytest.approx(7.5) and pulse.silent_for(31.0) == pytest.approx(1.5)


def test_beats_come_at_most_every_second_and_four_times_per_timeout() -> None:
    assert beat_interval(30.0) == 1.0
    assert beat_interval(2.0) == 0.5
    assert beat_interval(3600.0) == 1.0


def test_the_timeout_is_a_validated_gateway_setting() -> None:
    assert GatewaySettings().liveness_timeout_s == 30.0  # gunicorn's worker timeout
    assert GatewaySettings(liveness_timeout_s=2).liveness_timeout_s == 2.0
    for bad in (0, -1, 0.5, 3601):  # below a second every GC pause would be a kill
        with pytest.raises(ValidationError, match="liveness_timeout_s"):
            GatewaySettings(liveness_timeout_s=bad)
    assert GatewaySettings(liveness_timeout_s=None).liveness_timeout_s is None  # the off switch


def test_without_a_timeout_a_member_gets_no_heartbeat_pipe() -> None:
    """`liveness_timeout_s: null`: the member is started without `--heartbeat-fd` (nothing to
    kill it for), with one otherwise."""
    off = Replica(0, 0, ["tokenfleet", "up"], "worker", liveness_timeout_s=None)
    assert off._with_heartbeat() == (["tokenfleet", "up"], ())
    on = Replica(0, 0, ["tokenfleet", "up"], "worker", liveness_timeout_s=2.0)
    argv, fds = on._with_heartbeat()
    try:
        assert argv[:2] == ["tokenfleet", "up"] and argv[2:] == ["--heartbeat-fd", str(fds[0]), "--heartbeat-s", "0.5"]
    finally:
        on.close_beats()


async def test_the_member_beats_from_its_loop_and_a_blocked_loop_stops_the_beats() -> None:
    pipe = BeatPipe()
    beating = asyncio.ensure_future(heartbeat(pipe.write_fd, 0.01))
    pipe.write_fd = -1  # the member's copy: `heartbeat` owns and closes it
    try:
        await wait_until(pipe.arrived, 5, "a beat")
        time.sleep(0.1)  # a blocking call holds this loop: nothing is written meanwhile
        assert not pipe.arrived()
        await wait_until(pipe.arrived, 5, "a beat once the loop runs again")
    finally:
        beating.cancel()
        await asyncio.gather(beating, return_exceptions=True)
        pipe.close()


async def test_a_full_pipe_never_blocks_the_member_and_a_gone_supervisor_ends_the_beats() -> None:
    read, write = os.pipe()
    os.set_blocking(write, False)
    with contextlib.suppress(BlockingIOError):  # a supervisor that stopped reading long ago
        while True:
            os.write(write, b"." * 4096)
    beating = asyncio.ensure_future(heartbeat(write, 0.001))
    try:
        for _ in range(20):  # the loop keeps running: each of these waits on it
            await asyncio.sleep(0.001)
        assert not beating.done()
        os.close(read)  # the supervisor gone: EPIPE ends the heartbeat, not the member
        await asyncio.wait_for(beating, 5)
    finally:
        beating.cancel()
        await asyncio.gather(beating, return_exceptions=True)
