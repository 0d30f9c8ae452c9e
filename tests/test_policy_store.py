"""Region policies shared by gateway replicas through a real Redis: versions, conflicts, audit, watch."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest

from fleetcore.region_policy import RegionPolicy
from gateway.policy_store import AuditEntry, MemoryPolicyStore, RedisPolicyStore, Snapshot, VersionConflict, watch
from tests.redis_server import redis_url


@pytest.fixture(scope="module")
def redis() -> Iterator[str]:
    with redis_url() as url:
        yield url


def entry(version: int, action: str = "create") -> AuditEntry:
    return AuditEntry(version, 0.0, "admin:test", action, "t", "*", None, {"spill": False})


async def check_store(a, b) -> None:  # type: ignore[no-untyped-def]
    snap = await a.load()
    assert snap.version == 1 and [p.tenant for p in snap.policies] == ["seed"]
    v = await a.commit([RegionPolicy(tenant="t", spill=False)], entry(2), expected_version=1)
    assert v == 2
    with pytest.raises(VersionConflict):
        await b.commit([], entry(2, "delete"), expected_version=1)  # b read version 1: stale
    snap_b = await b.load()
    assert snap_b.version == 2 and snap_b.policies[0].spill is False
    await b.commit([], entry(3, "delete"), expected_version=2)
    assert [e.action for e in await a.audit()] == ["delete", "create"]


async def test_memory_store() -> None:
    store = MemoryPolicyStore([RegionPolicy(tenant="seed")])
    await check_store(store, store)


async def test_redis_store_shared_by_two_replicas(redis: str) -> None:
    prefix = f"test:{uuid.uuid4().hex}"
    a = RedisPolicyStore(redis, [RegionPolicy(tenant="seed")], prefix=prefix)
    b = RedisPolicyStore(redis, [RegionPolicy(tenant="other-seed")], prefix=prefix)  # adopts a's seed
    try:
        await check_store(a, b)
    finally:
        await a.close()
        await b.close()


async def test_watch_applies_changes_made_by_another_replica(redis: str) -> None:
    prefix = f"test:{uuid.uuid4().hex}"
    a = RedisPolicyStore(redis, [], prefix=prefix)
    b = RedisPolicyStore(redis, [], prefix=prefix)
    seen: list[Snapshot] = []
    task = asyncio.create_task(watch(b, seen.append, interval_s=0.05))
    try:
        await asyncio.sleep(0.2)
        await a.commit([RegionPolicy(tenant="t", allowed_jurisdictions=["eu"])], entry(2), expected_version=1)
        for _ in range(40):
            if seen and seen[-1].version == 2:
                break
            await asyncio.sleep(0.05)
        assert seen[-1].version == 2 and seen[-1].policies[0].allowed_jurisdictions == ["eu"]
    finally:
        task.cancel()
        await a.close()
        await b.close()
