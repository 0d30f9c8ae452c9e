"""API key → tenant.

Keys are looked up by their SHA-256, so the gateway never keeps plain keys in
its table (the fleet file may hold only hashes). A fleet without tenants is an
open dev fleet: every caller is the anonymous tenant.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from fleetcore.fleet_config import FleetConfig, TenantConfig, hash_api_key
from gateway.errors import invalid_api_key
from gateway.keys import KeyStore, stored_caller_tenant

ANONYMOUS = "anonymous"


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str
    region: str | None = None  # the tenant's home region, when the fleet file gives one
    default_class: str | None = None
    key_id: str | None = None  # a key created by API (gateway.keys); None for fleet-file keys


class Authenticator:
    """Fleet-file keys first, then keys created by API (`gateway.keys`, when a store is given)."""

    def __init__(self, tenants: list[TenantConfig], keys: KeyStore | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self._by_hash: dict[str, TenantConfig] = {h: t for t in tenants for h in t.key_hashes()}
        self._by_name: dict[str, TenantConfig] = {t.name: t for t in tenants}
        self.open = not tenants
        self.keys = keys
        self._clock = clock

    @classmethod
    def from_config(cls, config: FleetConfig, keys: KeyStore | None = None) -> Authenticator:
        return cls(list(config.tenants), keys)

    def authenticate(self, headers: Mapping[str, str]) -> Caller:
        """The caller behind `Authorization: Bearer KEY`; raises a 401 GatewayError otherwise."""
        if self.open:
            return Caller(ANONYMOUS)
        key = bearer_token(headers.get("authorization"))
        if key is None:
            raise invalid_api_key("Missing API key. Send `Authorization: Bearer <key>`.")
        digest = hash_api_key(key)
        tenant = self._by_hash.get(digest)
        key_id = None
        if tenant is None:
            name, known = stored_caller_tenant(self.keys, digest, self._clock())
            if known and name is None:
                raise invalid_api_key("This API key has been revoked or has expired.")
            tenant = self._by_name.get(name) if name is not None else None
            rec = self.keys.lookup(digest) if tenant is not None and self.keys is not None else None
            key_id = rec.id if rec is not None else None
        if tenant is None:
            raise invalid_api_key("Incorrect API key provided.")
        return Caller(tenant.name, tenant.region, tenant.default_class, key_id)


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token
