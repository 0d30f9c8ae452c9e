"""Wires the shared state of several gateway replicas into one app (README "Several replicas").

With a Redis URL (fleet file `gateway.redis_url`, or the policy store's: `tokenfleet up
--redis-url`): the replica roster, fleet-wide budgets, the aggregated goodput ledger, the
planner lease, and admin state (planner mode) in Redis. Without: one replica, which is the
planner's leader, keeps its admin state in the SQLite store under the state dir, and
reports its own ledger.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

from fleetcore.fleet_config import FleetConfig
from fleetcore.replica_spread import SpreadRouter
from gateway.admin_store import AdminKV, RedisKV
from gateway.budget_store import SharedBudgets
from gateway.lease import LeaderLease
from gateway.fleet_state import FleetState
from gateway.ledger_sync import LedgerSync
from gateway.load_sync import LoadSync
from gateway.route_share import RouteShare
from gateway.placement import MODES, Mode, PlacementLoop
from gateway.policy_store import StoreUnavailable
from gateway.policy_snapshot import state_dir
from gateway.shared_state import RosterFile, SharedRedis, SharedStateCollector
from slomax import SLOMax

log = logging.getLogger("tokenfleet.gateway")

PLANNER_MODE_KEY = "planner:mode"


class PlannerAdmin:
    """What `/admin/v1/planner` talks to: this replica's planner, its mode kept in the admin store,
    and, on a replica that does not hold the lease, the holder's published report."""

    def __init__(self, placement: PlacementLoop, kv: AdminKV | None, lease: LeaderLease | None) -> None:
        self.placement = placement
        self.kv = kv
        self.lease = lease

    @property
    def mode(self) -> Mode:
        return self.placement.mode

    async def set_mode(self, mode: Mode, actor: str) -> None:
        if self.kv is not None:  # durable first: a mode the API confirmed survives a restart
            await self.kv.set(PLANNER_MODE_KEY, mode)
        self.placement.set_mode(mode, actor)

    async def load_mode(self) -> None:
        """Adopt the stored mode (at start; on every heartbeat with Redis: a change made on another replica)."""
        if self.kv is None:
            return
        stored = await self.kv.get(PLANNER_MODE_KEY)
        if stored in MODES and stored != self.placement.mode:
            self.placement.set_mode(stored, "admin store")  # type: ignore[arg-type]

    def report(self, limit: int = 200) -> dict[str, Any]:
        lease = self.lease
        if lease is not None and not lease.leader and lease.remote is not None:
            out = dict(lease.remote)
            for k in ("entries", "actions"):
                out[k] = list(out.get(k, []))[-limit:]
            out["served_by"] = lease.holder
            out["fenced_moves"] = lease.recent_moves
            return out
        out = self.placement.report(limit)
        out["leader"] = lease.holder if lease is not None else "this replica"
        out["fence"] = lease.fence if lease is not None else None
        if lease is not None:  # every start/drain/stop checked against the token: who, what, accepted or not
            out["fenced_moves"] = lease.recent_moves
        return out


def roster_file(configured_dir: str | None, url: str, prefix: str) -> RosterFile:
    """Where this fleet's last replica count is kept (one file per Redis URL and key prefix)."""
    digest = hashlib.sha256(f"{url} {prefix}".encode()).hexdigest()[:16]
    return RosterFile(state_dir(configured_dir) / f"replicas-{digest}.json")


class Replicas:
    def __init__(self, config: FleetConfig, gate: Any, placement: PlacementLoop | None, registry: Any,
                 clock: Callable[[], float], policy_store: Any, local_kv: AdminKV | None,
                 state: FleetState | None = None, relay: Any = None) -> None:
        g = config.gateway
        url = g.redis_url or getattr(policy_store, "url", None)
        self.shared = SharedRedis(url, g, roster_file=roster_file(g.state_dir, url, g.redis_prefix)) if url else None
        self.budgets: SharedBudgets | None = None
        self.ledger: LedgerSync | None = None
        self.lease: LeaderLease | None = None
        self.load: LoadSync | None = None
        self.routes: RouteShare | None = None
        if self.shared is not None:
            spread: SpreadRouter | None = None
            if relay is not None:  # replicas routing at one instant pick apart (fleetcore.replica_spread)
                spread = relay.router = SpreadRouter(relay.router)
            if state is not None:
                self.load = LoadSync(self.shared, state, g.load_sync_s, spread)
            if relay is not None:
                self.routes = relay.route_share = RouteShare(self.shared, relay.router, clock, g.route_share_s,
                                                              relay.state.snapshot)
            if g.shared_budgets and isinstance(gate.policy, SLOMax):  # the policy that keeps budgets
                self.budgets = SharedBudgets(self.shared, gate.policy, clock)
                gate.shared_budgets = self.budgets
            self.ledger = LedgerSync(self.shared, gate.policy.ledger, clock)
            gate.shared_ledger = self.ledger
            if placement is not None:
                self.lease = LeaderLease(self.shared, report=lambda: placement.report(200))
                placement.may_act = lambda: self.lease is not None and self.lease.leader
                placement.fence = self.lease.fenced  # every step checked against the token in Redis
        kv: AdminKV | None = RedisKV(self.shared) if self.shared is not None else local_kv
        self.kv = kv  # the durable admin store: planner mode, API keys (gateway.keys)
        self.planner = PlannerAdmin(placement, kv, self.lease) if placement is not None else None
        if self.shared is not None and self.planner is not None:
            self.shared.on_beat.append(self.planner.load_mode)
        registry.register(SharedStateCollector(self.shared, self.budgets,
                                               [self.lease.metrics] if self.lease is not None else []))

    async def start(self) -> None:
        if self.shared is not None:
            await self.shared.start()
        if self.planner is not None:
            try:
                await self.planner.load_mode()
            except StoreUnavailable as e:
                log.warning("planner mode: %s; keeping the fleet file's %s", e, self.planner.mode)
        if self.ledger is not None:
            self.ledger.start()
        if self.load is not None:
            self.load.start()
        if self.routes is not None:
            self.routes.start()
        if self.lease is not None:
            self.lease.start()

    async def stop(self) -> None:
        if self.lease is not None:
            await self.lease.stop()
        if self.ledger is not None:
            await self.ledger.stop()
        if self.load is not None:
            await self.load.stop()
        if self.routes is not None:
            await self.routes.stop()
        if self.budgets is not None:
            await self.budgets.close()
        if self.shared is not None:
            await self.shared.stop()
