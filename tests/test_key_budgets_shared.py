"""An API key's own budget held fleet-wide: three real gateway apps (uvicorn, real sockets) on one
real redis-server charge the key through the tenant budgets' script (gateway.budget_store, scope
"key"); with Redis stopped each replica enforces the key's budget / live replicas."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from tests.redis_control import RedisProc
from tests.test_keys_replicas import create
from tests.test_shared_state import BODY, N, Start, gateways, metric, redis_proc, three, until  # noqa: F401

R = 30  # the key's requests per minute; its tenant's (100,000) never binds here
TENANT_BUDGETS = {"requests_per_minute": 100_000}


def allowance(elapsed_s: float) -> float:
    return R + R * elapsed_s / 60  # a minute's bucket, refilled at R/60 per second


async def fire(urls: list[str], key: str, count: int) -> list[int]:
    """`count` requests with `key`, round-robin over the replicas, 8 at a time."""
    sem = asyncio.Semaphore(8)
    async with aiohttp.ClientSession() as s:
        async def one(i: int) -> int:
            async with sem, s.post(urls[i % len(urls)] + "/v1/chat/completions", json=BODY,
                                   headers={"Authorization": f"Bearer {key}"}) as r:
                body = await r.json(content_type=None)
                if r.status == 429:  # the key's limit, not the tenant's
                    assert body["error"]["message"].startswith("This API key's requests per minute"), body
                return r.status
        return list(await asyncio.gather(*(one(i) for i in range(count))))


async def burst_within_the_fleet_budget(urls: list[str], key: str) -> list[int]:
    """3R requests with the key over the replicas: admitted between 0.9R and the allowance + N
    (per replica, as before, each would admit up to R: 3R in all). Returns the statuses."""
    t0 = time.monotonic()
    statuses = await fire(urls, key, 3 * R)
    elapsed = time.monotonic() - t0
    admitted = statuses.count(200)
    assert set(statuses) <= {200, 429}
    assert 0.9 * R <= admitted <= allowance(elapsed) + N, (admitted, elapsed)
    return statuses


async def limited_key(urls: list[str], apps: list[Any]) -> str:
    created = await create(urls[0], budgets={"requests_per_minute": R})

    async def known_everywhere() -> bool:  # without spending the key's budget on probes
        return all(a.state.tokenfleet.admission.key_budgets.store.record(created["id"]) is not None for a in apps)
    await until(known_everywhere, 2.0)
    return str(created["key"])


async def test_a_keys_budget_is_held_fleet_wide(three: Start, redis_proc: RedisProc) -> None:
    urls, apps = await three(redis_proc.url, budgets=TENANT_BUDGETS)
    key = await limited_key(urls, apps)
    await burst_within_the_fleet_budget(urls, key)
    for url in urls:
        assert await metric(url, 'tokenfleet_budget_mode{mode="shared"}') == 1.0
    buckets = redis_proc.client().keys("*:key:budget:*")
    assert len(buckets) == 1  # one bucket for the key, in Redis, whichever replica charged it


async def test_without_redis_each_replica_enforces_its_share_of_a_keys_budget(three: Start,
                                                                              redis_proc: RedisProc) -> None:
    urls, apps = await three(redis_proc.url, budgets=TENANT_BUDGETS)
    rosters = [a.state.replicas.shared for a in apps]

    async def all_seen() -> bool:
        return all(r.live == N for r in rosters)
    await until(all_seen, 5)
    key = await limited_key(urls, apps)
    redis_proc.stop()  # each replica falls back to R / live replicas for the key, as for tenants
    t0 = time.monotonic()
    statuses = await burst_within_the_fleet_budget(urls, key)
    elapsed = time.monotonic() - t0
    per_replica = [statuses[i::N].count(200) for i in range(N)]
    assert all(n <= R / N * (1 + elapsed / 60) + 1 for n in per_replica), per_replica
    for url in urls:
        assert await metric(url, 'tokenfleet_budget_mode{mode="local_share"}') == 1.0
