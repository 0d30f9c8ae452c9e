"""Where region policies live while the gateway runs: versioned, audited, shared by replicas.

`MemoryPolicyStore` serves a single gateway. `RedisPolicyStore` lets several gateway
replicas serve one fleet: every write bumps one version counter and appends to one
audit list atomically (a MULTI/EXEC transaction watched on the version key), and
each replica picks up a newer version within its poll interval (`watch`). No
home-made consensus: Redis orders the writes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from fleetcore.region_policy import RegionPolicy

log = logging.getLogger("tokenfleet.gateway")


@dataclass(frozen=True, slots=True)
class AuditEntry:
    version: int
    at: float  # unix time
    actor: str  # who (a key fingerprint, never the key)
    action: str  # create | update | delete
    tenant: str
    model: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class Snapshot:
    version: int
    policies: tuple[RegionPolicy, ...]


class VersionConflict(Exception):
    """Someone else changed the policies since the caller read them."""


class PolicyStore(Protocol):
    async def load(self) -> Snapshot: ...

    async def commit(self, policies: Sequence[RegionPolicy], entry: AuditEntry, expected_version: int) -> int: ...

    async def audit(self, limit: int = 100) -> list[AuditEntry]: ...


class MemoryPolicyStore:
    def __init__(self, initial: Sequence[RegionPolicy] = ()) -> None:
        self._snap = Snapshot(1, tuple(initial))
        self._audit: list[AuditEntry] = []
        self._lock = asyncio.Lock()

    async def load(self) -> Snapshot:
        return self._snap

    async def commit(self, policies: Sequence[RegionPolicy], entry: AuditEntry, expected_version: int) -> int:
        async with self._lock:
            if self._snap.version != expected_version:
                raise VersionConflict(f"policies are at version {self._snap.version}, not {expected_version}")
            self._snap = Snapshot(expected_version + 1, tuple(policies))
            self._audit.append(entry)
            return self._snap.version

    async def audit(self, limit: int = 100) -> list[AuditEntry]:
        return list(reversed(self._audit[-limit:]))


class RedisPolicyStore:
    """Keys: `{prefix}:version`, `{prefix}:policies` (JSON), `{prefix}:audit` (list, newest first)."""

    def __init__(self, url: str, initial: Sequence[RegionPolicy] = (), prefix: str = "tokenfleet:region-policies") -> None:
        import redis.asyncio as aioredis

        self._redis = aioredis.from_url(url, decode_responses=True)
        self._initial = tuple(initial)
        self._k = prefix

    async def close(self) -> None:
        await self._redis.aclose()

    async def load(self) -> Snapshot:
        version, raw = await self._redis.mget(f"{self._k}:version", f"{self._k}:policies")
        if version is None:
            # First gateway up seeds the store from its fleet file; later ones adopt what is there.
            await self._redis.set(f"{self._k}:policies", _dump(self._initial), nx=True)
            await self._redis.set(f"{self._k}:version", 1, nx=True)
            version, raw = await self._redis.mget(f"{self._k}:version", f"{self._k}:policies")
        return Snapshot(int(version), tuple(RegionPolicy.model_validate(p) for p in json.loads(raw or "[]")))

    async def commit(self, policies: Sequence[RegionPolicy], entry: AuditEntry, expected_version: int) -> int:
        from redis.exceptions import WatchError

        async with self._redis.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(f"{self._k}:version")
                current = int(await pipe.get(f"{self._k}:version") or 0)
                if current != expected_version:
                    raise VersionConflict(f"policies are at version {current}, not {expected_version}")
                pipe.multi()
                pipe.set(f"{self._k}:policies", _dump(policies))
                pipe.set(f"{self._k}:version", expected_version + 1)
                pipe.lpush(f"{self._k}:audit", json.dumps(asdict(entry)))
                pipe.ltrim(f"{self._k}:audit", 0, 9999)
                await pipe.execute()
            except WatchError:
                raise VersionConflict("policies changed during the update") from None
        return expected_version + 1

    async def audit(self, limit: int = 100) -> list[AuditEntry]:
        rows = await self._redis.lrange(f"{self._k}:audit", 0, max(0, limit - 1))
        return [AuditEntry(**json.loads(r)) for r in rows]


def _dump(policies: Sequence[RegionPolicy]) -> str:
    return json.dumps([p.model_dump(exclude_defaults=True) for p in policies])


async def watch(store: PolicyStore, apply: Callable[[Snapshot], Awaitable[None] | None],
                interval_s: float = 0.5) -> None:
    """Apply every newer snapshot (changes made through another replica) until cancelled."""
    seen = -1
    while True:
        try:
            snap = await store.load()
            if snap.version != seen:
                seen = snap.version
                result = apply(snap)
                if result is not None:
                    await result
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the store is briefly unreachable: keep the policies we have
            log.warning("region policy store unreachable: %s", e)
        await asyncio.sleep(interval_s)


def now_unix() -> float:
    return time.time()
