"""Tenant API keys managed by API (`/admin/v1/keys`), next to the fleet file's own keys.

    POST   /admin/v1/keys                {"tenant", "name"?, "expires_at"?}  201, the key shown once
    GET    /admin/v1/keys                ids, names, tenants, created / last used / expiry (never a key or hash)
    DELETE /admin/v1/keys/{id}           revoke (the key stops working at once)
    POST   /admin/v1/keys/{id}/rotate    a new secret for the same id, shown once; the old one stops working
    GET    /admin/v1/keys/audit          who created, revoked, rotated which key, newest first

Admin key required. Keys are stored as their SHA-256 only (like the fleet file's
`api_key_sha256`); the plain key exists in the 201/rotate answer and nowhere else.

Storage sits behind `KeyStore` so a durable shared admin store (SQLite, Redis) can replace it:
`MemoryKeyStore`, and `JsonFileKeyStore` (one JSON file under the state directory, written
atomically, mode 0600). Authentication reads `lookup` synchronously from memory on every
request; mutations are async. Last-used times are kept in memory and written with the next
mutation or when a key's recorded time is more than `LAST_USED_FLUSH_S` old, so a busy key
does not write the file per request. A file that cannot be read fails closed: no stored key
is accepted (fleet-file keys still are) and the error is logged.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import os
import secrets
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from fleetcore.fleet_config import FleetConfig, hash_api_key
from gateway.errors import GatewayError, bad_request
from gateway.json_body import parse_json_object
from gateway.logs import emit

log = logging.getLogger("tokenfleet.gateway")
audit_log = logging.getLogger("tokenfleet.audit")

KEY_PREFIX = "sk-tf-"
LAST_USED_FLUSH_S = 60.0
AUDIT_MAX = 1000
FILE_NAME = "api_keys.json"
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

    def public(self) -> dict[str, Any]:
        """What GET shows: never the hash (a hash of a short key can be brute-forced)."""
        return {"id": self.id, "object": "api_key", "tenant": self.tenant, "name": self.name,
                "created_at": _iso(self.created_at), "expires_at": _iso(self.expires_at),
                "last_used_at": _iso(self.last_used_at), "rotated_at": _iso(self.rotated_at),
                "revoked": self.revoked_at is not None, "revoked_at": _iso(self.revoked_at)}

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
    def touch(self, key_id: str, now: float) -> None: ...  # last used; cheap, persisted lazily
    async def put(self, record: KeyRecord, audit: KeyAudit) -> None: ...  # create or replace, audited
    async def get(self, key_id: str) -> KeyRecord | None: ...
    async def all(self) -> list[KeyRecord]: ...
    async def audit(self, limit: int) -> list[KeyAudit]: ...


class MemoryKeyStore:
    def __init__(self) -> None:
        self._records: dict[str, KeyRecord] = {}
        self._by_hash: dict[str, str] = {}
        self._audit: list[KeyAudit] = []
        self._lock = asyncio.Lock()

    def lookup(self, sha256: str) -> KeyRecord | None:
        key_id = self._by_hash.get(sha256)
        return self._records.get(key_id) if key_id is not None else None

    def touch(self, key_id: str, now: float) -> None:
        rec = self._records.get(key_id)
        if rec is not None:
            self._records[key_id] = replace(rec, last_used_at=now)

    async def put(self, record: KeyRecord, audit: KeyAudit) -> None:
        async with self._lock:
            old = self._records.get(record.id)
            if old is not None:
                self._by_hash.pop(old.sha256, None)
            self._records[record.id] = record
            self._by_hash[record.sha256] = record.id
            self._audit.append(audit)
            del self._audit[:-AUDIT_MAX]
            self._persist()

    async def get(self, key_id: str) -> KeyRecord | None:
        return self._records.get(key_id)

    async def all(self) -> list[KeyRecord]:
        return sorted(self._records.values(), key=lambda r: (r.created_at, r.id))

    async def audit(self, limit: int) -> list[KeyAudit]:
        return list(reversed(self._audit[-limit:]))

    def _persist(self) -> None:
        """Nothing to write in memory; the file store writes here."""


class JsonFileKeyStore(MemoryKeyStore):
    """MemoryKeyStore kept in one JSON file (atomic replace, 0600)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self._flushed: dict[str, float | None] = {}
        self._load()

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            records = [KeyRecord(**r) for r in data.get("keys", [])]
            audit = [KeyAudit(**a) for a in data.get("audit", [])]
        except FileNotFoundError:
            return
        except (OSError, ValueError, TypeError, AttributeError) as e:
            # Fail closed: a damaged file must not turn revoked keys back on.
            log.error("api keys: cannot read %s (%s); no stored key is accepted until it is fixed", self.path, e)
            return
        for r in records:
            self._records[r.id] = r
            self._by_hash[r.sha256] = r.id
            self._flushed[r.id] = r.last_used_at
        self._audit = audit[-AUDIT_MAX:]

    def touch(self, key_id: str, now: float) -> None:
        super().touch(key_id, now)
        last = self._flushed.get(key_id)
        if last is None or now - last > LAST_USED_FLUSH_S:
            self._persist()

    def _persist(self) -> None:
        data = {"format": 1, "keys": [asdict(r) for r in self._records.values()],
                "audit": [asdict(a) for a in self._audit]}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, separators=(",", ":"))
            os.replace(tmp, self.path)
        except OSError as e:
            log.error("api keys: cannot write %s (%s); changes live in memory only", self.path, e)
            return
        self._flushed = {r.id: r.last_used_at for r in self._records.values()}


def _audit_line(action: str, actor: str, rec: KeyRecord) -> None:
    """The same structured audit line as the other admin changes (`tokenfleet.audit`, gateway.admin)."""
    emit(audit_log, logging.INFO, {"event": "api_key", "action": action, "actor": actor, "key_id": rec.id,
                                   "tenant": rec.tenant})


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
            if k not in ("tenant", "name", "expires_at"):
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
        secret = new_secret()
        rec = KeyRecord(f"key_{secrets.token_hex(8)}", tenant, hash_api_key(secret), name, now, expires)
        await store.put(rec, KeyAudit(now, actor, "create", rec.id, tenant))
        _audit_line("create", actor, rec)
        return JSONResponse({**rec.public(), "key": secret}, status_code=201)

    @app.get("/admin/v1/keys")
    async def list_keys(request: Request) -> JSONResponse:
        require_admin(request.headers)
        return JSONResponse({"object": "list", "data": [r.public() for r in await store.all()]})

    @app.get("/admin/v1/keys/audit")
    async def key_audit(request: Request, limit: int = 100) -> JSONResponse:
        require_admin(request.headers)
        entries = await store.audit(max(1, min(limit, AUDIT_MAX)))
        return JSONResponse({"object": "list", "data": [a.public() for a in entries]})

    @app.delete("/admin/v1/keys/{key_id}")
    async def revoke_key(key_id: str, request: Request) -> JSONResponse:
        actor = require_admin(request.headers)
        rec = await store.get(key_id)
        if rec is None:
            raise not_found(key_id)
        if rec.revoked_at is None:
            now = clock()
            rec = replace(rec, revoked_at=now)
            await store.put(rec, KeyAudit(now, actor, "revoke", rec.id, rec.tenant))
            _audit_line("revoke", actor, rec)
        return JSONResponse(rec.public())

    @app.post("/admin/v1/keys/{key_id}/rotate")
    async def rotate_key(key_id: str, request: Request) -> Response:
        actor = require_admin(request.headers)
        rec = await store.get(key_id)
        if rec is None:
            raise not_found(key_id)
        if rec.revoked_at is not None:
            raise GatewayError(409, f"API key {key_id!r} is revoked; create a new one.", code="key_revoked")
        now = clock()
        secret = new_secret()
        rec = replace(rec, sha256=hash_api_key(secret), rotated_at=now)
        await store.put(rec, KeyAudit(now, actor, "rotate", rec.id, rec.tenant))
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
