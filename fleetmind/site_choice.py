"""Per-request site choice, first cut: the nearest site that can serve the request now.

The full FleetMind (residency policy, headroom, queueing, cache and transfer cost,
spill with hysteresis) replaces this behind the same `choose` signature.
"""

from __future__ import annotations

from collections.abc import Collection

from fleetcore.types import Candidate, FleetView, RequestProfile, SiteDecision

UNKNOWN_RTT_MS = 1000.0


class NearestReadySite:
    name = "nearest_ready"

    def choose(self, profile: RequestProfile, view: FleetView, now: float,
               exclude_instances: Collection[str] = ()) -> SiteDecision:
        scored: list[Candidate] = []
        for site in view.sites:
            pool = [i for i in site.pool(profile.model, profile.model_version)
                    if i.instance_id not in exclude_instances]
            if not pool:
                continue
            rtt = 0.0 if profile.client_region == site.region else \
                site.rtt_ms.get(profile.client_region or "", UNKNOWN_RTT_MS)
            scored.append(Candidate(site.name, rtt, {"rtt_ms": rtt, "ready": float(len(pool))}))
        if not scored:
            return SiteDecision(None, f"no site has a ready instance of {profile.model!r}")
        best = min(scored, key=lambda c: (c.score, c.name))
        return SiteDecision(best.name, f"nearest ready site ({best.score:.0f} ms)", scored)
