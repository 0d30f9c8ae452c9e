"""Durable admin state: one small store interface, a SQLite file for one replica, Redis for several.

What ops change at run time — region policies and their audit log, the planner mode, and
later API keys — must survive a restart. The interface is generic on purpose (`AdminKV`):
string values by key, and append-only logs read newest first; plus one atomic step,
`commit_versioned`, that checks a version key, writes values and appends a log entry
together (what a versioned, audited change needs).

- `SqliteKV`: a file under the state dir (`gateway.state_dir`, else $TOKENFLEET_STATE_DIR),
  WAL journal, `synchronous=FULL` (a change the API acknowledged survives a power cut).
  sqlite3 blocks, so each call runs in a worker thread, bounded by `store_timeout_s`.
  A single replica never needs Redis.
- `RedisKV`: the same over the replicas' shared Redis (`gateway.shared_state`).

`SqlitePolicyStore` is the region-policy store (`gateway.policy_store.PolicyStore`) on a
`SqliteKV`, with the same fail-closed rules as the Redis one: versions only go forward (a
file older than the durable snapshot is restored from it), and an unreadable file is
`StoreUnavailable`, never a crash.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol, TypeVar

from pydantic import ValidationError

from fleetcore.region_policy import RegionPolicy
from gateway.policy_store import (_AUDIT_MAX, AUDIT_TAIL, AuditEntry, KnownState, Snapshot, StoreUnavailable,
                                  VersionConflict, now_unix)

_T = TypeVar("_T")


class AdminKV(Protocol):
    identity: str

    async def get(self, key: str) -> str | None: ...

    async def set(self, key: str, value: str) -> None: ...

    async def append(self, log: str, entry: str, keep: int = _AUDIT_MAX) -> None: ...

    async def tail(self, log: str, limit: int) -> list[str]: ...  # newest first


class SqliteKV:
    def __init__(self, path: Path, *, timeout_s: float = 1.0) -> None:
        self.path = path
        self.identity = f"sqlite://{path}"
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # one connection, one statement at a time
        self._db: sqlite3.Connection | None = None

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            db = sqlite3.connect(self.path, timeout=self.timeout_s, check_same_thread=False, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.execute("CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            db.execute("CREATE TABLE IF NOT EXISTS log (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
                       "name TEXT NOT NULL, entry TEXT NOT NULL)")
            db.execute("CREATE INDEX IF NOT EXISTS log_name ON log (name, seq)")
            self._db = db
        return self._db

    async def _run(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        def locked() -> _T:
            with self._lock:
                return fn(self._conn())
        try:
            return await asyncio.wait_for(asyncio.to_thread(locked), self.timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            raise StoreUnavailable(f"the admin store {self.path} did not answer within {self.timeout_s:g} s") from None
        except (sqlite3.Error, OSError) as e:
            raise StoreUnavailable(f"the admin store {self.path} is unusable ({type(e).__name__}: {e})") from None

    async def get(self, key: str) -> str | None:
        def op(db: sqlite3.Connection) -> str | None:
            row = db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
            return None if row is None else str(row[0])
        return await self._run(op)

    async def set(self, key: str, value: str) -> None:
        await self._run(lambda db: db.execute("INSERT INTO kv VALUES (?, ?) ON CONFLICT(key) DO UPDATE "
                                              "SET value = excluded.value", (key, value)))

    async def append(self, log: str, entry: str, keep: int = _AUDIT_MAX) -> None:
        def op(db: sqlite3.Connection) -> None:
            with db:
                db.execute("BEGIN IMMEDIATE")
                _append(db, log, entry, keep)
        await self._run(op)

    async def tail(self, log: str, limit: int) -> list[str]:
        return await self._run(lambda db: [str(r[0]) for r in db.execute(
            "SELECT entry FROM log WHERE name = ? ORDER BY seq DESC LIMIT ?", (log, max(0, limit)))])

    async def commit_versioned(self, version_key: str, expected: int | None, new_version: int,
                               values: dict[str, str], log: str | None = None, entries: Sequence[str] = (),
                               replace_log: bool = False) -> bool:
        """In one transaction: if `version_key` reads `expected` (None: absent), write `values` and
        the new version, and append `entries` (oldest first) to `log` (replacing it, with
        `replace_log`). False when the version was another."""
        def op(db: sqlite3.Connection) -> bool:
            db.execute("BEGIN IMMEDIATE")  # the write lock first: no one changes the version meanwhile
            try:
                row = db.execute("SELECT value FROM kv WHERE key = ?", (version_key,)).fetchone()
                if (None if row is None else int(row[0])) != expected:
                    db.execute("ROLLBACK")
                    return False
                for k, v in {**values, version_key: str(new_version)}.items():
                    db.execute("INSERT INTO kv VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                               (k, v))
                if log is not None:
                    if replace_log:
                        db.execute("DELETE FROM log WHERE name = ?", (log,))
                    for e in entries:
                        _append(db, log, e, _AUDIT_MAX)
                db.execute("COMMIT")
                return True
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
        return await self._run(op)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None


def _append(db: sqlite3.Connection, log: str, entry: str, keep: int) -> None:
    cur = db.execute("INSERT INTO log (name, entry) VALUES (?, ?)", (log, entry))
    db.execute("DELETE FROM log WHERE name = ? AND seq <= ?", (log, int(cur.lastrowid or 0) - keep))


class RedisKV:
    """`AdminKV` on the replicas' shared Redis: keys `{prefix}:admin:{key}`, logs as lists."""

    def __init__(self, shared: Any) -> None:  # gateway.shared_state.SharedRedis
        self.shared = shared
        self.identity = f"{shared.url.split('@')[-1]}#{shared.prefix}:admin"

    def _k(self, key: str) -> str:
        return self.shared.key("admin", key)

    async def get(self, key: str) -> str | None:
        return await self.shared.call("admin_get", self.shared.redis.get(self._k(key)))  # type: ignore[no-any-return]

    async def set(self, key: str, value: str) -> None:
        await self.shared.call("admin_set", self.shared.redis.set(self._k(key), value))

    async def append(self, log: str, entry: str, keep: int = _AUDIT_MAX) -> None:
        async with self.shared.redis.pipeline(transaction=True) as pipe:
            pipe.lpush(self._k(log), entry)
            pipe.ltrim(self._k(log), 0, keep - 1)
            await self.shared.call("admin_append", pipe.execute())

    async def tail(self, log: str, limit: int) -> list[str]:
        return await self.shared.call("admin_tail", self.shared.redis.lrange(self._k(log), 0, max(0, limit - 1)))  # type: ignore[no-any-return]


class SqlitePolicyStore:
    """Region policies in a `SqliteKV`: keys `policies:version`, `policies` (JSON), log `policies:audit`."""

    def __init__(self, kv: SqliteKV, initial: Sequence[RegionPolicy] = (), *, identity: str,
                 known: KnownState | None = None) -> None:
        self.kv = kv
        self.identity = identity  # the durable snapshot's lineage
        self._initial = tuple(initial)
        self._known = known

    def known(self) -> KnownState | None:
        return self._known

    def remember(self, state: KnownState) -> None:
        if self._known is None or state.version > self._known.version:
            self._known = state

    async def load(self) -> Snapshot:
        for _ in range(4):
            raw_version = await self.kv.get("policies:version")
            known = self._known
            if raw_version is None or (known is not None and int(raw_version) < known.version):
                # A new file (seed it), or one older than what this gateway already knew (restore it).
                state = known or KnownState(Snapshot(1, self._initial))
                entries = [json.dumps(asdict(e)) for e in reversed(state.audit)]
                await self.kv.commit_versioned("policies:version", None if raw_version is None else int(raw_version),
                                               state.version, {"policies": _dump(state.snapshot.policies)},
                                               "policies:audit", entries, replace_log=True)
                continue
            version = int(raw_version)
            if known is not None and version == known.version:
                return known.snapshot
            try:
                snap = Snapshot(version, tuple(RegionPolicy.model_validate(p)
                                               for p in json.loads(await self.kv.get("policies") or "[]")))
                audit = tuple(AuditEntry(**json.loads(r)) for r in await self.kv.tail("policies:audit", AUDIT_TAIL))
            except (ValueError, TypeError, ValidationError) as e:
                raise StoreUnavailable(f"the admin store holds unreadable policies ({type(e).__name__})") from None
            self._known = KnownState(snap, audit)
            return snap
        raise StoreUnavailable("the admin store kept changing while it was read")

    async def commit(self, policies: Sequence[RegionPolicy], entry: AuditEntry, expected_version: int) -> int:
        known = self._known
        if known is not None and expected_version < known.version:
            raise VersionConflict(f"policies are at version {known.version}, not {expected_version}")
        ok = await self.kv.commit_versioned("policies:version", expected_version, expected_version + 1,
                                            {"policies": _dump(policies)}, "policies:audit",
                                            [json.dumps(asdict(entry))])
        if not ok:
            current = await self.kv.get("policies:version")
            raise VersionConflict(f"policies are at version {current}, not {expected_version}")
        version = expected_version + 1
        tail = known.audit if known is not None else ()
        self._known = KnownState(Snapshot(version, tuple(policies)), (entry, *tail)[:AUDIT_TAIL])
        return version

    async def audit(self, limit: int = 100) -> list[AuditEntry]:
        rows = await self.kv.tail("policies:audit", limit)
        try:
            return [AuditEntry(**json.loads(r)) for r in rows]
        except (ValueError, TypeError) as e:
            raise StoreUnavailable(f"the admin store holds an unreadable audit log ({type(e).__name__})") from None


def _dump(policies: Sequence[RegionPolicy]) -> str:
    return json.dumps([p.model_dump(exclude_defaults=True) for p in policies])


__all__ = ["AdminKV", "RedisKV", "SqliteKV", "SqlitePolicyStore", "now_unix"]
