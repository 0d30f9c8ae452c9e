"""Where region policies live while the gateway runs: versioned, audited, shared by replicas.

`MemoryPolicyStore` serves a single gateway. `RedisPolicyStore` lets several gateway
replicas serve one fleet: every write bumps one version counter and appends to one
audit list atomically (a MULTI/EXEC transaction watched on the version key), and
each replica picks up a newer version within its poll interval (`watch`). No
home-made consensus: Redis orders the writes.

Residency is a security policy, so the stores fail closed:

- Versions only go forward. Each store remembers the newest state it has seen
  (`known()`: version, policies, audit tail; the gateway also keeps it on local disk,
  `gateway.policy_snapshot`). When Redis comes back empty, or holds an older version
  than that (a restart without persistence, an old backup, a replica that seeded it
  from its fleet file meanwhile), the store writes the known state back, with a
  `restore` audit entry, instead of adopting the older one. Only a store that has
  never been seen by this gateway is seeded from the fleet file.
- Every Redis call has a deadline (`timeout_s`, the fleet file's
  `gateway.store_timeout_s`): socket connect/read timeouts in redis-py and an
  `asyncio.wait_for` over each whole operation. A store that is down, hung or holds
  unreadable data raises `StoreUnavailable` — never a hang, never a bare Redis error.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

from pydantic import ValidationError

from fleetcore.region_policy import RegionPolicy

log = logging.getLogger("tokenfleet.gateway")

AUDIT_TAIL = 200  # audit entries kept with the known state (on disk, and restored with it)
_AUDIT_MAX = 10_000  # audit entries a store keeps in all
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class AuditEntry:
    version: int
    at: float  # unix time
    actor: str  # who (a key fingerprint, never the key; "gateway" for a restore)
    action: str  # create | update | delete | restore
    tenant: str
    model: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class Snapshot:
    version: int
    policies: tuple[RegionPolicy, ...]


@dataclass(frozen=True, slots=True)
class KnownState:
    """The newest state a store has seen: what it restores when the shared store loses it."""

    snapshot: Snapshot
    audit: tuple[AuditEntry, ...] = ()  # newest first, at most AUDIT_TAIL

    @property
    def version(self) -> int:
        return self.snapshot.version


class VersionConflict(Exception):
    """Someone else changed the policies since the caller read them."""


class StoreUnavailable(Exception):
    """The store did not answer within its deadline, refused the connection, or holds data
    the gateway cannot read. Callers keep the policies they have and retry later."""


class PolicyStore(Protocol):
    identity: str  # names the store's lineage (the durable snapshot file is kept per identity)

    async def load(self) -> Snapshot: ...

    async def commit(self, policies: Sequence[RegionPolicy], entry: AuditEntry, expected_version: int) -> int: ...

    async def audit(self, limit: int = 100) -> list[AuditEntry]: ...

    def known(self) -> KnownState | None: ...

    def remember(self, state: KnownState) -> None: ...


class MemoryPolicyStore:
    """One gateway's policies in process. Started from `known` (the durable snapshot) when given,
    else from the fleet file's policies at version 1."""

    identity = "memory"

    def __init__(self, initial: Sequence[RegionPolicy] = (), known: KnownState | None = None) -> None:
        self._snap = known.snapshot if known else Snapshot(1, tuple(initial))
        self._audit: list[AuditEntry] = list(reversed(known.audit)) if known else []  # oldest first
        self._lock = asyncio.Lock()

    async def load(self) -> Snapshot:
        return self._snap

    async def commit(self, policies: Sequence[RegionPolicy], entry: AuditEntry, expected_version: int) -> int:
        async with self._lock:
            if self._snap.version != expected_version:
                raise VersionConflict(f"policies are at version {self._snap.version}, not {expected_version}")
            self._snap = Snapshot(expected_version + 1, tuple(policies))
            self._audit.append(entry)
            del self._audit[:-_AUDIT_MAX]
            return self._snap.version

    async def audit(self, limit: int = 100) -> list[AuditEntry]:
        return list(reversed(self._audit[-limit:]))

    def known(self) -> KnownState:
        return KnownState(self._snap, tuple(reversed(self._audit[-AUDIT_TAIL:])))

    def remember(self, state: KnownState) -> None:
        if state.version > self._snap.version:
            self._snap = state.snapshot
            self._audit = list(reversed(state.audit))


class RedisPolicyStore:
    """Keys: `{prefix}:version`, `{prefix}:policies` (JSON), `{prefix}:audit` (list, newest first)."""

    def __init__(self, url: str, initial: Sequence[RegionPolicy] = (), prefix: str = "tokenfleet:region-policies",
                 *, timeout_s: float = 1.0, known: KnownState | None = None, actor: str | None = None) -> None:
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.timeout_s = timeout_s
        self.url = url  # the replicas' other shared state lives in the same Redis (gateway.replica_state)
        # No retries inside redis-py: one attempt per deadline; the watch loop is the retry.
        # A bounded pool: when every connection is stuck, the next call fails instead of queueing.
        self._redis = aioredis.from_url(url, decode_responses=True, socket_timeout=timeout_s,
                                        socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
                                        max_connections=32)
        self._initial = tuple(initial)
        self._k = prefix
        self._known = known
        self._actor = actor or f"gateway:{socket.gethostname()}"  # who restored, in the audit log
        parts = urlsplit(url)  # never the password
        self.identity = f"redis://{parts.hostname}:{parts.port or 6379}{parts.path or '/0'}#{prefix}"

    async def close(self) -> None:
        await self._redis.aclose()

    def known(self) -> KnownState | None:
        return self._known

    def remember(self, state: KnownState) -> None:
        """Raise the version floor to `state` (the durable snapshot read at start)."""
        if self._known is None or state.version > self._known.version:
            self._known = state

    async def _bounded(self, op: Coroutine[Any, Any, _T]) -> _T:
        from redis.exceptions import RedisError

        try:
            return await asyncio.wait_for(op, self.timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            raise StoreUnavailable(f"the policy store did not answer within {self.timeout_s:g} s") from None
        except (RedisError, OSError) as e:
            raise StoreUnavailable(f"the policy store is unreachable ({type(e).__name__}: {e})") from None
        except (ValueError, TypeError, ValidationError) as e:  # JSON or schema: data we cannot trust
            raise StoreUnavailable(f"the policy store holds unreadable policies ({type(e).__name__})") from None

    async def load(self) -> Snapshot:
        return await self._bounded(self._load())

    async def _load(self) -> Snapshot:
        keys = (f"{self._k}:version", f"{self._k}:policies")
        for _ in range(4):  # each pass either settles or wrote something that the next pass reads
            raw_version, raw = await self._redis.mget(*keys)
            known = self._known
            if raw_version is None:
                if known is None:
                    # A store no gateway has used yet: seed it from the fleet file.
                    await self._write_if_version(None, Snapshot(1, self._initial), ())
                else:
                    await self._restore(known, None, "the policy store came back empty")
                continue
            version = int(raw_version)
            if known is not None and version < known.version:
                await self._restore(known, version, f"the policy store held version {version}, older than "
                                                    f"the last known good version {known.version}")
                continue
            if known is not None and version == known.version:
                return known.snapshot
            snap = Snapshot(version, tuple(RegionPolicy.model_validate(p) for p in json.loads(raw or "[]")))
            rows = await self._redis.lrange(f"{self._k}:audit", 0, AUDIT_TAIL - 1)
            self._known = KnownState(snap, tuple(AuditEntry(**json.loads(r)) for r in rows))
            return snap
        raise StoreUnavailable("the policy store kept changing while it was read")

    async def _restore(self, known: KnownState, seen: int | None, reason: str) -> None:
        entry = AuditEntry(known.version, now_unix(), self._actor, "restore", "*", "*",
                           None if seen is None else {"version": seen},
                           {"version": known.version, "policies": len(known.snapshot.policies), "reason": reason})
        audit = (entry, *known.audit)[:AUDIT_TAIL]
        if await self._write_if_version(seen, known.snapshot, audit, replace_audit=True):
            log.warning("region policies: %s; restored version %d (%d policies) from this gateway's last known "
                        "good state", reason, known.version, len(known.snapshot.policies))
            if self._known is known:
                self._known = KnownState(known.snapshot, audit)

    async def _write_if_version(self, seen: int | None, snap: Snapshot, audit: Sequence[AuditEntry],
                                replace_audit: bool = False) -> bool:
        """Write `snap` (and, with `replace_audit`, `audit` as the whole log) if the version key still
        reads `seen`; False when another writer got there first (the caller re-reads)."""
        from redis.exceptions import WatchError

        async with self._redis.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(f"{self._k}:version")
                current = await pipe.get(f"{self._k}:version")
                if (None if current is None else int(current)) != seen:
                    return False
                pipe.multi()
                pipe.set(f"{self._k}:policies", _dump(snap.policies))
                pipe.set(f"{self._k}:version", snap.version)
                if replace_audit:
                    pipe.delete(f"{self._k}:audit")
                    if audit:
                        pipe.rpush(f"{self._k}:audit", *(json.dumps(asdict(e)) for e in audit))
                await pipe.execute()
                return True
            except WatchError:
                return False

    async def commit(self, policies: Sequence[RegionPolicy], entry: AuditEntry, expected_version: int) -> int:
        return await self._bounded(self._commit(policies, entry, expected_version))

    async def _commit(self, policies: Sequence[RegionPolicy], entry: AuditEntry, expected_version: int) -> int:
        from redis.exceptions import WatchError

        known = self._known
        if known is not None and expected_version < known.version:
            # Never build on a version older than one already seen (the store may have lost data).
            raise VersionConflict(f"policies are at version {known.version}, not {expected_version}")
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
                pipe.ltrim(f"{self._k}:audit", 0, _AUDIT_MAX - 1)
                await pipe.execute()
            except WatchError:
                raise VersionConflict("policies changed during the update") from None
        version = expected_version + 1
        tail = known.audit if known is not None else ()
        if self._known is None or version > self._known.version:
            self._known = KnownState(Snapshot(version, tuple(policies)), (entry, *tail)[:AUDIT_TAIL])
        return version

    async def audit(self, limit: int = 100) -> list[AuditEntry]:
        rows = await self._bounded(self._redis.lrange(f"{self._k}:audit", 0, max(0, limit - 1)))
        try:
            return [AuditEntry(**json.loads(r)) for r in rows]
        except (ValueError, TypeError) as e:
            raise StoreUnavailable(f"the policy store holds an unreadable audit log ({type(e).__name__})") from None


def _dump(policies: Sequence[RegionPolicy]) -> str:
    return json.dumps([p.model_dump(exclude_defaults=True) for p in policies])


def fleet_identity(sites: Sequence[str], tenants: Sequence[str], models: Sequence[str],
                   policies: Sequence[RegionPolicy]) -> str:
    """A short digest naming one fleet's policy lineage for a single gateway (MemoryPolicyStore):
    a fleet file with other sites, tenants, models or seed policies starts from its own."""
    canon = json.dumps([sorted(sites), sorted(tenants), sorted(models),
                        sorted(json.dumps(p.model_dump(), sort_keys=True) for p in policies)])
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


async def watch(store: PolicyStore, apply: Callable[[Snapshot], Awaitable[None] | None],
                interval_s: float = 0.5) -> None:
    """Apply every newer snapshot (changes made through another replica) until cancelled.
    Never an older one: versions only go forward."""
    seen = -1
    while True:
        try:
            snap = await store.load()
            if snap.version > seen:
                seen = snap.version
                result = apply(snap)
                if result is not None:
                    await result
            elif snap.version < seen:
                log.error("region policy store offered version %d, older than %d: ignored", snap.version, seen)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the store is briefly unreachable: keep the policies we have
            log.warning("region policy store unreachable: %s", e)
        await asyncio.sleep(interval_s)


def now_unix() -> float:
    return time.time()
