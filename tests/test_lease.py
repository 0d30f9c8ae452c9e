"""The planner leader lease over a real redis-server: one leader among three, takeover after the
holder dies, never two at once, fencing tokens strictly increasing."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetcore.fleet_config import GatewaySettings
from gateway.lease import LeaderLease
from gateway.shared_state import SharedRedis
from tests.redis_control import RedisProc
from tests.redis_server import redis_url

TTL, RENEW = 0.6, 0.2


@pytest.fixture
def redis() -> Iterator[str]:
    with redis_url() as url:
        yield url


def replicas(url: str, n: int) -> tuple[list[SharedRedis], list[LeaderLease]]:
    settings = GatewaySettings(redis_prefix=f"t-{uuid.uuid4().hex[:8]}", lease_ttl_s=TTL, lease_renew_s=RENEW,
                               store_timeout_s=0.2)
    shared = [SharedRedis(url, settings, replica_id=f"r{i}") for i in range(n)]
    return shared, [LeaderLease(s, report=lambda i=i: {"who": i}) for i, s in enumerate(shared)]


class Sampler:
    """Samples every lease's `leader` each millisecond: how many at once, and each hold's fence."""

    def __init__(self, leases: list[LeaderLease]) -> None:
        self.leases = leases
        self.max_at_once = 0
        self.holds: list[tuple[str, int]] = []  # (holder, fence) in the order first seen
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            now = [lease for lease in self.leases if lease.leader]
            self.max_at_once = max(self.max_at_once, len(now))
            for lease in now:
                if not self.holds or self.holds[-1] != (lease.holder, lease.fence):
                    self.holds.append((lease.holder, lease.fence))
            await asyncio.sleep(0.001)

    def current(self) -> LeaderLease | None:
        return next((lease for lease in self.leases if lease.leader), None)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def wait_for_leader(sampler: Sampler, exclude: LeaderLease | None, timeout_s: float) -> tuple[LeaderLease, float]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        cur = sampler.current()
        if cur is not None and cur is not exclude:
            return cur, time.monotonic() - t0
        waits = [asyncio.create_task(lease.changed.wait()) for lease in sampler.leases]
        for lease in sampler.leases:
            lease.changed.clear()
        await asyncio.wait(waits, timeout=max(0.0, timeout_s - (time.monotonic() - t0)),
                           return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
    raise AssertionError(f"no new leader within {timeout_s} s")


async def test_one_leader_takeover_after_the_holder_dies_and_never_two_at_once(redis: str) -> None:
    shared, leases = replicas(redis, 3)
    sampler = Sampler(leases)
    try:
        for lease in leases:
            lease.start()
        first, _ = await wait_for_leader(sampler, None, 5)
        # Several renew periods: it keeps the lease, and the other two never get it.
        await asyncio.sleep(4 * RENEW)
        assert [lease.leader for lease in leases].count(True) == 1 and first.leader
        # The holder publishes its report; the others serve it.
        await asyncio.sleep(2 * RENEW)
        others = [lease for lease in leases if lease is not first]
        assert all(o.remote is not None and o.remote["leader"] == first.holder for o in others)
        # Kill the holder: it stops renewing (no release, as a crash would).
        await first.stop(release=False)
        t_kill = time.monotonic()
        second, _ = await wait_for_leader(sampler, first, TTL + 2 * RENEW + 1)
        took = time.monotonic() - t_kill
        assert took <= TTL + RENEW + 0.15, took  # scheduling slack for a loaded 2-core machine
        assert second.fence > first.fence
        await asyncio.sleep(RENEW)  # a hold the sampler sees too
        # A clean stop hands over at once (no waiting out the TTL).
        await second.stop(release=True)
        t_stop = time.monotonic()
        third, _ = await wait_for_leader(sampler, second, TTL + 2 * RENEW + 1)
        assert time.monotonic() - t_stop <= RENEW + 0.15
        assert third.fence > second.fence
        await asyncio.sleep(RENEW)
    finally:
        await sampler.close()
        for lease in leases:
            await lease.stop()
        for s in shared:
            await s.redis.aclose()
    assert sampler.max_at_once == 1
    fences = [f for _, f in sampler.holds]
    assert fences == sorted(set(fences)) and len(fences) == 3, sampler.holds


async def test_a_holder_cut_off_from_redis_stops_acting_before_its_ttl_runs_out(tmp_path: Path) -> None:
    proc = RedisProc(tmp_path)
    proc.start()
    shared, (lease,) = replicas(proc.url, 1)
    try:
        assert await lease.tick()
        sent = time.monotonic()
        trusted_until = lease._valid_until
        proc.pause()  # a hung Redis: renewals time out (store_timeout_s)
        assert await lease.tick()  # still trusted: the hold may yet be valid in Redis
        assert lease._valid_until == trusted_until  # but a failed renewal did not extend it
        deadline = sent + TTL
        while lease.leader and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not lease.leader and time.monotonic() < deadline  # stopped before Redis lets another take over
    finally:
        proc.resume()
        await lease.stop(release=False)
        await shared[0].redis.aclose()
        proc.stop()
