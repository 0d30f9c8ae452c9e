"""Resolve the region policies that apply to a (tenant, model) into allowed sites and a home.

Pure and cheap: resolutions are cached per policy-set version, so the per-request
cost is one dict lookup. See `fleetcore.region_policy` for the rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fleetcore.region_policy import RegionPolicy, SiteLike


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
