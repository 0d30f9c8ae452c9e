"""Region policies shared by gateway replicas through a real Redis: versions, conflicts, audit, watch."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetcore.region_policy import RegionPolicy
from gateway.policy_snapshot import SnapshotFile
from gateway.policy_store import (AuditEntry, KnownState, MemoryPolicyStore, RedisPolicyStore, Snapshot,
                                  StoreUnavailable, VersionConflict, watch)
from gateway.policy_sync import PolicySync
from tests.redis_control import RedisProc
from tests.redis_server import redis_url
from tests.waits import wait_until


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
        # the watcher has applied the store as it was before the change (not a sleep hoping it had)
        await wait_until(lambda: seen, 5, "the watcher to apply the store's first snapshot")
        assert [s.version for s in seen] == [1] and list(seen[0].policies) == []
        await a.commit([RegionPolicy(tenant="t", allowed_jurisdictions=["eu"])], entry(2), expected_version=1)
        await wait_until(lambda: seen[-1].version, 5, "the watcher to apply version 2", ok=lambda v: v == 2)
        assert [s.version for s in seen] == [1, 2] and seen[-1].policies[0].allowed_jurisdictions == ["eu"]
    finally:
        task.cancel()
        await a.close()
        await b.close()


# --- failing closed: versions only go forward, a lost store is restored, every call is bounded ---

EU = RegionPolicy(tenant="eu-team", allowed_jurisdictions=["eu"])


class ScriptedStore:
    """Answers `load()` with the given versions in turn (the last one repeats)."""

    def __init__(self, versions: list[int]) -> None:
        self.versions = versions
        self.loads = 0

    async def load(self) -> Snapshot:
        v = self.versions[min(self.loads, len(self.versions) - 1)]
        self.loads += 1
        return Snapshot(v, (EU,) if v >= 2 else ())


async def test_watch_never_applies_an_older_version() -> None:
    store = ScriptedStore([2, 1, 1, 3])
    applied: list[int] = []
    task = asyncio.create_task(watch(store, lambda s: applied.append(s.version), interval_s=0.001))  # type: ignore[arg-type]
    try:
        deadline = time.monotonic() + 5
        while store.loads < 6:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
    finally:
        task.cancel()
    assert applied == [2, 3]


async def test_redis_store_restores_its_known_state_when_the_store_comes_back_empty_or_older(redis: str) -> None:
    import redis.asyncio as aioredis

    prefix = f"test:{uuid.uuid4().hex}"
    raw = aioredis.from_url(redis, decode_responses=True)
    a = RedisPolicyStore(redis, [RegionPolicy(tenant="seed")], prefix=prefix)
    try:
        assert (await a.load()).version == 1  # a new store: seeded from the fleet file
        await a.commit([EU], entry(2), expected_version=1)
        await raw.delete(f"{prefix}:version", f"{prefix}:policies", f"{prefix}:audit")  # Redis lost everything
        snap = await a.load()
        assert snap.version == 2 and snap.policies == (EU,)
        assert await raw.get(f"{prefix}:version") == "2"
        audit = await a.audit()
        assert [e.action for e in audit] == ["restore", "create"] and audit[0].before is None
        await raw.mset({f"{prefix}:version": 1, f"{prefix}:policies": "[]"})  # an older state comes back
        assert (await a.load()).policies == (EU,)
        assert await raw.get(f"{prefix}:version") == "2"
        assert (await a.audit())[0].before == {"version": 1}
        with pytest.raises(VersionConflict):  # nothing is built on a version older than one seen
            await a.commit([], entry(2), expected_version=1)
        # a replica that starts with only a disk snapshot restores it too, and adopts newer ones
        b = RedisPolicyStore(redis, [], prefix=prefix)
        b.remember(KnownState(Snapshot(5, (EU,)), ()))
        assert (await b.load()).version == 5 and await raw.get(f"{prefix}:version") == "5"
        await b.close()
        assert (await a.load()).version == 5  # newer: adopted
    finally:
        await a.close()
        await raw.aclose()


@pytest.mark.slow
async def test_redis_store_calls_are_bounded_when_redis_hangs_or_is_down(tmp_path: Path) -> None:
    proc = RedisProc(tmp_path)
    proc.start()
    store = RedisPolicyStore(proc.url, [], timeout_s=0.3)
    try:
        assert (await store.load()).version == 1
        for broken in ("hung", "down"):
            if broken == "hung":
                proc.pause()
            else:
                proc.resume()
                proc.stop()
            for call in (store.load, lambda: store.commit([EU], entry(2), 1), store.audit):
                t0 = time.monotonic()
                with pytest.raises(StoreUnavailable):
                    await call()  # type: ignore[operator]
                assert time.monotonic() - t0 < 0.3 + 0.5, broken
        proc.start()  # back, empty: restored from what the store saw
        assert (await store.load()).version == 1
    finally:
        await store.close()
        proc.stop()


async def test_redis_store_with_unreadable_data_is_unavailable_not_a_crash(redis: str) -> None:
    import redis.asyncio as aioredis

    prefix = f"test:{uuid.uuid4().hex}"
    raw = aioredis.from_url(redis, decode_responses=True)
    store = RedisPolicyStore(redis, [], prefix=prefix)
    try:
        await raw.mset({f"{prefix}:version": 3, f"{prefix}:policies": "{not json"})
        with pytest.raises(StoreUnavailable):
            await store.load()
        await raw.mset({f"{prefix}:policies": json.dumps([{"tenant": "t", "colour": "red"}])})
        with pytest.raises(StoreUnavailable):
            await store.load()
    finally:
        await store.close()
        await raw.aclose()


def test_snapshot_file_round_trip_and_unreadable_files(tmp_path: Path) -> None:
    f = SnapshotFile(tmp_path / "state", "redis://h:1/0#p")
    assert f.read() is None
    state = KnownState(Snapshot(7, (EU,)), (entry(7),))
    f.write(state)
    assert f.read() == state
    assert [p.name for p in (tmp_path / "state").iterdir()] == [f.path.name]  # no temp files left
    assert SnapshotFile(tmp_path / "state", "redis://other:1/0#p").read() is None  # another store's lineage
    other = SnapshotFile(tmp_path / "state", "memory#x")
    other.path.write_text(json.dumps({"format": 1, "store": "memory#x", "version": 2,
                                      "policies": [{"tenant": "t", "colour": "red"}]}))
    assert other.read() is None
    other.path.write_text("{half")
    assert other.read() is None


async def test_memory_store_starts_from_its_known_state() -> None:
    store = MemoryPolicyStore([RegionPolicy(tenant="seed")], known=KnownState(Snapshot(4, (EU,)), (entry(4),)))
    assert (await store.load()).version == 4 and [e.version for e in await store.audit()] == [4]
    assert await store.commit([], entry(5, "delete"), expected_version=4) == 5
    assert store.known().version == 5 and [e.action for e in store.known().audit] == ["delete", "create"]


class _FlakyStore:
    """Knows nothing until a load answers; `down` makes loads fail as an unreachable store's do."""

    identity = "flaky"

    def __init__(self, down: bool) -> None:
        self.down = down
        self._known: KnownState | None = None

    async def load(self) -> Snapshot:
        if self.down:
            raise StoreUnavailable("connection refused")
        self._known = KnownState(Snapshot(1, ()))
        return self._known.snapshot

    def known(self) -> KnownState | None:
        return self._known


class _Chooser:
    def set_policies(self, policies: object) -> None:
        pass


@pytest.mark.parametrize("down_first", [False, True])
async def test_the_first_answer_warns_only_if_requests_were_refused_before_it(
        down_first: bool, caplog: pytest.LogCaptureFixture) -> None:
    """A gateway without a saved snapshot refuses routing until its policy store answers. At a
    normal start the first load answers and nothing was refused: no warning ("serving again" at
    every start read as an incident). Only after loads failed is the answer a recovery to warn of."""
    store = _FlakyStore(down=down_first)
    sync = PolicySync(store, _Chooser(), None)  # type: ignore[arg-type]
    assert not sync.known
    with caplog.at_level(logging.INFO, "tokenfleet.gateway"):
        if down_first:
            assert not await sync.sync_once()
            store.down = False
        assert await sync.sync_once() and sync.known
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if down_first:
        assert any("refusing requests until it answers" in w for w in warnings)
        assert any("serving again" in w for w in warnings)
    else:
        assert warnings == []
        assert any("version 1 from the store" in r.getMessage() for r in caplog.records)
