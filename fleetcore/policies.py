"""The policy contracts, declared once: instance router, site chooser, admission.

The gateway and the simulator are two composition roots that drive the *same* policy
objects, so they must ask the same questions of them. Each contract is a base class a
policy subclasses: the decision method is abstract, everything else has a defined
do-nothing default (`observe` learns nothing, `poll` releases nothing, `predict` has no
opinion and says None, ...). Both roots therefore call every method unconditionally and
never probe a policy with `hasattr`/`getattr`; a capability that genuinely varies is an
explicit method with a neutral result, or a typed class attribute (`follows_kv_events`,
`holds_queue`).

Pure vocabulary: no I/O, no clock; `now` always comes from the caller.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from fleetcore.region_policy import PolicySet, Residency
from fleetcore.types import (
    AdmissionDecision,
    FleetView,
    InstanceSnapshot,
    RequestOutcome,
    RequestProfile,
    RouteDecision,
    SiteDecision,
)


@dataclass(frozen=True, slots=True)
class EnginePrior:
    """What a router believes about an instance before it has seen a single request.

    Plain data, so registering an instance (`InstanceRouter.register_instance`) needs no
    policy package; `tokenpilot.priors.prior_from_physics` fills it from the roofline."""

    prefill_token_s: float = 1 / 20_000  # compute time per prefill token in a full batch
    attn_s_per_token_ctx: float = 1e-9  # attention: extra time per prefill token per context token
    kv_read_s_per_token: float = 4e-8  # time to read one context token's KV in a decode step
    step_overhead_s: float = 0.008  # weights read + fixed cost: a decode-only step's floor
    capacity_blocks: int = 1 << 15
    block_size: int = 16
    max_batched_tokens: int = 8192

    @property
    def prefill_tokens_per_s(self) -> float:
        return 1.0 / self.prefill_token_s


class InstanceRouter(ABC):
    """Instance choice inside one site's model pool (TokenPilot, the baselines, the peers)."""

    name: str = "router"
    # True for a router whose cache index follows engine KV events (`observe_kv_events`):
    # the gateway subscribes to the engines' event streams only then (each is a socket).
    follows_kv_events: ClassVar[bool] = False

    @abstractmethod
    def route(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot],
              now: float) -> RouteDecision:
        """The instance among `candidates` (possibly none left: `instance_id` None, with why)."""

    def observe(self, outcome: RequestOutcome) -> None:
        """A routed request ended (every attempt, as the gateway saw it). Default: learns nothing."""

    def refit_due(self) -> bool:
        """Enough new outcomes for the router's learned model to be fitted again. Default: never."""
        return False

    def refit(self) -> bool:
        """Fit the router's learned model now: the gateway calls it from a background task (off
        the decision path), the simulator when `refit_due` after an outcome. Default: nothing to fit."""
        return False

    def prepare_refit(self) -> None:
        """Load what `refit` will need (its libraries), once, before any request is served: the
        gateway calls it at start-up in a worker thread. Default: nothing to load."""

    def on_first_token(self, request_id: str, now: float) -> None:
        """A routed, streamed request's first token arrived (or, late, that of another replica's
        dispatch heard through `note_dispatch`): its prefill is through (a load model reconciles
        its backlog with it). Default: ignored."""

    def register_instance(self, instance_id: str, prior: EnginePrior) -> None:
        """An instance joined the fleet (or restarted cold). Default: the router keeps no per-instance beliefs."""

    def forget_instance(self, instance_id: str) -> None:
        """An instance left the fleet or restarted: drop what was indexed for it. Default: nothing kept."""

    def predict(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot],
                now: float) -> tuple[float, int] | None:
        """(predicted TTFT s, cached tokens) at the best of `candidates`, without routing there:
        how a site chooser compares whole sites. None: this router has no cost model (the
        chooser falls back to its own estimate)."""
        return None

    def prefix_match(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot],
                     now: float) -> list[int] | None:
        """Blocks of the prompt's prefix the router believes each candidate holds (in candidate
        order), without routing: what a replica would give up by leaving an instance out
        (`fleetcore.replica_spread`). None: the router keeps no prefix index."""
        return None

    def observe_kv_events(self, instance_id: str, seq: int, events: Sequence[Mapping[str, object]],
                          now: float) -> None:
        """Engine KV cache events (only sent when `follows_kv_events`). Default: ignored."""

    def note_route(self, instance_id: str, block_hashes: Sequence[int], now: float) -> None:
        """Another gateway replica sent a prompt with these leading prefix blocks to the instance
        (its blocks will be cached there): a history-mode index learns it as its own route.
        Default: ignored (the router keeps no prefix index)."""

    def note_dispatch(self, profile: RequestProfile, instance: InstanceSnapshot, now: float) -> None:
        """Another gateway replica dispatched `profile` to `instance` (this replica's snapshot of
        it), heard a sync period late: a router that books its own dispatches (load in flight,
        history-mode prefix index) books this one the same way, so that `on_first_token` and
        `note_release` of the same request id later release it. The gateway (`gateway.route_share`)
        and the simulator (`fleetsim.replicas`) both deliver through here. Default: the prompt's
        prefix is learned (`note_route`); the load is the others' count in `InstanceSnapshot.inflight`."""
        self.note_route(instance.instance_id, profile.block_hashes, now)

    def note_release(self, request_id: str, now: float) -> None:
        """Another replica's dispatch heard through `note_dispatch` ended: release what was booked
        for it (nothing is learned: its outcome was the other replica's to learn from). Default:
        nothing was booked."""

    def cache_blocks(self, instance_id: str) -> int | None:
        """Prefix blocks the router's cache index holds for the instance (operators' fleet view).
        None: the router keeps no index it can report."""
        return None

    def cache_exact(self, instance_id: str, now: float) -> bool:
        """True while the index for the instance follows its engine's KV events exactly."""
        return False


class SiteChooser(ABC):
    """Site choice per request (FleetMind, the nearest-ready baseline)."""

    name: str = "site_chooser"

    @abstractmethod
    def choose(self, profile: RequestProfile, view: FleetView, now: float,
               exclude_instances: Collection[str] = ()) -> SiteDecision:
        """The site to run `profile` in, never one whose only ready instances are excluded."""

    def observe(self, outcome: RequestOutcome) -> None:
        """A routed request ended. Default: learns nothing."""

    def residency(self, profile: RequestProfile, view: FleetView) -> Residency | None:
        """Where the region policies let this request run (admin dry-run). None: this chooser
        applies no region policy."""
        return None

    def set_policies(self, policies: PolicySet) -> None:
        """Swap the whole region-policy set (admin API). Default: the chooser applies none."""

    def with_policies(self, policies: PolicySet) -> SiteChooser:
        """A chooser that decides as this one would under `policies`, leaving this one as it is
        (the admin dry-run of a proposed policy). Default: the chooser applies none: itself."""
        return self


class Admission(ABC):
    """Gateway admission (SLOMax, FCFS, the simulator's admit-all), in one of two modes.

    `admit` is asked at every arrival: "admit" dispatches at once (an admit may name
    `avoid_instances`, a hint routing drops when it leaves nothing), "reject" ends the
    request, "queue" holds it.

    * `holds_queue` True (SLOMax, FCFS): the policy keeps its queued requests and says
      when each may start, from `poll(now, view)` — called after every arrival it queued,
      every request end, and at the time `next_wakeup(now)` names; each returned decision
      names its `request_id`. A client gone while queued: `cancel(request_id, now)`.
    * `holds_queue` False (a hook with only `admit`): the simulator keeps one gateway FIFO
      and offers its requests again, oldest first, whenever a dispatched request ends.
      The live gateway supports only the first mode.

    Either way the policy hears where each request was routed (`on_dispatched`), when its
    prefill was through (`on_first_token`), a retry (`note_retry`) and every outcome of a
    request it admitted (`observe`).
    """

    name: str = "admission"
    holds_queue: ClassVar[bool] = False

    @abstractmethod
    def admit(self, profile: RequestProfile, view: FleetView, now: float) -> AdmissionDecision: ...

    def poll(self, now: float, view: FleetView | None = None) -> list[AdmissionDecision]:
        """Decisions about held requests. Default: it holds none."""
        return []

    def next_wakeup(self, now: float) -> float | None:
        """When `poll` should run next though nothing ended. None: only when something ends."""
        return None

    def cancel(self, request_id: str, now: float) -> bool:
        """The client left a held request; True if the policy was holding it."""
        return False

    def on_dispatched(self, request_id: str, instance_id: str, now: float) -> None:
        """Where routing sent an admitted request. Default: not needed."""

    def on_first_token(self, request_id: str, now: float) -> None:
        """An admitted request's prefill is through. Default: not needed."""

    def note_retry(self, request_id: str) -> None:
        """An admitted request is being tried again elsewhere. Default: not counted."""

    def observe(self, outcome: RequestOutcome) -> None:
        """The (final) outcome of a request this policy admitted. Default: nothing booked."""

    def snapshot(self, now: float) -> dict[str, Any]:
        """The policy's state for operators (admin API, metrics)."""
        return {"policy": self.name}
