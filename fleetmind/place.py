"""Where one request runs: site, then pool, then instance — the one implementation the gateway's
relay and the simulator both call, so a benchmark places requests exactly as production does.

Two kinds of instances are left out, with different strength:

* `exclude`: instances that already failed this request (the relay's earlier attempts). A hard
  rule: never chosen again for it, even if that leaves nothing.
* `avoid`: admission's hint (`AdmissionDecision.avoid_instances`: their queued prefill would
  make this request miss its SLO there). A soft rule: the choice is made without them first,
  and again with them when avoiding them left no site, or the router no instance — a busy
  instance beats no answer.

Within a try the site chooser and the router see the same exclusions: the chooser picks a
site that still has a candidate, the router picks from that site's ready pool less them. A
router answer outside that pool counts as no instance. Pure: no I/O, no clock.

The TTFT a choice predicts from its dispatch (`route.predicted_ttft_s`: the first-byte deadline, the
hedge's delay, the decision log) is the one the client sees from the gateway's dispatch: the router's
(one instance's engine time from dispatch, `TokenPilot`'s forward TTFT) plus the round trip to the
chosen site (`network_rtt_s`), added here and only here (`route.network_s` says how much), for the
gateway and the simulator alike. The router's own number stays per instance: it is what it learns
against (the outcome's TTFT less `RequestOutcome.network_s`). The time the request already waited at
the gateway (`route.held_s`: admission's hold, parsing) is set here too, beside it and not in it: those
deadlines count from the dispatch, while what the response header reports is the TTFT from the
arrival, the two together (`RouteDecision.ttft_from_arrival_s`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from fleetcore.fast_replace import replace  # dataclasses.replace, cheaper: once per placed request
from fleetcore.policies import InstanceRouter, SiteChooser
from fleetcore.types import FleetView, InstanceSnapshot, RequestProfile, RouteDecision, SiteDecision, SiteSnapshot
from fleetmind.site_choice import network_rtt_ms, ready_pool


@dataclass(frozen=True, slots=True)
class Choice:
    """One try at placing a request: what each policy said, and the instance (None: nowhere)."""

    site: SiteDecision
    route: RouteDecision | None  # None when no site was chosen (the router was not asked)
    instance: InstanceSnapshot | None
    excluded: tuple[str, ...]  # what this try left out
    avoided: Choice | None = None  # the try that honoured the avoid hint, when it found nothing

    @property
    def reason(self) -> str:
        """Why it went where it went, or why nowhere."""
        if self.route is None:
            return self.site.reason
        return self.route.reason or "router chose no instance"

    def tries(self) -> tuple[Choice, ...]:
        """Every try in order (the avoiding one first): what a decision log keeps."""
        return (*self.avoided.tries(), self) if self.avoided is not None else (self,)


def place(profile: RequestProfile, view: FleetView, now: float, chooser: SiteChooser, router: InstanceRouter,
          exclude: Collection[str] = (), avoid: Collection[str] = ()) -> Choice:
    """Site, pool, instance for `profile` in `view`, leaving out `exclude` always and `avoid`
    unless that leaves nothing (see the module doc)."""
    hard = tuple(exclude)
    if avoid:
        first = _try(profile, view, now, chooser, router, (*hard, *(a for a in avoid if a not in hard)))
        if first.instance is not None:
            return first
        second = _try(profile, view, now, chooser, router, hard)
        return Choice(second.site, second.route, second.instance, second.excluded, first)
    return _try(profile, view, now, chooser, router, hard)


def _try(profile: RequestProfile, view: FleetView, now: float, chooser: SiteChooser, router: InstanceRouter,
         excluded: tuple[str, ...]) -> Choice:
    site = chooser.choose(profile, view, now, exclude_instances=excluded)
    if site.site is None:
        return Choice(site, None, None, excluded)
    snap = view.site(site.site)
    pool = ready_pool(snap, profile.model, profile.model_version)
    if excluded:
        pool = tuple([i for i in pool if i.instance_id not in excluded])
    route = router.route(profile, pool, now)
    chosen = next((i for i in pool if i.instance_id == route.instance_id), None) \
        if route.instance_id is not None else None
    if chosen is not None and route.predicted_ttft_s is not None:
        rtt = network_rtt_s(snap, profile.client_region)
        held = profile.held_s(now)
        if rtt > 0.0 or held > 0.0:
            route = replace(route, predicted_ttft_s=route.predicted_ttft_s + rtt, network_s=route.network_s + rtt,
                            held_s=held)
    return Choice(site, route, chosen, excluded)


def network_rtt_s(site: SiteSnapshot, client_region: str | None) -> float:
    """The round trip between the gateway and `site` that a request's TTFT carries, seconds: the
    gateway's measured one where it has one (`SiteSnapshot.probe_rtt_ms`), else the fleet file's
    figure from the client's region (the simulator's network: `fleetsim.simulator.site_rtt_s`), 0
    where neither says (not the site chooser's large unknown, `site_choice.UNKNOWN_RTT_MS`, which
    ranks such a site last rather than predicting anything; a checked fleet file names every
    client region for every site)."""
    return network_rtt_ms(site, client_region, unknown_ms=0.0) / 1000.0
