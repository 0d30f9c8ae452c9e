"""Every routing policy by name: ours, plain balancing, and the published routers we compare to."""

from __future__ import annotations

from typing import Any

from tokenpilot.baselines import LeastLoaded, RoundRobin
from fleetcore.policies import InstanceRouter


def _all() -> dict[str, type]:
    from tokenpilot.peers import PEER_ROUTERS
    from tokenpilot.router import TokenPilot

    return {"tokenpilot": TokenPilot, "round_robin": RoundRobin, "least_loaded": LeastLoaded,
            **PEER_ROUTERS}


ROUTER_NAMES: tuple[str, ...] = tuple(_all())


def make_router(name: str, **kwargs: Any) -> InstanceRouter:
    """A fresh router; `seed` is passed to the policies that take one."""
    routers = _all()
    try:
        cls = routers[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r} (known: {', '.join(routers)})") from None
    if "seed" in kwargs and cls in (RoundRobin, LeastLoaded):
        kwargs.pop("seed")
    router: InstanceRouter = cls(**kwargs)
    return router
