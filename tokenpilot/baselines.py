"""Plain balancing policies: the baselines every smarter router is measured against."""

from __future__ import annotations

from collections.abc import Sequence

from fleetcore.types import Candidate, InstanceSnapshot, RequestProfile, RouteDecision
from fleetcore.policies import InstanceRouter
from tokenpilot.policy import no_candidates


class RoundRobin(InstanceRouter):
    """Cycle through the pool in instance-id order, ignoring load and cache."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next: dict[tuple[str, ...], int] = {}

    def route(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot],
              now: float) -> RouteDecision:
        if not candidates:
            return no_candidates(profile)
        pool = sorted(candidates, key=lambda i: i.instance_id)
        key = tuple(i.instance_id for i in pool)
        n = self._next.get(key, 0)
        self._next[key] = n + 1
        return RouteDecision(pool[n % len(pool)].instance_id, "round robin")


class LeastLoaded(InstanceRouter):
    """Fewest requests on the instance: the gateway's own in-flight count, or the
    engine's running + waiting when that is higher (other clients share the engine)."""

    name = "least_loaded"

    def route(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot],
              now: float) -> RouteDecision:
        if not candidates:
            return no_candidates(profile)
        scored = [Candidate(i.instance_id, float(max(i.inflight, i.num_running + i.num_waiting)))
                  for i in candidates]
        best = min(scored, key=lambda c: (c.score, c.name))
        return RouteDecision(best.name, f"least loaded ({best.score:.0f} requests)", scored)
