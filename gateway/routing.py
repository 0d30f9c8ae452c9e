"""Compose the routing policy for a live fleet: pick it by name and give it its priors.

TokenPilot starts each instance from a roofline prior (model x GPU x TP, as the fleet
file describes the deployment) and learns from there; instances whose hardware is
not described start from a generic prior.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from engine_adapters.base import Instance
from fleetcore.fleet_config import FleetConfig
from fleetmind.site_choice import FleetMind
from fleetcore.policies import InstanceRouter
from fleetcore.policies import EnginePrior
from tokenpilot.priors import prior_from_physics
from tokenpilot.registry import make_router

log = logging.getLogger("tokenfleet.gateway")

DEFAULT_ROUTER = "tokenpilot"


def instance_prior(inst: Instance) -> EnginePrior:
    if inst.engine_spec and inst.gpu:
        try:
            return prior_from_physics(inst.engine_spec, inst.gpu, inst.tp, inst.block_size,
                                      inst.max_batched_tokens)
        except ValueError as e:
            log.warning("no roofline prior for %s (%s); using the generic one", inst.instance_id, e)
    return EnginePrior(block_size=inst.block_size, max_batched_tokens=inst.max_batched_tokens)


def register_instances(router: InstanceRouter, instances: Iterable[Instance]) -> None:
    for inst in instances:
        router.register_instance(inst.instance_id, instance_prior(inst))


def forget_instances(router: InstanceRouter, instance_ids: Iterable[str]) -> None:
    """Instances gone from the fleet: the router drops what it indexed for them."""
    for iid in instance_ids:
        router.forget_instance(iid)


def reset_instances(router: InstanceRouter, instances: Iterable[Instance]) -> None:
    """Instances whose engine restarted: same id, cold cache. The router forgets what it indexed
    for them (routing history and KV events alike) and keeps their priors."""
    insts = list(instances)
    forget_instances(router, [i.instance_id for i in insts])
    register_instances(router, insts)


def index_flusher(router: InstanceRouter) -> Callable[[], None] | None:
    """What applies the router's deferred prefix-index updates (TokenPilot records a routed
    prompt after the decision, `PrefixCacheIndex.record_route_later`), or None. The relay calls
    it once the request is on its way, so the update is off the request's path; the next
    decision applies whatever is still pending first, so no decision sees a stale index."""
    index = getattr(router, "index", None)
    flush = getattr(index, "flush", None)
    return flush if callable(flush) else None


def build_router(name: str, instances: Iterable[Instance], seed: int = 0) -> InstanceRouter:
    router = make_router(name, seed=seed)
    register_instances(router, instances)
    return router


def build_site_chooser(config: FleetConfig, router: InstanceRouter) -> FleetMind:
    """FleetMind over the fleet file's region policies and SLO map, comparing sites with the
    router's own TTFT predictions when it makes them (TokenPilot does; others predict None)."""
    return FleetMind.from_fleet(config, router, policy_version=1)
