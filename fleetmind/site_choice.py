"""Per-request site choice (FleetMind's short cycle).

Filter, then score, then decide with hysteresis:

1. Filter: sites the region policy allows for this tenant and model (a hard
   constraint, never traded against anything), that have ready instances of the
   requested model and version.
2. Score each: network RTT from the client's entry region + `ttft_tail` x the TTFT predicted at
   that site's best instance (queueing and prefill of the part it has not cached;
   from the instance router's `predict`, so cache state counts; a router without a
   cost model predicts None and queue depth stands in) + transfer cost
   (egress $/GB of the request, weighted into seconds).
3. Stay home unless home would miss the class's TTFT SLO (the fleet's SLO map,
   `fleetcore.admission_config.AdmissionConfig.slos`) and another allowed site
   scores clearly better (`margin`). Spilling is a per (tenant, model, home) mode
   with hysteresis: it starts when home's predicted TTFT, weighed by `ttft_tail`
   (1.8: what a site's load costs beyond the first token, `TTFT_TAIL`), passes `enter_ratio` x SLO
   and ends only after home has stayed under `exit_ratio` x SLO for `hold_s`, so
   decisions do not flap at the boundary. While spilling, each request goes to the
   best-scoring site among home and the allowed spill sites.

`NearestReadySite` is the simple baseline (nearest ready site, no policy).
"""

from __future__ import annotations

import copy

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from fleetcore.fleet_config import FleetConfig
from fleetcore.policies import InstanceRouter, SiteChooser
from fleetcore.slo import ClassSLO, class_by_length
from fleetcore.types import Candidate, FleetView, InstanceSnapshot, RequestProfile, SiteDecision, SiteSnapshot
from fleetcore.region_policy import PolicySet, Residency

UNKNOWN_RTT_MS = 1000.0


class _HasRtt(Protocol):
    region: str
    rtt_ms: Mapping[str, float]


def rtt_ms(site: _HasRtt, client_region: str | None, unknown_ms: float = UNKNOWN_RTT_MS) -> float:
    """Round trip between a client entry region and a site (fleet-file site or snapshot): the
    fleet file's figure, else 0 inside the site's own region, else `unknown_ms` (by default a large
    unknown, which ranks such a site last)."""
    rtt = site.rtt_ms.get(client_region or "")
    if rtt is None:
        return 0.0 if client_region == site.region else unknown_ms
    return rtt


def network_rtt_ms(site: SiteSnapshot, client_region: str | None, unknown_ms: float = UNKNOWN_RTT_MS) -> float:
    """The round trip a request sent to `site` pays, the one figure both the site chooser's score
    and the reported TTFT (`fleetmind.place.network_rtt_s`) count: what the gateway measured to the
    site (`SiteSnapshot.probe_rtt_ms`, its lowest recent health probe: every request goes through
    the gateway, so that leg is what differs between sites) where it has measured, else the fleet
    file's figure from the client's region (`rtt_ms`; the simulator's network)."""
    if site.probe_rtt_ms is not None:
        return site.probe_rtt_ms
    return rtt_ms(site, client_region, unknown_ms)


_POOLS: dict[tuple[str, str, str | None], tuple[SiteSnapshot, tuple[InstanceSnapshot, ...]]] = {}
MAX_POOLS = 1024  # (site, model, version) kept; emptied when full


def ready_pool(site: SiteSnapshot, model: str, version: str | None) -> tuple[InstanceSnapshot, ...]:
    """`site.pool(model, version)`, computed once per site snapshot: the fleet view hands out the
    same snapshot objects while nothing in them changed (`gateway.fleet_state.FleetState.view`), and
    a request asks for its pool twice (the site chooser, then `fleetmind.place` for the router),
    ~6 us each at 64 instances. A snapshot is frozen, so the same object has the same pool; the
    entry holds the snapshot it was made from, so an id is never taken for another object's."""
    key = (site.name, model, version)
    hit = _POOLS.get(key)
    if hit is not None and hit[0] is site:
        return hit[1]
    pool = site.pool(model, version)
    if len(_POOLS) >= MAX_POOLS:
        _POOLS.clear()
    _POOLS[key] = (site, pool)
    return pool


class NearestReadySite(SiteChooser):
    """Baseline: the nearest site with a ready instance; no residency policy, no load."""

    name = "nearest_ready"

    def choose(self, profile: RequestProfile, view: FleetView, now: float,
               exclude_instances: Collection[str] = ()) -> SiteDecision:
        scored: list[Candidate] = []
        for site in view.sites:
            pool = [i for i in site.pool(profile.model, profile.model_version)
                    if i.instance_id not in exclude_instances]
            if not pool:
                continue
            rtt = rtt_ms(site, profile.client_region)
            scored.append(Candidate(site.name, rtt, {"rtt_ms": rtt, "ready": float(len(pool))}))
        if not scored:
            return SiteDecision(None, f"no site has a ready instance of {profile.model!r}")
        best = min(scored, key=lambda c: (c.score, c.name))
        return SiteDecision(best.name, f"nearest ready site ({best.score:.0f} ms)", scored)


# What a second of a site's predicted TTFT costs, in seconds of the site's score and of the spill
# test (`FleetMindConfig.ttft_tail`). The predicted TTFT (`TokenPilot.predict`: the forward TTFT at
# the instance's fitted step costs since i19-unify) is unbiased: simulator, 3 sites, conversation
# 3.46, observed / predicted 0.97-1.02 in every bin of predicted TTFT / SLO (`bench/spill_calibration.py
# --ttft-tail 1`, bench/ROUTING.md "i19-unify"). It stands for the site's load, which the request
# pays in its decode as well: there, requests predicted under 0.3 x their TTFT SLO missed an SLO
# (nearly all their TPOT) 10% of the time, at 0.5-0.6 x 23%, at 0.7-1.0 x ~30%, while their first
# tokens missed only past 1.0 x. A TTFT within its SLO thus hides twice an idle site's risk by
# ~0.55 x SLO = 1 / 1.8: spilling starts there (enter_ratio 1 on 1.8 x the TTFT), and differences
# in load weigh 1.8 x against a round trip, which costs the request once. Until i19-unify the site
# chooser read the learned model over the prior's step costs, which over-predicted (observed /
# predicted 0.92-0.95 between 0.5 and 1.0 x SLO, round trip included), with this factor at 1; on
# the unbiased TTFT at 1 goodput fell (2817 -> 2700 tok/s at 3.46, 2362 -> 2335 at 2.53, 5 seeds
# each); at 1.8: 2861 and 2378 (1.3: 2790, 2344; the threshold alone at 0.55 x SLO: 2719, 2370).
TTFT_TAIL = 1.8


@dataclass(frozen=True, slots=True)
class FleetMindConfig:
    enter_ratio: float = 1.0  # home's predicted TTFT / SLO above which spilling starts
    exit_ratio: float = 0.7  # ... below which (held for hold_s) it stops
    hold_s: float = 5.0
    margin: float = 0.2  # another site must score this fraction better than home
    never_spill: bool = False  # the "home" placement: residency and readiness only
    usd_to_s: float = 10.0  # seconds of latency one dollar of egress is worth
    bytes_per_token: float = 4.0
    fallback_service_s: float = 0.5  # per queued request, when no predictor is given
    # The predicted TTFT times this in the site's score and in the spill test (`enter_ratio` /
    # `exit_ratio` compare it with the SLO): a site's load costs a request more than its first
    # token's wait (its decode too). See `TTFT_TAIL` for the figure and why.
    ttft_tail: float = TTFT_TAIL


@dataclass(slots=True)
class _Mode:
    spilling: bool = False
    calm_since: float | None = None
    since: float = 0.0


@dataclass(slots=True)  # (not frozen: a frozen dataclass's __init__ sets each field through object.__setattr__)
class _Row:
    site: SiteSnapshot
    score: float
    ttft_s: float
    rtt_s: float
    transfer_s: float
    cached: int


class _SiteCandidates(Sequence[Candidate]):
    """The sites a choice weighed, as `Candidate`s (score, predicted TTFT, RTT, transfer, cached
    tokens), made only when someone reads them (the decision log on /debug/decisions, the admin
    dry run): a Candidate and its detail per site per request was ~2 us of the request path."""

    __slots__ = ("_rows", "_items")

    def __init__(self, rows: Sequence[_Row]) -> None:
        self._rows = rows
        self._items: list[Candidate] | None = None

    def _build(self) -> list[Candidate]:
        if self._items is None:
            self._items = [Candidate(r.site.name, r.score, {"predicted_ttft_s": r.ttft_s, "rtt_s": r.rtt_s,
                                                            "transfer_s": r.transfer_s,
                                                            "cached_tokens": float(r.cached)})
                           for r in self._rows]
        return self._items

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        return self._build()[i]

    def __len__(self) -> int:
        return len(self._rows)

    def __eq__(self, other: object) -> bool:  # as the list it stands for
        if isinstance(other, _SiteCandidates):
            other = other._build()
        return self._build() == other if isinstance(other, list) else NotImplemented  # type: ignore[return-value]

    __hash__ = None  # type: ignore[assignment]  (a list's)

    def __repr__(self) -> str:
        return repr(self._build())


class FleetMind(SiteChooser):
    name = "fleetmind"

    def __init__(self, policies: PolicySet | None = None, predictor: InstanceRouter | None = None, *,
                 slos: Mapping[str, ClassSLO], config: FleetMindConfig | None = None,
                 egress_cost_per_gb: Mapping[str, float] | None = None) -> None:
        """`slos`: the fleet's class SLOs (the spill rule's TTFT bound) — the same map admission
        holds requests to, so a fleet's own classes spill by their own targets."""
        self.policies = policies or PolicySet()
        self.predictor = predictor
        self.slos = slos
        self.config = config or FleetMindConfig()
        self.egress = dict(egress_cost_per_gb or {})
        self._modes: dict[tuple[str, str, str], _Mode] = {}

    @classmethod
    def from_fleet(cls, fleet: FleetConfig, predictor: InstanceRouter | None, *,
                   config: FleetMindConfig | None = None, policy_version: int = 0) -> FleetMind:
        """FleetMind over a fleet file: its region policies, its SLO map, its sites' egress prices
        (the gateway's and the simulator's composition roots both build it here)."""
        return cls(PolicySet(fleet.region_policies, version=policy_version), predictor,
                   slos=fleet.admission.slos(), config=config,
                   egress_cost_per_gb={s.name: s.egress_cost_per_gb for s in fleet.sites})

    def set_policies(self, policies: PolicySet) -> None:
        """Swap the whole policy set (admin API); takes effect on the next request."""
        self.policies = policies

    def with_policies(self, policies: PolicySet) -> FleetMind:
        # Shares the predictor (read only here) and copies the spill hysteresis, so a dry-run
        # never moves the live chooser's state.
        twin = copy.copy(self)
        twin.policies = policies
        twin._modes = dict(self._modes)
        return twin

    def residency(self, profile: RequestProfile, view: FleetView) -> Residency:
        return self.policies.resolve(profile.tenant, profile.model, view.sites)

    def choose(self, profile: RequestProfile, view: FleetView, now: float,
               exclude_instances: Collection[str] = ()) -> SiteDecision:
        res = self.residency(profile, view)
        if not res.allowed:
            return SiteDecision(None, f"region policy allows no site for tenant {profile.tenant!r} "
                                      f"and model {profile.model!r}")
        rows = self._score_sites(profile, view, res, now, exclude_instances)
        if not rows:
            return SiteDecision(None, f"no allowed site has a ready instance of {profile.model!r}"
                                + (f" version {profile.model_version!r}" if profile.model_version else ""))
        by_name = {r.site.name: r for r in rows}
        home_name = res.home or self._nearest_allowed(view, res, profile.client_region)
        home = by_name.get(home_name) if home_name else None
        cands = _SiteCandidates(rows)
        spill_rows = [r for r in rows if r.site.name in res.spill_sites and r is not home]
        may_spill = res.spill and not self.config.never_spill and bool(spill_rows)
        if home is None:
            if not may_spill:
                return SiteDecision(None, f"home site {home_name!r} has no ready instance and spill "
                                          "is not allowed", cands)
            best = min(spill_rows, key=lambda r: (r.score, r.site.name))
            return SiteDecision(best.site.name, f"home {home_name!r} not ready: spill", cands)
        if not may_spill:
            return SiteDecision(home.site.name, "home site", cands)
        mode = self._mode(profile, home.site.name, home, spill_rows, now)
        if not mode.spilling:
            return SiteDecision(home.site.name, "home site (within SLO)", cands)
        best = min([home, *spill_rows], key=lambda r: (r.score, r.site.name))
        reason = "spill: home would miss its TTFT SLO" if best is not home else "spilling, home is best now"
        return SiteDecision(best.site.name, reason, cands)

    # -- internals ------------------------------------------------------------------
    def _score_sites(self, profile: RequestProfile, view: FleetView, res: Residency, now: float,
                     exclude: Collection[str]) -> list[_Row]:
        rows = []
        gb = (profile.prompt_tokens + (profile.max_tokens or 0)) * self.config.bytes_per_token / 1e9
        for site in view.sites:
            if site.name not in res.allowed:
                continue
            pool = ready_pool(site, profile.model, profile.model_version)
            if exclude:
                pool = tuple([i for i in pool if i.instance_id not in exclude])
            if not pool:
                continue
            ttft, cached = self._predict(profile, pool, now)
            rtt = network_rtt_ms(site, profile.client_region) / 1000
            transfer = self.egress.get(site.name, 0.0) * gb * self.config.usd_to_s
            rows.append(_Row(site, rtt + self.config.ttft_tail * ttft + transfer, ttft, rtt, transfer, cached))
        return rows

    def _predict(self, profile: RequestProfile, pool: Sequence[InstanceSnapshot], now: float) -> tuple[float, int]:
        if self.predictor is not None:
            p = self.predictor.predict(profile, pool, now)
            if p is not None:
                return p
        # Without a cost model: queue depth of the least loaded instance times a typical service time.
        depth = min(max(i.inflight - i.num_running, 0) + i.num_waiting for i in pool)
        return depth * self.config.fallback_service_s, 0

    @staticmethod
    def _nearest_allowed(view: FleetView, res: Residency, region: str | None) -> str | None:
        # The home site is the client region's nearest by the fleet file (its geography, as the
        # placement plan's demand has it: `fleetmind.demand`), not by the gateway's probes: a
        # probe's jitter must not move a region's home; what a request pays is in the score.
        sites = [s for s in view.sites if s.name in res.allowed]
        if len(sites) == 1:  # (the min of one; the usual fleet of one site)
            return sites[0].name
        return min(sites, key=lambda s: (rtt_ms(s, region), s.name)).name if sites else None

    def _slo_ttft(self, profile: RequestProfile) -> float:
        slo = self.slos.get(profile.request_class or class_by_length(profile.prompt_tokens))
        return slo.ttft_s if slo is not None and slo.ttft_s is not None else 60.0

    def _mode(self, profile: RequestProfile, home_name: str, home: _Row, others: Sequence[_Row],
              now: float) -> _Mode:
        key = (profile.tenant, profile.model, home_name)
        mode = self._modes.setdefault(key, _Mode())
        ratio = self.config.ttft_tail * home.ttft_s / self._slo_ttft(profile)
        cfg = self.config
        if not mode.spilling:
            best_other = min(r.score for r in others)
            if ratio > cfg.enter_ratio and best_other < home.score * (1 - cfg.margin):
                mode.spilling, mode.calm_since, mode.since = True, None, now
        elif ratio < cfg.exit_ratio:
            if mode.calm_since is None:
                mode.calm_since = now
            elif now - mode.calm_since >= cfg.hold_s:
                mode.spilling, mode.calm_since, mode.since = False, None, now
        else:
            mode.calm_since = None
        return mode
