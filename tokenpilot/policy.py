"""The routing seam: a pure decision over (request profile, candidate instances, now).

Every routing policy — ours and the published baselines we compare against —
subclasses `InstanceRouter` (declared in `fleetcore.policies`, with the do-nothing
defaults of everything but `route`). The gateway and the simulator call `route` with
the pool the site chooser picked (`fleetmind.place`) and report back through `observe`.
"""

from __future__ import annotations

from fleetcore.policies import InstanceRouter
from fleetcore.types import RouteDecision, RequestProfile

__all__ = ["InstanceRouter", "no_candidates"]


def no_candidates(profile: RequestProfile) -> RouteDecision:
    return RouteDecision(None, f"no ready instance serves model {profile.model!r}")
