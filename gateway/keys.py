"""Tenant API keys managed by API (`/admin/v1/keys`), next to the fleet file's own keys.

    POST   /admin/v1/keys                {"tenant", "name"?, "expires_at"?}  201, the key shown once
    GET    /admin/v1/keys                ids, names, tenants, created / last used / expiry (never a key or hash)
    DELETE /admin/v1/keys/{id}           revoke (the key stops working at once)
    POST   /admin/v1/keys/{id}/rotate    a new secret for the same id, shown once; the old one stops working
    GET    /admin/v1/keys/audit          who created, revoked, rotated which key, newest first

Admin key required. Keys are stored as their SHA-256 only (like the fleet file's
`api_key_sha256`); the plain key exists in the 201/rotate answer and nowhere else.

Keys live in the durable admin store (`gateway.admin_store.AdminKV`, `KVKeyStore`): the
SQLite file under the state directory for one gateway, the shared Redis with several
replicas, so a key created on one replica works on all of them. Authentication reads
`lookup` synchronously from memory on every request; each replica refreshes that view every
`KEY_REFRESH_S` (one bounded store call unless something changed), so a revocation or
rotation made on any replica takes effect everywhere within about that period (well under
2 s). Every store call is bounded by `gateway.store_timeout_s`; the admin calls answer 503
`admin_store_unavailable` when it is down. While the store cannot be read a replica keeps
the last key set it knew (it never accepts a key that set lacks; a revocation made elsewhere
meanwhile waits until the store answers); a replica that starts without it accepts no
stored key. Last-used times are written lazily (at most one write per key per
`LAST_USED_FLUSH_S`), never per request.

`budgets` (same shape as a tenant's in the fleet file) are the key's own limits, enforced by
the gateway in addition to the tenant's (`gateway.key_budgets`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import secrets
import time
from dataclasses import asdict, dataclass, replace
from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pydantic import ValidationError

from fleetcore.admission_config import BudgetConfig
from fleetcore.fleet_config import FleetConfig, hash_api_key
from gateway.background import cancel_and_wait
from gateway.errors import GatewayError, bad_request
from gateway.json_body import parse_json_object
from gateway.logs import emit
from gateway.policy_store import StoreUnavailable

_T = TypeVar("_T")
log = logging.getLogger("tokenfleet.gateway")
audit_log = logging.getLogger("tokenfleet.audit")

KEY_PREFIX = "sk-tf-"
LAST_USED_FLUSH_S = 60.0
KEY_REFRESH_S = 0.5
AUDIT_MAX = 1000
INDEX_MAX = 1_000_000  # keys ever created that the index remembers
_NAME_MAX = 200
_LATEST = 253402300799.0  # 9999-12-31T23:59:59Z


@dataclass(frozen=True, slots=True)
class KeyRecord:
    id: str
    tenant: str
    sha256: str
    name: str | None = None
    created_at: float = 0.0
    expires_at: float | None = None
    last_used_at: float | None = None
    rotated_at: float | None = None
    revoked_at: float | None = None
    budgets: dict[str, int] | None = None  # this key's own limits, on top of its tenant's

    def public(self) -> dict[str, Any]:
        """What GET shows: never the hash (a hash of a short key can be brute-forced)."""
        return {"id": self.id, "object": "api_key", "tenant": self.tenant, "name": self.name,
                "created_at": _iso(self.created_at), "expires_at": _iso(self.expires_at),
                "last_used_at": _iso(self.last_used_at), "rotated_at": _iso(self.rotated_at),
                "revoked": self.revoked_at is not None, "revoked_at": _iso(self.revoked_at),
                "budgets": self.budgets}

    def usable(self, now: float) -> bool:
        return self.revoked_at is None and (self.expires_at is None or now < self.expires_at)


@dataclass(frozen=True, slots=True)
class KeyAudit:
    at: float
    actor: str  # an admin key's fingerprint, never the key
    action: str  # create | revoke | rotate
    key_id: str
    tenant: str

    def public(self) -> dict[str, Any]:
        return {**asdict(self), "at": _iso(self.at)}


def _iso(t: float | None) -> str | None:
    return None if t is None else dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat().replace("+00:00", "Z")


class KeyStore(Protocol):
    def lookup(self, sha256: str) -> KeyRecord | None: ...  # sync, from memory: on every request
    def record(self, key_id: str) -> KeyRecord | None: ...  # sync, from memory (budgets)
    def touch(self, key_id: str, now: float) -> None: ...  # last used; cheap, persisted lazily
    async def put(self, record: KeyRecord, audit: KeyAudit) -> None: ...  # create or replace, audited
    async def get(self, key_id: str) -> KeyRecord | None: ...  # fresh from the store
    async def all(self) -> list[KeyRecord]: ...
    async def audit(self, limit: int) -> list[KeyAudit]: ...


class KVKeyStore:
    """API keys in the durable admin store (`gateway.admin_store.AdminKV`): SQLite for one
    gateway, Redis shared by several replicas.

    Layout: `keys:rec:{id}` the record (JSON), `keys:revoked:{id}` the revocation time (kept
    apart, so a rotation racing a revocation on another replica cannot turn the key back on),
    `keys:used:{id}` last use (written lazily, never over the record), log `keys:index` (every
    id, once) and log `keys:audit` (create / revoke / rotate, newest first). The audit log is
    also the change feed: every `refresh_s` the store's newest audit entry is read (one
    bounded call); when it differs from the last seen, the whole key set is reloaded.

    A store that cannot be read keeps the last known set: nothing the last known set lacks
    is ever accepted, but a revocation made elsewhere during the outage takes effect only
    once the store answers again. A gateway that starts without the store accepts no stored
    key until the first load succeeds.
    """

    def __init__(self, kv: Any, *, refresh_s: float = KEY_REFRESH_S, clock: Any = time.time) -> None:
        self.kv = kv
        self.refresh_s = refresh_s
        self._clock = clock
        self._records: dict[str, KeyRecord] = {}
        self._by_hash: dict[str, str] = {}
        self._seen: str | None = None  # the newest audit entry the key set reflects
        self._loaded = False
        self._used: dict[str, float] = {}  # last use not yet written
        self._flushed: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    # -- the request path: memory only --------------------------------------------------
    def lookup(self, sha256: str) -> KeyRecord | None:
        key_id = self._by_hash.get(sha256)
        return self._records.get(key_id) if key_id is not None else None

    def record(self, key_id: str) -> KeyRecord | None:
        return self._records.get(key_id)

    def touch(self, key_id: str, now: float) -> None:
        rec = self._records.get(key_id)
        if rec is not None:
            self._records[key_id] = replace(rec, last_used_at=now)
            self._used[key_id] = now

    # -- the view: loaded at start, refreshed in the background ---------------------------
    async def start(self) -> None:
        try:
            await self.refresh()
        except StoreUnavailable as e:
            log.error("api keys: %s; no stored key is accepted until the admin store answers", e)
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        # Cancelled until it ends: every store call is an `asyncio.wait_for`, which on Python 3.11
        # swallows a cancel that lands as the call completes; the loop then went on polling and a
        # plain `await` of it held the gateway's shutdown (its lifespan) for ever.
        task, self._task = self._task, None
        await cancel_and_wait([task])
        with contextlib.suppress(StoreUnavailable):
            await self._flush_used()

    async def _loop(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
                await self._flush_used()
                if failing:
                    log.warning("api keys: the admin store answers again")
                failing = False
            except StoreUnavailable as e:
                if not failing:
                    log.error("api keys: %s; keeping the last known keys (revocations elsewhere wait)", e)
                failing = True
            except Exception:  # a bug must not stop refreshing
                log.exception("api keys: refresh failed")

    async def refresh(self) -> bool:
        """Reload the key set if the store changed since the last load; True when it did.

        Under the same lock as this replica's own changes (`put`): a reload that read the store
        before a local revocation must not install its older set after it (the revoked key would
        work again until the next refresh)."""
        async with self._lock:
            newest = await self.kv.tail("keys:audit", 1)
            head = newest[0] if newest else ""
            if self._loaded and head == self._seen:
                return False
            records = await self._load_all()
            self._records = {r.id: r for r in records}
            self._by_hash = {r.sha256: r.id for r in records}
            self._seen = head
            self._loaded = True
            return True

    async def _load_all(self) -> list[KeyRecord]:
        ids = list(dict.fromkeys(await self.kv.tail("keys:index", INDEX_MAX)))
        out = []
        for key_id in ids:
            rec = await self._read(key_id)
            if rec is not None:
                out.append(rec)
        return sorted(out, key=lambda r: (r.created_at, r.id))

    async def _read(self, key_id: str) -> KeyRecord | None:
        raw = await self.kv.get(f"keys:rec:{key_id}")
        if raw is None:
            return None
        try:
            rec = KeyRecord(**json.loads(raw))
        except (ValueError, TypeError) as e:
            # Fail closed: an unreadable record is no key at all.
            log.error("api keys: unreadable record %s (%s); it is not accepted", key_id, e)
            return None
        revoked = await self.kv.get(f"keys:revoked:{key_id}")
        used = await self.kv.get(f"keys:used:{key_id}")
        if revoked is not None:
            rec = replace(rec, revoked_at=float(revoked))
        if used is not None:
            rec = replace(rec, last_used_at=max(float(used), rec.last_used_at or 0.0))
        local = self._used.get(key_id)
        if local is not None and local > (rec.last_used_at or 0.0):
            rec = replace(rec, last_used_at=local)
        return rec

    async def _flush_used(self) -> None:
        for key_id, t in list(self._used.items()):
            last = self._flushed.get(key_id)
            if last is None or t - last > LAST_USED_FLUSH_S:
                await self.kv.set(f"keys:used:{key_id}", repr(t))
                self._flushed[key_id] = t
            if self._used.get(key_id) == t:
                del self._used[key_id]

    # -- the admin API: straight to the store ----------------------------------------------
    async def put(self, record: KeyRecord, audit: KeyAudit) -> None:
        async with self._lock:
            is_new = record.id not in self._records and await self.kv.get(f"keys:rec:{record.id}") is None
            body = asdict(replace(record, revoked_at=None, last_used_at=None))
            await self.kv.set(f"keys:rec:{record.id}", json.dumps(body))
            if record.revoked_at is not None:
                await self.kv.set(f"keys:revoked:{record.id}", repr(record.revoked_at))
            if is_new:
                await self.kv.append("keys:index", record.id, INDEX_MAX)
            await self.kv.append("keys:audit", json.dumps(asdict(audit)), AUDIT_MAX)
            old = self._records.get(record.id)
            if old is not None:
                self._by_hash.pop(old.sha256, None)
            fresh = await self._read(record.id)  # what the store now says (a revocation elsewhere wins)
            if fresh is not None:
                self._records[record.id] = fresh
                self._by_hash[fresh.sha256] = record.id

    async def get(self, key_id: str) -> KeyRecord | None:
        return await self._read(key_id)

    async def all(self) -> list[KeyRecord]:
        return await self._load_all()

    async def audit(self, limit: int) -> list[KeyAudit]:
        rows = await self.kv.tail("keys:audit", limit)
        try:
            return [KeyAudit(**json.loads(r)) for r in rows]
        except (ValueError, TypeError) as e:
            raise StoreUnavailable(f"the admin store holds an unreadable key audit log ({type(e).__name__})") from None


def _audit_line(action: str, actor: str, rec: KeyRecord) -> None:
    """The same structured audit line as the other admin changes (`tokenfleet.audit`, gateway.admin)."""
    emit(audit_log, logging.INFO, {"event": "api_key", "action": action, "actor": actor, "key_id": rec.id,
                                   "tenant": rec.tenant})


def _parse_budgets(value: Any) -> dict[str, int] | None:
    """The same shape as a tenant's `budgets` in the fleet file (`BudgetConfig`)."""
    if value is None:
        return None
    try:
        parsed = BudgetConfig.model_validate(value)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        loc = ".".join(["budgets", *(str(p) for p in first["loc"])])
        raise bad_request(f"{loc}: {first['msg']}", loc) from None
    return parsed.model_dump(exclude_none=True) or None


async def _bounded(op: Awaitable[_T]) -> _T:
    """An admin-store call (bounded by `gateway.store_timeout_s`): 503 when the store is down."""
    try:
        return await op
    except StoreUnavailable as e:
        raise GatewayError(503, f"The admin store is unavailable: {e}", type="server_error",
                           code="admin_store_unavailable", headers={"Retry-After": "1"}) from None


def new_secret() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def _parse_expiry(value: Any, now: float) -> float | None:
    """RFC 3339 text (`2027-01-01T00:00:00Z`) or unix seconds; must lie in the future."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        t = float(value)
    elif isinstance(value, str):
        try:
            parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise bad_request(f"`expires_at` must be an RFC 3339 time or unix seconds; got {value!r}.",
                              "expires_at") from None
        if parsed.tzinfo is None:
            raise bad_request("`expires_at` needs a time zone (e.g. a trailing Z).", "expires_at")
        t = parsed.timestamp()
    else:
        raise bad_request("`expires_at` must be an RFC 3339 time or unix seconds.", "expires_at")
    if not t > now:
        raise bad_request("`expires_at` is not in the future.", "expires_at")
    if not t < _LATEST:  # beyond what a datetime can show (and NaN): a 400, not a 500 when listed
        raise bad_request("`expires_at` must be before the year 10000.", "expires_at")
    return t


def install_key_routes(app: FastAPI, config: FleetConfig, store: KeyStore, require_admin: Any,
                       clock: Any = time.time) -> None:
    """`require_admin(headers) -> actor` is the admin API's check (401 / 403)."""
    tenants = {t.name for t in config.tenants}

    def not_found(key_id: str) -> GatewayError:
        return GatewayError(404, f"No API key with id {key_id!r}.", code="key_not_found")

    async def body_of(request: Request) -> dict[str, Any]:
        raw = await request.body()
        return parse_json_object(raw or b"{}", max_depth=8, max_values=64)

    @app.post("/admin/v1/keys")
    async def create_key(request: Request) -> JSONResponse:
        actor = require_admin(request.headers)
        body = await body_of(request)
        for k in body:
            if k not in ("tenant", "name", "expires_at", "budgets"):
                raise bad_request(f"Unknown field `{k}`.", k)
        tenant = body.get("tenant")
        if not isinstance(tenant, str) or tenant not in tenants:
            raise bad_request(f"`tenant` must be one of the fleet's tenants {sorted(tenants)}; got {tenant!r}.",
                              "tenant")
        name = body.get("name")
        if name is not None and (not isinstance(name, str) or len(name) > _NAME_MAX):
            raise bad_request(f"`name` must be a string of at most {_NAME_MAX} characters.", "name")
        now = clock()
        expires = _parse_expiry(body.get("expires_at"), now)
        budgets = _parse_budgets(body.get("budgets"))
        secret = new_secret()
        rec = KeyRecord(f"key_{secrets.token_hex(8)}", tenant, hash_api_key(secret), name, now, expires,
                        budgets=budgets)
        await _bounded(store.put(rec, KeyAudit(now, actor, "create", rec.id, tenant)))
        _audit_line("create", actor, rec)
        return JSONResponse({**rec.public(), "key": secret}, status_code=201)

    @app.get("/admin/v1/keys")
    async def list_keys(request: Request) -> JSONResponse:
        require_admin(request.headers)
        return JSONResponse({"object": "list", "data": [r.public() for r in await _bounded(store.all())]})

    @app.get("/admin/v1/keys/audit")
    async def key_audit(request: Request, limit: int = 100) -> JSONResponse:
        require_admin(request.headers)
        entries = await _bounded(store.audit(max(1, min(limit, AUDIT_MAX))))
        return JSONResponse({"object": "list", "data": [a.public() for a in entries]})

    @app.delete("/admin/v1/keys/{key_id}")
    async def revoke_key(key_id: str, request: Request) -> JSONResponse:
        actor = require_admin(request.headers)
        rec = await _bounded(store.get(key_id))
        if rec is None:
            raise not_found(key_id)
        if rec.revoked_at is None:
            now = clock()
            rec = replace(rec, revoked_at=now)
            await _bounded(store.put(rec, KeyAudit(now, actor, "revoke", rec.id, rec.tenant)))
            _audit_line("revoke", actor, rec)
        return JSONResponse(rec.public())

    @app.post("/admin/v1/keys/{key_id}/rotate")
    async def rotate_key(key_id: str, request: Request) -> Response:
        actor = require_admin(request.headers)
        rec = await _bounded(store.get(key_id))
        if rec is None:
            raise not_found(key_id)
        if rec.revoked_at is not None:
            raise GatewayError(409, f"API key {key_id!r} is revoked; create a new one.", code="key_revoked")
        now = clock()
        secret = new_secret()
        rec = replace(rec, sha256=hash_api_key(secret), rotated_at=now)
        await _bounded(store.put(rec, KeyAudit(now, actor, "rotate", rec.id, rec.tenant)))
        _audit_line("rotate", actor, rec)
        return JSONResponse({**rec.public(), "key": secret})


def stored_caller_tenant(store: KeyStore | None, digest: str, now: float) -> tuple[str | None, bool]:
    """(tenant, known): the tenant of a usable stored key; known=True when the hash is a stored
    key at all (revoked or expired ones then answer 401 without falling through)."""
    if store is None:
        return None, False
    rec = store.lookup(digest)
    if rec is None:
        return None, False
    if not rec.usable(now):
        return None, True
    store.touch(rec.id, now)
    return rec.tenant, True
