"""The routing seam: a pure decision over (request profile, candidate instances, now).

Every routing policy — ours and the published baselines we compare against —
implements `InstanceRouter`. The gateway and the simulator call `route` with the
pool the site chooser picked and report back through `observe`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from fleetcore.types import InstanceSnapshot, RequestOutcome, RequestProfile, RouteDecision


class InstanceRouter(Protocol):
    name: str

    def route(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot],
              now: float) -> RouteDecision: ...

    def observe(self, outcome: RequestOutcome) -> None: ...


def no_candidates(profile: RequestProfile) -> RouteDecision:
    return RouteDecision(None, f"no ready instance serves model {profile.model!r}")
