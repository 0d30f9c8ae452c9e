"""Region policy: where a tenant's requests for a model may run (data residency is a hard
constraint), which site is home, and whether and where demand may spill.

A policy names a tenant and a model, or `*` for any. Every policy that matches a
request applies and their allowed sets are *intersected* — a tenant-wide residency
rule cannot be widened by a model-wide one. Home and spill settings come from the
most specific matching policy (tenant+model, then tenant, then model, then `*`).
This module holds the schema, its checks against a fleet, and its resolution into
allowed sites (`PolicySet.resolve`; the type a site chooser's `residency` answers in);
FleetMind (`fleetmind.site_choice`) enforces it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator

WILDCARD = "*"


class SiteLike(Protocol):
    name: str
    region: str
    jurisdiction: str


class RegionPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tenant: str = Field(default=WILDCARD, min_length=1)
    model: str = Field(default=WILDCARD, min_length=1)
    allowed_jurisdictions: list[str] | None = None
    allowed_regions: list[str] | None = None
    allowed_sites: list[str] | None = None
    home_site: str | None = None
    spill: bool = True
    spill_sites: list[str] | None = Field(default=None, description="where spill may go (default: any allowed)")
    description: str = ""

    @field_validator("allowed_jurisdictions", "allowed_regions", "allowed_sites", "spill_sites")
    @classmethod
    def _non_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not value:
            raise ValueError("is empty: nothing would be allowed (omit it to allow any)")
        return value

    @property
    def key(self) -> tuple[str, str]:
        return (self.tenant, self.model)

    @property
    def specificity(self) -> int:
        return (2 if self.tenant != WILDCARD else 0) + (1 if self.model != WILDCARD else 0)

    def matches(self, tenant: str, model: str) -> bool:
        return self.tenant in (WILDCARD, tenant) and self.model in (WILDCARD, model)

    def allows(self, site: SiteLike) -> bool:
        return ((self.allowed_jurisdictions is None or site.jurisdiction in self.allowed_jurisdictions)
                and (self.allowed_regions is None or site.region in self.allowed_regions)
                and (self.allowed_sites is None or site.name in self.allowed_sites))


def check_policy(p: RegionPolicy, sites: Sequence[SiteLike], models: Collection[str],
                 tenants: Collection[str]) -> list[str]:
    """What is wrong with `p` in this fleet, as messages naming the field (empty: fine)."""
    errors: list[str] = []
    names = {s.name for s in sites}
    if p.tenant != WILDCARD and p.tenant not in tenants:
        errors.append(f"tenant: unknown tenant {p.tenant!r} (known: {sorted(tenants)})")
    if p.model != WILDCARD and p.model not in models:
        errors.append(f"model: unknown model {p.model!r} (known: {sorted(models)})")
    for field, known in (("allowed_sites", names), ("spill_sites", names),
                         ("allowed_regions", {s.region for s in sites}),
                         ("allowed_jurisdictions", {s.jurisdiction for s in sites})):
        unknown = sorted(set(getattr(p, field) or ()) - known)
        if unknown:
            errors.append(f"{field}: unknown {unknown} (known: {sorted(known)})")
    allowed = {s.name for s in sites if p.allows(s)}
    if not allowed and not errors:
        errors.append("no site satisfies allowed_jurisdictions / allowed_regions / allowed_sites together")
    if p.home_site is not None:
        if p.home_site not in names:
            errors.append(f"home_site: unknown site {p.home_site!r}")
        elif p.home_site not in allowed:
            errors.append(f"home_site: {p.home_site!r} is outside what the policy allows")
    outside = sorted(set(p.spill_sites or ()) & names - allowed)
    if outside:
        errors.append(f"spill_sites: {outside} are outside what the policy allows")
    return errors


# --- resolution: pure and cheap (cached per policy-set version, one dict lookup a request) ---


@dataclass(frozen=True, slots=True)
class Residency:
    allowed: frozenset[str]  # sites the request may run in at all
    home: str | None  # the policy's home site (None: nearest allowed to the client)
    spill: bool  # may it leave home?
    spill_sites: frozenset[str]  # where it may spill to (within `allowed`)
    policies: tuple[str, ...]  # which policies applied, for explanations


class PolicySet:
    """An immutable, versioned set of region policies (the admin API swaps whole sets)."""

    def __init__(self, policies: Sequence[RegionPolicy] = (), version: int = 0) -> None:
        self.policies = tuple(policies)
        self.version = version
        self._cache: dict[tuple[str, str, tuple[str, ...]], Residency] = {}

    def resolve(self, tenant: str, model: str, sites: Sequence[SiteLike]) -> Residency:
        key = (tenant, model, tuple(s.name for s in sites))
        hit = self._cache.get(key)
        if hit is None:
            hit = self._resolve(tenant, model, sites)
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[key] = hit
        return hit

    def _resolve(self, tenant: str, model: str, sites: Sequence[SiteLike]) -> Residency:
        applying = sorted((p for p in self.policies if p.matches(tenant, model)),
                          key=lambda p: p.specificity, reverse=True)
        allowed = frozenset(s.name for s in sites if all(p.allows(s) for p in applying))
        top = applying[0] if applying else None
        spill = top.spill if top else True
        spill_sites = allowed if top is None or top.spill_sites is None else allowed & frozenset(top.spill_sites)
        home = top.home_site if top and top.home_site in allowed else None
        return Residency(allowed, home, spill, spill_sites if spill else frozenset(),
                         tuple(f"{p.tenant}/{p.model}" for p in applying))
