"""Several gateway replicas routing one pool: keep them from herding onto the same instance.

A replica hears of the other replicas' dispatches one sync period late (`gateway.load_sync_s`,
the simulator's `--sync-ms`). Requests that arrive together (a burst split by the load
balancer) are routed by every replica at once, each blind to the others' picks; with the same
fleet view and the same policy they all pick the same best instance (measured: a burst's
requests landing on an instance another replica just chose went from 247 with one replica to
876 with four at 100 ms lag, and goodput fell to 0.76x). More load figures cannot help: what the
others are choosing *right now* is not in any figure yet (counting one's own unheard
dispatches as if every replica had made them was measured too, and changed nothing).

The cure is to break the symmetry: replica k of N routes within its *share* of the pool
(the serving instances at positions k, k + N, k + 2N, ... in instance-id order), so that
replicas deciding at the same instant pick disjoint instances; the router's own rule
(cache affinity, queues, KV pressure) decides within the share. The share gives way only to
a cached prefix: an instance outside it that holds more of the prompt (the router's
`prefix_match`) than the best of the share joins the candidates, and the router weighs that
cache against its load as it always does. It never gives way for load alone: what makes an
instance outside the share look idler than the share is exactly what every replica sees at
that instant, so requests leaving for it herd there again (measured at 4 x 100 ms on the
Mooncake conversation trace: leaving for a TTFT predicted 10% shorter, or for a lower
predicted cost, kept 0.65-0.75x of one replica's goodput; leaving for a cached prefix only,
0.85x on the mean of three seeds; bench/ROUTING.md). A router without a prefix index (load only, or an implicit
affinity like a hash ring) is left alone: there is nothing to weigh the share against.

Interactive lanes. The partition costs something of its own, whatever the lag (measured with
the share forced on at lag 0: 0.88x of one replica's goodput): routing alone, TokenPilot makes
one instance an express lane for short interactive prompts (on the conversation trace, seed 0:
299 interactive requests and 9 long-context ones) because a long prefill there would stall
many decoding streams, and with 31 other instances to choose from a long prompt always finds
a cheaper one. Within a share of 8 the cheapest alternative is dearer, long prompts land on
every instance, and the interactive class misses its TPOT bound (misses 52 -> 157 of 1,015).
So the replicas keep lanes: the serving pool's first instances in id order, one in
`LANE_EVERY` of them (`lanes`; 4 of 32). Prompts of every other class stay off the lanes (their
share less the lanes in it, widened as above to a lane that holds more of the prompt: a
conversation that grew long where it began); interactive prompts route within their share
plus every lane. Replicas may meet on a lane at one instant, but only short prefills meet
there, and they batch into the same engine steps: what herds is an instance that looks idle
to everyone, and a lane is one no replica's long prompt is sent to blind. The number of lanes
follows the pool, not the replicas: one per replica was measured too, and at 2 replicas (2
lanes, ~400 interactive requests each) it lost 5% of goodput to queueing on them, at 8 (8 lanes,
a quarter of the pool kept from long prompts) 3%; bench/ROUTING.md.

One replica (`replicas == 1`) is never touched: the candidates go through as they are.
Pure: no clock, no I/O. The live gateway (`gateway.load_sync` sets the slot from the
roster) and the simulator (`fleetsim.replicas`) wrap their routers in the same `SpreadRouter`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fleetcore.policies import EnginePrior, InstanceRouter
from fleetcore.slo import INTERACTIVE, class_by_length
from fleetcore.types import InstanceSnapshot, RequestOutcome, RequestProfile, RouteDecision


@dataclass(frozen=True, slots=True)
class ReplicaSlot:
    """This replica's place among the live ones: `index` in 0 .. `replicas` - 1."""

    replicas: int = 1
    index: int = 0

    def __post_init__(self) -> None:
        if self.replicas < 1 or not 0 <= self.index < self.replicas:
            raise ValueError(f"replica index {self.index} of {self.replicas}")


ALONE = ReplicaSlot()


# One serving instance in this many is an interactive lane (none in a smaller pool). One replica
# alone made 1 of 32 its lane for ~30% of the interactive requests and mixed the rest; 1 in 8
# was measured best of 1 in 16, 8 and ~5 at 4 replicas (seed 0; bench/ROUTING.md).
LANE_EVERY = 8


def _serving(candidates: Sequence[InstanceSnapshot]) -> list[InstanceSnapshot]:
    return sorted((c for c in candidates if c.ready and not c.draining), key=lambda c: c.instance_id)


def share(slot: ReplicaSlot, candidates: Sequence[InstanceSnapshot]) -> list[InstanceSnapshot]:
    """The slot's part of the serving candidates (ready, not draining), in instance-id order."""
    return _serving(candidates)[slot.index::slot.replicas]


def lanes(slot: ReplicaSlot, candidates: Sequence[InstanceSnapshot]) -> list[InstanceSnapshot]:
    """The interactive lanes, the same for every replica: the first serving instances in id
    order, one in `LANE_EVERY` (lane j lies in share j mod replicas). None for one replica."""
    serving = _serving(candidates)
    return serving[:len(serving) // LANE_EVERY] if slot.replicas > 1 else []


def spread(router: InstanceRouter, slot: ReplicaSlot, profile: RequestProfile,
           candidates: Sequence[InstanceSnapshot], now: float) -> Sequence[InstanceSnapshot]:
    """The candidates replica `slot` should route `profile` among (see the module docstring):
    its share (plus every lane for an interactive prompt, less the lanes for any other), plus
    the instances outside that which hold more of the prompt than its best."""
    if slot.replicas <= 1 or len(candidates) <= 1:
        return candidates
    part = share(slot, candidates)
    if not part or len(part) == len(candidates):
        return candidates
    match = router.prefix_match(profile, candidates, now)
    if match is None:
        return candidates  # no prefix index: nothing to weigh the share against the pool with
    ids = {c.instance_id for c in part}
    lane_ids = {c.instance_id for c in lanes(slot, candidates)}
    if lane_ids:
        if (profile.request_class or class_by_length(profile.prompt_tokens)) == INTERACTIVE:
            ids |= lane_ids
        else:  # (a share of lanes only, in a pool of many replicas: it keeps them)
            ids = ids - lane_ids or ids
    mine_best = max((m for c, m in zip(candidates, match) if c.instance_id in ids), default=0)
    view = [c for c, m in zip(candidates, match) if c.instance_id in ids or m > mine_best]
    return candidates if len(view) == len(candidates) else view


class SpreadRouter(InstanceRouter):
    """A replica's router: routes among `spread(...)` of the candidates; everything else is the
    wrapped router's. `slot` is set by whoever knows the roster (ALONE: exactly the wrapped router)."""

    def __init__(self, inner: InstanceRouter, slot: ReplicaSlot = ALONE) -> None:
        self.inner = inner
        self.slot = slot
        self.name = inner.name
        self.follows_kv_events = inner.follows_kv_events  # type: ignore[misc]
        self.spread_routes = 0  # routed within the share, widened or not (metrics, tests)

    def route(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot],
              now: float) -> RouteDecision:
        view = spread(self.inner, self.slot, profile, candidates, now)
        if view is not candidates:
            self.spread_routes += 1
        return self.inner.route(profile, view, now)

    def observe(self, outcome: RequestOutcome) -> None:
        self.inner.observe(outcome)

    def register_instance(self, instance_id: str, prior: EnginePrior) -> None:
        self.inner.register_instance(instance_id, prior)

    def forget_instance(self, instance_id: str) -> None:
        self.inner.forget_instance(instance_id)

    def predict(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot],
                now: float) -> tuple[float, int] | None:
        return self.inner.predict(profile, candidates, now)  # whole sites compared: no share

    def prefix_match(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot],
                     now: float) -> list[int] | None:
        return self.inner.prefix_match(profile, candidates, now)

    def observe_kv_events(self, instance_id: str, seq: int, events: Sequence[Mapping[str, object]],
                          now: float) -> None:
        self.inner.observe_kv_events(instance_id, seq, events, now)

    def note_route(self, instance_id: str, block_hashes: Sequence[int], now: float) -> None:
        self.inner.note_route(instance_id, block_hashes, now)

    def note_dispatch(self, profile: RequestProfile, instance: InstanceSnapshot, now: float) -> None:
        self.inner.note_dispatch(profile, instance, now)

    def note_release(self, request_id: str, now: float) -> None:
        self.inner.note_release(request_id, now)

    def on_first_token(self, request_id: str, now: float) -> None:
        self.inner.on_first_token(request_id, now)  # (was not forwarded: TokenPilot's backlog never reconciled)

    def refit_due(self) -> bool:
        return self.inner.refit_due()

    def refit(self) -> bool:
        return self.inner.refit()

    def prepare_refit(self) -> None:
        self.inner.prepare_refit()

    def cache_blocks(self, instance_id: str) -> int | None:
        return self.inner.cache_blocks(instance_id)

    def cache_exact(self, instance_id: str, now: float) -> bool:
        return self.inner.cache_exact(instance_id, now)

    def __getattr__(self, name: str) -> Any:
        # The wrapped router's own extras (TokenPilot's `decisions`, `explain`) stay reachable.
        return getattr(self.__dict__["inner"], name) if "inner" in self.__dict__ else super().__getattribute__(name)
