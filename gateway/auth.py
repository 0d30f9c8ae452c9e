"""API key → tenant.

Keys are looked up by their SHA-256, so the gateway never keeps plain keys in
its table (the fleet file may hold only hashes). A fleet without tenants is an
open dev fleet: every caller is the anonymous tenant.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fleetcore.fleet_config import FleetConfig, TenantConfig, hash_api_key
from gateway.errors import invalid_api_key

ANONYMOUS = "anonymous"


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str
    region: str | None = None  # the tenant's home region, when the fleet file gives one
    default_class: str | None = None


class Authenticator:
    def __init__(self, tenants: list[TenantConfig]) -> None:
        self._by_hash: dict[str, TenantConfig] = {h: t for t in tenants for h in t.key_hashes()}
        self.open = not tenants

    @classmethod
    def from_config(cls, config: FleetConfig) -> Authenticator:
        return cls(list(config.tenants))

    def authenticate(self, headers: Mapping[str, str]) -> Caller:
        """The caller behind `Authorization: Bearer KEY`; raises a 401 GatewayError otherwise."""
        if self.open:
            return Caller(ANONYMOUS)
        key = bearer_token(headers.get("authorization"))
        if key is None:
            raise invalid_api_key("Missing API key. Send `Authorization: Bearer <key>`.")
        tenant = self._by_hash.get(hash_api_key(key))
        if tenant is None:
            raise invalid_api_key("Incorrect API key provided.")
        return Caller(tenant.name, tenant.region, tenant.default_class)


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token
