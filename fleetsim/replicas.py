"""Several gateway replicas in the simulator: N routers, each with a stale view of the others.

DESIGN.md "Scale-out": replicas sit behind a load balancer; each one's router decides
with its own dispatch history at once, and learns what the other replicas dispatched
(history-mode routing records, in-flight deltas) only after a sync lag. The engines'
metrics (running/waiting/KV usage in the snapshots) are ground truth polled from the
engines, the same for every replica.

`ReplicatedRouter` is that composition, built from the policies' own contract
(`fleetcore.policies.InstanceRouter`), policies unchanged:

* each request goes to one replica, round robin over requests as they are first routed
  (a retry of a request stays on its replica);
* with a lag, replica k of N routes within its share of the pool, widened only to a prefix
  cached outside it, with interactive lanes that the other classes stay off
  (`fleetcore.replica_spread.SpreadRouter`, the same wrapper the live gateway routes
  through): replicas deciding at the same instant, blind to each other, pick apart;
* the replica's router routes it with candidates whose `inflight` is the replica's view:
  the gateway's true count less the other replicas' dispatches it has not heard of yet,
  plus their releases it has not heard of yet;
* the other replicas hear of the dispatch `sync_s` later, through the policy contract's
  remote-dispatch hooks, the very calls the live gateway makes from its route-share records
  (`gateway.route_share`): `note_dispatch` with the snapshot the owner saw (TokenPilot books it
  as its own route: backlog, outstanding prefill, streams, prefix index; a peer learns the
  prefix, `note_route`), `on_first_token` `sync_s` after the first token, and `note_release`
  `sync_s` after it ended (nothing is learned from another replica's outcome, as live). The
  owner observes at once.

Deliveries are events in the simulator's virtual time (`attach` gives the router the
simulator's scheduler); with `sync_s` 0 they run right after the event that caused them.
One replica (`replicas == 1`) is never wrapped: the CLI passes the plain router, so
one replica is today's run exactly.

Approximations: the remote dispatch is priced at delivery time against the snapshot the
owner saw at its decision (live: the receiving replica's snapshot at delivery); the live
records carry only the leading `route_share.MAX_BLOCKS` block hashes, the simulator's the whole
prompt's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from fleetcore.policies import EnginePrior, InstanceRouter
from fleetcore.replica_spread import ReplicaSlot, SpreadRouter
from fleetcore.types import InstanceSnapshot, RequestOutcome, RequestProfile, RouteDecision

Schedule = Callable[[float, Callable[[float], None]], None]


class ReplicatedRouter(InstanceRouter):
    """N independent routers of one policy behind a round-robin load balancer."""

    def __init__(self, routers: Sequence[InstanceRouter], sync_s: float = 0.0, *, spread: bool = True) -> None:
        if not routers:
            raise ValueError("at least one router")
        if sync_s < 0:
            raise ValueError("sync lag must be >= 0")
        n = len(routers)
        # One replica is the bare router (exactly today's run); several: each spreads within its
        # share, unless `spread` is off (how the replicas herd without it: bench/ROUTING.md) or
        # they hear each other at once (lag 0: no replica is blind to another's pick, so there is
        # no herd to break up, and the share would only cost: 0.91x of one replica's goodput vs
        # 0.99x without it, bench/ROUTING.md). The live gateway's lag is never 0.
        self.routers: list[InstanceRouter] = list(routers) if n == 1 or not spread or sync_s == 0 else \
            [SpreadRouter(r, ReplicaSlot(n, k)) for k, r in enumerate(routers)]
        self.name = self.routers[0].name
        self.follows_kv_events = self.routers[0].follows_kv_events  # type: ignore[misc]
        self.sync_s = sync_s
        self._schedule: Schedule | None = None
        self._next = 0
        self._owner: dict[str, int] = {}          # request id -> replica that routed it
        self._routed: dict[str, tuple[RequestProfile, str]] = {}  # request id -> (profile, instance)
        # Per replica, per instance: dispatches by others not yet heard of, minus releases not yet heard of.
        self._unheard: list[dict[str, int]] = [{} for _ in self.routers]
        self.remote_dispatches = 0   # deliveries made (tests, reports)

    def attach(self, schedule: Schedule) -> None:
        """The simulator's scheduler: `schedule(t, fn)` calls `fn(t)` at virtual time t."""
        self._schedule = schedule

    # -- replica choice and views --

    def _replica(self, request_id: str) -> int:
        k = self._owner.get(request_id)
        if k is None:
            k = self._owner[request_id] = self._next
            self._next = (self._next + 1) % len(self.routers)
        return k

    def _view(self, k: int, candidates: Sequence[InstanceSnapshot]) -> Sequence[InstanceSnapshot]:
        unheard = self._unheard[k]
        if not any(unheard.values()):
            return candidates
        return [replace(c, inflight=max(0, c.inflight - unheard.get(c.instance_id, 0)))
                if unheard.get(c.instance_id) else c for c in candidates]

    def _later(self, now: float, fn: Callable[[float], None]) -> None:
        if self._schedule is None:
            fn(now)  # not attached (a bare call): no lag
        else:
            self._schedule(now + self.sync_s, fn)

    # -- the contract --

    def route(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot],
              now: float) -> RouteDecision:
        rid = profile.request_id
        k = self._replica(rid)
        view = self._view(k, candidates)
        d = self.routers[k].route(profile, view, now)
        iid = d.instance_id
        if iid is None or len(self.routers) == 1:
            return d
        snap = next((c for c in view if c.instance_id == iid), None)
        if snap is None:
            return d
        self._routed[rid] = (profile, iid)
        others = [j for j in range(len(self.routers)) if j != k]
        for j in others:
            u = self._unheard[j]
            u[iid] = u.get(iid, 0) + 1

        def deliver(t: float) -> None:
            for j in others:
                u = self._unheard[j]
                u[iid] -= 1
                self.routers[j].note_dispatch(profile, snap, t)
            self.remote_dispatches += 1

        self._later(now, deliver)
        return d

    def observe(self, outcome: RequestOutcome) -> None:
        rid = outcome.request_id
        k = self._owner.pop(rid, None)
        if k is None:  # never routed (undispatchable): every replica would have heard nothing
            for r in self.routers:
                r.observe(outcome)
            return
        self.routers[k].observe(outcome)
        routed = self._routed.pop(rid, None)
        if routed is None:
            return
        profile, iid = routed
        others = [j for j in range(len(self.routers)) if j != k]
        for j in others:  # a release the others have not heard of: they still count it
            u = self._unheard[j]
            u[iid] = u.get(iid, 0) - 1
        now = profile.arrival + (outcome.e2e_s or 0.0)

        def deliver(t: float) -> None:
            for j in others:
                self._unheard[j][iid] += 1
                self.routers[j].note_release(rid, t)

        self._later(now, deliver)

    def refit_due(self) -> bool:
        return any(r.refit_due() for r in self.routers)

    def refit(self) -> bool:
        return any([r.refit() for r in self.routers if r.refit_due()])

    def prepare_refit(self) -> None:
        for r in self.routers:
            r.prepare_refit()

    def on_first_token(self, request_id: str, now: float) -> None:
        """The replica that routed it hears at once; the others (which heard of the dispatch) late."""
        k = self._owner.get(request_id)
        if k is None:
            return
        self.routers[k].on_first_token(request_id, now)
        if request_id not in self._routed:
            return
        others = [j for j in range(len(self.routers)) if j != k]

        def deliver(t: float) -> None:
            for j in others:
                self.routers[j].on_first_token(request_id, t)

        self._later(now, deliver)

    def register_instance(self, instance_id: str, prior: EnginePrior) -> None:
        for r in self.routers:
            r.register_instance(instance_id, prior)

    def forget_instance(self, instance_id: str) -> None:
        for r in self.routers:
            r.forget_instance(instance_id)

    def predict(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot],
                now: float) -> tuple[float, int] | None:
        k = self._owner.get(profile.request_id, self._next)  # the replica that will route it
        return self.routers[k].predict(profile, self._view(k, candidates), now)

    def observe_kv_events(self, instance_id: str, seq: int, events: Sequence[Mapping[str, object]],
                          now: float) -> None:
        for r in self.routers:  # each replica subscribes to the engines' events (no sync)
            r.observe_kv_events(instance_id, seq, events, now)

    def cache_blocks(self, instance_id: str) -> int | None:
        return self.routers[0].cache_blocks(instance_id)

    def cache_exact(self, instance_id: str, now: float) -> bool:
        return self.routers[0].cache_exact(instance_id, now)
