"""Discrete-event fleet simulator: the production policies over simulated engines, in virtual time.

One run replays a workload through the *same* objects the gateway uses — an
admission hook, a site chooser (`NearestReadySite` by default) and any
`InstanceRouter` — in front of one `SimEngine` per instance of the fleet file,
built from the same hardware/physics tables as the live simulated worker.

What is modelled, and how:

* Arrival at the client entry region, which is where the gateway sits (the
  client-gateway hop is not modelled). Admission and routing happen at arrival.
* Network: a request reaches its site rtt/2 after dispatch; every token, and the
  end of the stream, reaches the gateway/client rtt/2 after the engine step that
  produced it. RTT is the fleet file's `rtt_ms[client region]` of the site (0 for
  a site's own region when the file gives none).
* Engines: each engine steps back to back while it has work (`step(now)` decides
  the batch and its duration; its events take effect at start + duration) and
  sleeps when idle; a request reaching an idle engine starts a step at once.
* Tokens: per request only the first/last token times and the count are kept
  (not every token), which is what TTFT, mean TPOT and end-to-end need.
* Cancellation: an optional per-request client timeout. The client gives up at
  arrival + timeout; the gateway releases it then (in-flight count, `observe`),
  and the abort reaches the engine rtt/2 later. Events of an aborted request
  from a step already under way are dropped, as the engine contract asks.
* Policy inputs: `InstanceSnapshot.inflight` is the gateway's own count (sent and
  not yet seen finish, including requests still on the wire); `num_running`,
  `num_waiting` and `kv_usage` are read from the engine at the decision instant.
  The simulator sees the engines' *true* state (no scrape lag), which favours
  load-aware policies slightly compared with the live gateway.
* Placement: `fleetmind.place`, the gateway's own site → pool → instance choice (admission's
  `avoid_instances` hint gives way when it leaves nothing; no attempt fails here, so
  nothing is excluded).
* Feedback: `RequestOutcome`s go to the router, site chooser and admission
  hook's `observe` when the gateway sees the request end, as in the gateway.
* Failures (only with a `FailureModel`; `fleetsim.failures` says how they are drawn and
  noticed): a dead engine loses its KV cache and its requests and restarts; a stalled one
  freezes. A failed attempt goes to the router and site chooser's `observe`; before its
  first token it is retried once elsewhere, after it it is continued — prompt + generated
  tokens re-prefilled for the remaining budget, placed by `fleetmind.place` with the
  continuation profile of `fleetcore.continuation` — or, if that refuses, fails
  (status "failed"). TTFT stays the first token's; TPOT and e2e include the gap.

The engine's state advances at `step()` time, so a snapshot taken during a step
already reflects that step's scheduling (admitted, preempted) — the granularity
of truth is one engine step.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, cast

from engine_adapters.sim.engine import EngineConfig, SimEngine, SimRequest, StepResult
from fleetcore import hardware
from fleetcore.continuation import ContinuationReason, Faithfulness, continuation_profile, refusal, remaining_budget
from fleetcore.fleet_config import FleetConfig, SiteConfig
from fleetcore.first_byte import ATTEMPTS_BEFORE_FIRST_BYTE
from fleetcore.policies import Admission, InstanceRouter, SiteChooser
from fleetcore.prefix import synthetic_block_hashes
from fleetcore.slo import class_by_length
from fleetcore.types import (
    AdmissionAction,
    AdmissionDecision,
    FleetView,
    InstanceSnapshot,
    RequestOutcome,
    RequestProfile,
    Role,
    SiteSnapshot,
)
from fleetmind.place import place
from fleetmind.site_choice import NearestReadySite, rtt_ms
from fleetcore.policies import EnginePrior
from tokenpilot.priors import prior_from_physics

from .failures import (
    FailureModel,
    FailureStats,
    FaultClock,
    FaultKind,
    first_byte_deadline_s,
    health_detect_s,
    tail_block_hashes,
)
from .metrics import RequestRecord, Status
from .replicas import ReplicatedRouter

# --- inputs -------------------------------------------------------------------


class TraceLike(Protocol):
    """The fields of `workloads.TraceRequest` the simulator reads (duck-typed, read-only)."""

    @property
    def timestamp_ms(self) -> float: ...
    @property
    def input_length(self) -> int: ...
    @property
    def output_length(self) -> int: ...
    @property
    def hash_ids(self) -> Sequence[int]: ...
    @property
    def block_tokens(self) -> int: ...
    @property
    def tenant(self) -> str | None: ...
    @property
    def request_class(self) -> str | None: ...
    @property
    def region(self) -> str | None: ...
    @property
    def model(self) -> str | None: ...
    @property
    def deadline_s(self) -> float | None: ...


@dataclass(slots=True)
class SimInput:
    """One request ready to simulate: engine block hashes computed, defaults resolved."""

    request_id: str
    arrival_s: float
    model: str
    prompt_tokens: int
    output_tokens: int  # exactly what the engine will generate
    block_hashes: tuple[int, ...]
    block_size: int
    tenant: str
    request_class: str
    region: str
    deadline_s: float | None = None
    timeout_s: float | None = None  # client gives up this long after arrival
    model_version: str | None = None  # None: any ready version


class HashCache:
    """Memo of trace-block -> engine-block hashes, shared by every run of one workload.

    Chained hashes depend on the whole prefix, so the key is (parent hash, block
    id). Requests re-sending a prefix (a third of the Mooncake blocks) cost one
    dict lookup per 512-token block instead of 32 xxhash calls.
    """

    def __init__(self) -> None:
        self._memo: dict[tuple[int, int, int], list[int]] = {}

    def hashes(self, block_ids: Sequence[int], sub_blocks: int, limit: int) -> tuple[int, ...]:
        out: list[int] = []
        parent = 0
        memo = self._memo
        for bid in block_ids:
            if len(out) >= limit:
                break
            key = (parent, bid, sub_blocks)
            sub = memo.get(key)
            if sub is None:
                sub = synthetic_block_hashes([bid], sub_blocks, parent=parent)
                memo[key] = sub
            out.extend(sub)
            parent = sub[-1]
        return tuple(out[:limit])


def prepare(requests: Sequence[TraceLike], fleet: FleetConfig, *, timeout_s: float | None = None,
            hash_cache: HashCache | None = None) -> list[SimInput]:
    """Resolve defaults (first model, entry region, class by length) and engine block hashes.

    Hashes: each trace block id expands to block_tokens // engine_block_size engine
    blocks (`synthetic_block_hashes`), truncated to the prompt's *full* engine blocks.
    Request ids are `r<index in the given order>`; the result is sorted by arrival
    (stable), so equal timestamps keep trace order.
    """
    cache = hash_cache or HashCache()
    default_model = fleet.models[0].name
    block_size = {m.name: m.engine.block_size for m in fleet.models}
    region = fleet.entry_region
    out: list[SimInput] = []
    for i, r in enumerate(requests):
        # `model@version` pins a version, as in the gateway's `model` field
        model, _, version = (r.model or default_model).partition("@")
        bs = block_size.get(model, 16)
        hashes: tuple[int, ...] = ()
        if r.hash_ids:
            bt = getattr(r, "block_tokens", 512) or 512
            if bt % bs:
                raise ValueError(f"trace block of {bt} tokens is not a multiple of the engine block size {bs}")
            hashes = cache.hashes(r.hash_ids, bt // bs, r.input_length // bs)
        out.append(SimInput(
            request_id=f"r{i}", arrival_s=r.timestamp_ms / 1000.0, model=model,
            prompt_tokens=int(r.input_length), output_tokens=max(1, int(r.output_length)),
            block_hashes=hashes, block_size=bs, tenant=r.tenant or "anonymous",
            request_class=r.request_class or class_by_length(int(r.input_length)),
            region=r.region or region, deadline_s=getattr(r, "deadline_s", None), timeout_s=timeout_s,
            model_version=version or None))
    out.sort(key=lambda s: s.arrival_s)
    return out


# --- admission hook -------------------------------------------------------------
# The contract (`Admission`: its two queue modes, `holds_queue`) is fleetcore.policies';
# AdmissionDecision / AdmissionAction live in fleetcore.types (the gateway acts on them too).


class AdmitAll(Admission):
    """FCFS, admit everything: the gateway without admission control."""

    name = "admit_all"

    def admit(self, profile: RequestProfile, view: FleetView, now: float) -> AdmissionDecision:
        return AdmissionDecision("admit")


# --- fleet ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    instance_id: str
    site: str
    model: str
    version: str
    gpu: str
    tp: int
    engine: EngineConfig
    role: Role = "mixed"  # the fleet file's; a simulation without --disagg runs every one mixed


def fleet_instances(fleet: FleetConfig) -> list[InstanceSpec]:
    """One simulated engine per instance of every non-static deployment.

    Ids follow `engine_adapters.registry`: `site/model/N`, `site/model#k/N` for a
    site's k-th further deployment of a model. vllm/sglang deployments are
    simulated with their GPU and TP; static ones (bare URLs, hardware unknown)
    are left out.
    """
    seen: dict[tuple[str, str], int] = {}
    out: list[InstanceSpec] = []
    for d in fleet.deployments:
        k = seen.get((d.site, d.model), 0)
        seen[(d.site, d.model)] = k + 1
        if d.adapter == "static":
            continue
        prefix = f"{d.site}/{d.model}" + (f"#{k}" if k else "")
        eng = fleet.model(d.model).engine
        override = d.options.get("num_gpu_blocks_override")
        cfg = EngineConfig(
            model=hardware.model(eng.spec), gpu=hardware.gpu(d.gpu), tp=d.tp,
            block_size=eng.block_size, max_num_batched_tokens=eng.max_num_batched_tokens,
            max_num_seqs=eng.max_num_seqs, gpu_memory_utilization=eng.gpu_memory_utilization,
            max_model_len=eng.max_model_len,
            num_gpu_blocks_override=int(override) if override is not None else None,
            enable_kv_events=False,  # nobody drains them here; saves time and memory
            compute_efficiency_curve=eng.compute_efficiency_curve)
        version = fleet.deployment_version(d)
        for n, role in enumerate(d.instance_roles()):
            out.append(InstanceSpec(f"{prefix}/{n}", d.site, d.model, version, d.gpu, d.tp, cfg, role))
    return out


def spec_prior(spec: InstanceSpec) -> EnginePrior:
    """A router's starting beliefs about a simulated instance: the roofline of its engine."""
    e = spec.engine
    return prior_from_physics(e.model.name, spec.gpu, spec.tp, e.block_size, e.max_num_batched_tokens,
                              e.gpu_memory_utilization)


def site_rtt_s(site: SiteConfig, region: str) -> float:
    """Round trip between a client entry region and a site, seconds (FleetMind's rule)."""
    return rtt_ms(site, region) / 1000.0


# --- simulator ------------------------------------------------------------------


class _Inst:
    __slots__ = ("iid", "site", "model", "version", "url", "engine", "stepping", "pending",
                 "inflight", "max_model_len", "block_size", "spec", "ready", "draining", "role", "busy_s",
                 "epoch", "down", "frozen_until", "shift")

    def __init__(self, spec: InstanceSpec, role: Role = "mixed") -> None:
        self.spec = spec
        self.role: Role = role  # prefill/decode only when the run disaggregates (fleetsim.disagg)
        self.busy_s = 0.0  # engine time spent stepping
        self.ready = True  # a replica added at run time is not ready until it has started
        self.draining = False  # takes no new requests, finishes what it has
        self.iid = spec.instance_id
        self.site = spec.site
        self.model = spec.model
        self.version = spec.version
        self.url = f"sim://{spec.instance_id}"
        self.engine = SimEngine(spec.engine)
        self.stepping = False  # a step is under way (its STEP_END is on the heap)
        self.pending: StepResult | None = None  # that step's result
        self.inflight = 0  # gateway's count: dispatched, not yet seen end
        self.max_model_len = self.engine.max_model_len
        self.block_size = spec.engine.block_size
        # Failures (see fleetsim.failures): a death starts a new epoch (a step end of the old
        # engine is dropped); a stall freezes the engine until `frozen_until` and delays the
        # step under way by `shift` seconds.
        self.epoch = 0
        self.down = False  # dead, not yet restarted
        self.frozen_until = 0.0
        self.shift = 0.0


class _Req:
    __slots__ = ("inp", "profile", "status", "inst", "site", "half_rtt", "dispatch_s", "reach_s",
                 "first", "last", "ntok", "cached", "engine_wait", "end", "reason",
                 "eid", "legs", "conts", "retries", "excluded", "leg_prompt", "leg_hashes", "leg_out",
                 "leg_base", "leg_dispatch_s", "predicted_ttft", "failed_at")

    def __init__(self, inp: SimInput, profile: RequestProfile) -> None:
        self.inp = inp
        self.profile = profile
        self.status = "new"  # new | queued | running | completed | rejected | cancelled | failed
        self.inst: _Inst | None = None
        self.site: str | None = None
        self.half_rtt = 0.0
        self.dispatch_s = 0.0
        self.reach_s = 0.0
        self.first: float | None = None  # engine time of the step that made the first token
        self.last: float | None = None
        self.ntok = 0
        self.cached = 0
        self.engine_wait: float | None = None
        self.end: float | None = None
        self.reason: str | None = None
        # The attempt under way ("leg"): a retry or a continuation after a failure is a new
        # leg with its own engine request id, prompt and output budget.
        self.eid = inp.request_id
        self.legs = 0  # legs started after the first
        self.conts = 0  # of them continuations (after the first token)
        self.retries = 0  # of them retries (before it)
        self.excluded: list[str] = []  # instances that failed this request
        self.leg_prompt = inp.prompt_tokens
        self.leg_hashes = inp.block_hashes
        self.leg_out = inp.output_tokens
        self.leg_base = 0  # tokens the request had when this leg started
        self.leg_dispatch_s = 0.0
        self.predicted_ttft: float | None = None
        self.failed_at = 0.0  # when the failure the current leg continues from happened


# Heap event kinds; ties at one instant run in push order (the sequence number).
_REACH, _STEP_END, _DONE, _CANCEL, _ABORT, _POLL, _TICK, _READY, _SYNC, _FAULT = range(10)

class PDHook(Protocol):
    """The prefill/decode half of a run (`fleetsim.disagg.PDRuntime`), as the simulator calls it."""

    def dispatch(self, r: _Req, now: float, view: FleetView, avoid: Collection[str]) -> None: ...
    def on_prefill_event(self, ev: Any, res: StepResult, now: float) -> None: ...
    def on_cancel(self, r: _Req, now: float) -> None: ...


# A periodic controller (e.g. FleetMind's placement planner): called as fn(simulator, now).
Controller = Callable[["FleetSimulator", float], None]


@dataclass(slots=True)
class SimResult:
    records: list[RequestRecord]
    wall_s: float
    steps: int = 0
    preemptions: int = 0
    sim_end_s: float = 0.0
    warnings: list[str] = field(default_factory=list)
    failures: dict[str, Any] | None = None  # FailureStats.as_dict() when failures were simulated


ProgressFn = Callable[[int, int], None]


class FleetSimulator:
    """One run: a fresh fleet of engines, the given policy objects, one workload.

    Policies keep learned state, so give every run fresh policy objects when
    comparing them.
    """

    def __init__(self, fleet: FleetConfig, router: InstanceRouter, *, site_chooser: SiteChooser | None = None,
                 admission: Admission | None = None, progress: ProgressFn | None = None,
                 controllers: Sequence[tuple[float, Controller]] = (),
                 pd: Callable[[FleetSimulator], PDHook] | None = None,
                 failures: FailureModel | None = None) -> None:
        self.fleet = fleet
        self.router = router
        if isinstance(router, ReplicatedRouter):  # gateway replicas: their syncs run in virtual time
            router.attach(lambda t, fn: self._push(t, _SYNC, fn))
        self.site_chooser: SiteChooser = site_chooser or NearestReadySite()
        self.admission = admission or AdmitAll()
        self.progress = progress
        # Prefill/decode disaggregation (fleetsim.disagg): None runs every instance mixed.
        self.pd = pd(self) if pd is not None else None
        self._insts = [_Inst(s, s.role if self.pd is not None else "mixed") for s in fleet_instances(fleet)]
        self._by_id = {i.iid: i for i in self._insts}
        self._sites = list(fleet.sites)
        self._site_cfg = {s.name: s for s in fleet.sites}
        self._site_insts = [(s, [i for i in self._insts if i.site == s.name]) for s in self._sites]
        self._max_len: dict[str, int] = {}
        for i in self._insts:
            self._max_len[i.model] = max(self._max_len.get(i.model, 0), i.max_model_len)
        self._rtt_memo: dict[tuple[str, str], float] = {}
        self._observers = [p.observe for p in (self.router, self.site_chooser, self.admission)]
        self._heap: list[tuple[float, int, int, Any, Any]] = []
        self._seq = 0
        self._queue: deque[_Req] = deque()
        self._active: dict[str, _Req] = {}  # request id -> request an engine is serving
        # Hook-owned queues (see Admission): requests the hook holds, and its wake-up.
        self._hook_queues = self.admission.holds_queue
        self._held: dict[str, _Req] = {}
        self._wake_at = float("inf")
        self.steps = 0
        self.preemptions = 0
        self.controllers = list(controllers)
        self.requests: list[_Req] = []  # every arrival so far, in order (controllers read it)
        self._added = 0
        self.failures = failures  # None: engines never fail (and the report has no failures block)
        self.failure_stats = FailureStats()
        self._fault_clock = FaultClock(self.failures) if self.failures is not None else None
        self._last_arrival = 0.0
        self._health_detect_s = health_detect_s(fleet.gateway)

    # -- views -------------------------------------------------------------------

    def view(self) -> FleetView:
        """The FleetView the policies see now (the engines' true state)."""
        sites = []
        for s, insts in self._site_insts:
            sites.append(SiteSnapshot(name=s.name, region=s.region, jurisdiction=s.jurisdiction,
                                      rtt_ms=s.rtt_ms, instances=tuple(self.snapshot(i) for i in insts)))
        return FleetView(tuple(sites))

    @staticmethod
    def snapshot(i: _Inst) -> InstanceSnapshot:
        """One instance as the policies see it now (its engine's true state)."""
        e = i.engine
        return InstanceSnapshot(
            instance_id=i.iid, site=i.site, model=i.model, version=i.version, url=i.url,
            ready=i.ready, draining=i.draining, role=i.role, inflight=i.inflight, num_running=e.num_running,
            num_waiting=e.num_waiting, kv_usage=e.kv.usage(), block_size=i.block_size, max_model_len=i.max_model_len)

    def _rtt(self, site: str, region: str) -> float:
        key = (site, region)
        v = self._rtt_memo.get(key)
        if v is None:
            v = self._rtt_memo[key] = site_rtt_s(self._site_cfg[site], region)
        return v

    # -- a changing fleet (the placement planner's moves) ---------------------------

    def placement(self) -> dict[tuple[str, str], int]:
        """Replicas per (site, model) that serve or are starting (draining ones excluded)."""
        out: dict[tuple[str, str], int] = {}
        for i in self._insts:
            if not i.draining:
                out[(i.site, i.model)] = out.get((i.site, i.model), 0) + 1
        return out

    def add_instance(self, site: str, model: str, now: float, startup_s: float,
                     on_ready: Callable[[str, float], None] | None = None) -> str:
        """Start a replica of `model` in `site`, on the hardware that site (else the fleet)
        runs the model on; it takes requests from `now + startup_s`, when `on_ready(id, time)`
        is called (the placement cycle drains the source then: make-before-break)."""
        same = [i for i in self._insts if i.model == model]
        if not same:
            raise ValueError(f"no deployment of {model!r} to copy the hardware of")
        spec = next((i.spec for i in same if i.site == site), same[0].spec)
        self._added += 1
        iid = f"{site}/{model}/+{self._added}"
        inst = _Inst(InstanceSpec(iid, site, model, spec.version, spec.gpu, spec.tp, spec.engine))
        inst.ready = False
        self._insts.append(inst)
        self._by_id[iid] = inst
        for s, insts in self._site_insts:
            if s.name == site:
                insts.append(inst)
        self.router.register_instance(iid, spec_prior(spec))
        self._push(now + startup_s, _READY, inst, on_ready)
        if self._fault_clock is not None:  # it can fail once it runs
            self._arm_faults(inst, now + startup_s)
        return iid

    # -- what the P/D half (fleetsim.disagg) drives ----------------------------------

    def instance(self, instance_id: str) -> _Inst:
        return self._by_id[instance_id]

    def instances(self) -> list[_Inst]:
        return list(self._insts)

    def schedule(self, t: float, fn: Callable[[float], None]) -> None:
        """Call fn(t) at virtual time t."""
        self._push(t, _SYNC, fn)

    def kick(self, inst: _Inst, now: float) -> None:
        """New work reached `inst`: step it now unless a step is under way."""
        if not inst.stepping:
            self._step(inst, now)

    def kv_arrived(self, r: _Req, inst: _Inst, now: float) -> None:
        """A split request's KV reached its decode instance: its first token leaves from there now."""
        rid = r.inp.request_id
        self._active[rid] = r
        r.ntok = 1
        r.first = r.last = now
        self.admission.on_first_token(rid, now)
        self.kick(inst, now)

    def drain(self, instance_id: str) -> None:
        """Stop sending requests to a replica; it finishes what it has."""
        self._by_id[instance_id].draining = True

    # -- helpers -----------------------------------------------------------------

    def _push(self, t: float, kind: int, a: object, b: object = None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, a, b))

    def _step(self, inst: _Inst, now: float) -> None:
        if inst.frozen_until > now:  # stalled: it steps again when the stall ends
            return
        res = inst.engine.step(now)
        if res.duration <= 0.0:
            # Nothing schedulable (cannot happen with a sane KV size); wait for the next arrival.
            inst.stepping = False
            return
        self.steps += 1
        inst.pending = res
        inst.stepping = True
        self._seq += 1
        heapq.heappush(self._heap, (now + res.duration, self._seq, _STEP_END, inst, inst.epoch))

    def _reject(self, r: _Req, now: float, reason: str) -> None:
        r.status = "rejected"
        r.reason = reason
        r.end = now

    def _observe(self, outcome: RequestOutcome) -> None:
        for fn in self._observers:
            fn(outcome)
        if self.router.refit_due():  # in virtual time, where the gateway's background task would
            self.router.refit()

    def _outcome(self, r: _Req, now: float, *, cancelled: bool) -> RequestOutcome:
        arrival = r.inp.arrival_s
        ttft = tpot = None
        if r.first is not None and r.last is not None:
            ttft = r.first + r.half_rtt - arrival
            if r.ntok > 1:
                tpot = (r.last - r.first) / (r.ntok - 1)
        return RequestOutcome(
            request_id=r.inp.request_id, instance_id=r.inst.iid if r.inst else "", site=r.site or "",
            ok=not cancelled, prompt_tokens=r.inp.prompt_tokens, cached_tokens=r.cached,
            output_tokens=r.ntok, ttft_s=ttft, mean_tpot_s=tpot,
            e2e_s=now - arrival, error="cancelled" if cancelled else None, cancelled=cancelled,
            network_s=2.0 * r.half_rtt)

    def _offer(self, r: _Req, now: float, view: FleetView | None = None) -> bool:
        """Ask admission, then dispatch or reject; False when it queues (stays queued)."""
        view = view or self.view()
        d = self.admission.admit(r.profile, view, now)
        if d.action == "queue":
            return False
        if d.action == "reject":
            self._reject(r, now, self._reason(d))
            return True
        self._dispatch(r, now, view, d.avoid_instances)
        return True

    def _dispatch(self, r: _Req, now: float, view: FleetView, avoid: Collection[str] = ()) -> None:
        if self.pd is not None:  # prefill/decode: the P/D half places both legs (fleetsim.disagg)
            unfit = self._unfit(r)
            if unfit is not None:
                self._undispatchable(r, now, unfit)
                return
            r.dispatch_s = now
            self.pd.dispatch(r, now, view, avoid)
            return
        inst = self._place(r, r.profile, now, view, avoid)
        if isinstance(inst, str):
            self._undispatchable(r, now, inst)
            return
        r.dispatch_s = now
        self._send(r, inst, now)

    def _unfit(self, r: _Req) -> str | None:
        """Why no instance of this fleet can take `r` at all, or None."""
        inp = r.inp
        if inp.model not in self._max_len:
            return f"model {inp.model!r} is not served by this fleet"
        need = inp.prompt_tokens + inp.output_tokens  # a continuation's too: its prompt holds what it generated
        if need > self._max_len[inp.model]:
            return f"context_length_exceeded: {need} tokens > {self._max_len[inp.model]}"
        return None

    def _place(self, r: _Req, profile: RequestProfile, now: float, view: FleetView,
               avoid: Collection[str] = (), exclude: Collection[str] = ()) -> _Inst | str:
        """The instance for this attempt of `r` (`fleetmind.place`), or why there is none."""
        unfit = self._unfit(r)
        if unfit is not None:
            return unfit
        need = r.inp.prompt_tokens + r.inp.output_tokens
        choice = place(profile, view, now, self.site_chooser, self.router, exclude=exclude, avoid=avoid)
        inst = self._by_id.get(choice.instance.instance_id) if choice.instance is not None else None
        if inst is None or choice.site.site is None:
            return choice.reason
        if need > inst.max_model_len:
            return f"context_length_exceeded on {inst.iid}"
        r.predicted_ttft = choice.route.predicted_ttft_s if choice.route is not None else None
        return inst

    def _send(self, r: _Req, inst: _Inst, now: float) -> None:
        """Send the current leg of `r` to `inst`: it reaches the engine half a round trip later."""
        self._start(r, inst, now)
        self._push(now + r.half_rtt, _REACH, r)

    def reach_local(self, r: _Req, now: float) -> None:
        """A started request whose prefill leg was withdrawn (`fleetsim.disagg`): it reaches its
        own instance (`r.inst`, counted in flight there already) to run whole."""
        self._push(now + r.half_rtt, _REACH, r)

    def _start(self, r: _Req, inst: _Inst, now: float) -> None:
        """The current leg of `r` runs, streaming from `inst`: the gateway counts it in flight there."""
        r.status = "running"
        r.inst = inst
        r.site = inst.site
        r.leg_dispatch_s = now
        r.half_rtt = self._rtt(inst.site, r.inp.region) / 2.0
        inst.inflight += 1
        self.admission.on_dispatched(r.inp.request_id, inst.iid, now)

    def _undispatchable(self, r: _Req, now: float, reason: str) -> None:
        """Admitted, but nowhere to send it: rejected, and admission hears it failed (it counted
        the request in flight and must let it go, as the gateway's relay does)."""
        self._reject(r, now, reason)
        self.admission.observe(RequestOutcome(request_id=r.inp.request_id, instance_id="", site="", ok=False,
                                              prompt_tokens=r.inp.prompt_tokens, e2e_s=now - r.inp.arrival_s,
                                              error=reason))

    def _poll_admission(self, now: float) -> None:
        """Act on the hook's decisions for requests it holds, then book its next wake-up."""
        assert self._hook_queues
        for d in self.admission.poll(now, self.view()):
            r = self._held.pop(d.request_id or "", None)
            if r is None or r.status != "queued":
                continue
            if d.action == "admit":
                self._dispatch(r, now, self.view(), d.avoid_instances)  # a fresh view: earlier dispatches count
            elif d.action == "reject":
                self._reject(r, now, self._reason(d))
            else:
                self._held[r.inp.request_id] = r
        t = self.admission.next_wakeup(now)
        if t is not None and self._held and t < self._wake_at:  # as the gateway's: only while it holds one
            self._wake_at = max(t, now)
            self._push(self._wake_at, _POLL, None)

    @staticmethod
    def _reason(d: AdmissionDecision) -> str:
        text = d.reason or "rejected by admission"
        return f"{d.code}: {text}" if d.code else text

    def _after_release(self, now: float) -> None:
        """A dispatched request ended at the gateway: queued work may start. The policy is polled
        whether or not it holds a request, as the gateway's `AdmissionGate.pump` polls it after
        every release: SLOMax's controller runs in `poll` (polled only while holding, it never
        brought its prefill budget in here when nothing had queued yet, and live it did)."""
        if self._hook_queues:
            self._poll_admission(now)
        elif self._queue:
            self._drain_queue(now)

    def _drain_queue(self, now: float) -> None:
        q = self._queue
        while q:
            r = q[0]
            if r.status != "queued":  # cancelled while queued
                q.popleft()
                continue
            if not self._offer(r, now):
                return
            q.popleft()

    # -- the run -----------------------------------------------------------------

    def run(self, inputs: Sequence[SimInput]) -> SimResult:
        wall0 = time.perf_counter()
        heap = self._heap
        pop = heapq.heappop
        push = heapq.heappush
        active = self._active
        reqs: list[_Req] = []
        n = len(inputs)
        i = 0
        next_arrival = inputs[0].arrival_s if n else float("inf")
        now = 0.0
        ticks = 0
        progress = self.progress
        admission_first_token = self.admission.on_first_token
        router_first_token = self.router.on_first_token

        def first_token(request_id: str, now: float) -> None:
            admission_first_token(request_id, now)
            router_first_token(request_id, now)
        pd = self.pd
        self.requests = reqs
        for ctl in self.controllers:
            # A controller whose `at_start` is true also runs at the first arrival, before it is
            # placed (the P/D role controller's starting fleet, `fleetsim.disagg.PDRolesLoop`).
            first = 0.0 if getattr(ctl[1], "at_start", False) else ctl[0]
            self._push((inputs[0].arrival_s if n else 0.0) + first, _TICK, ctl)
        if self.failures is not None and n:
            self._start_failures(inputs[0].arrival_s, inputs[-1].arrival_s)
        while True:
            if heap and heap[0][0] <= next_arrival:
                now, _, kind, a, b = pop(heap)
                if kind == _STEP_END:
                    # Hot path: apply the finished step, start the next one.
                    inst = a
                    if b != inst.epoch or inst.shift:  # a dead engine's step, or a stalled one's
                        self._step_held(inst, now, b)
                        continue
                    res = inst.pending
                    inst.busy_s += res.duration
                    for ev in res.events:
                        r = active.get(ev.request_id)
                        if r is None:
                            if pd is not None:  # a prefill leg (else: aborted while the step ran)
                                pd.on_prefill_event(ev, res, now)
                            continue
                        if ev.new_tokens:
                            r.ntok += 1
                            if ev.first_token:
                                if r.conts:  # a continuation's first token is not the request's
                                    self._resumed(r, ev.cached_tokens, now)
                                else:
                                    r.first = now
                                    r.cached = ev.cached_tokens
                                    r.engine_wait = res.start - r.reach_s
                                    first_token(r.inp.request_id, now)
                            r.last = now
                            if ev.finished:
                                del active[ev.request_id]
                                self._seq += 1
                                push(heap, (now + r.half_rtt, self._seq, _DONE, r, None))
                        elif ev.preempted:
                            self.preemptions += 1
                    e = inst.engine
                    if e.has_work():
                        res = e.step(now)  # inlined _step: this is the hot loop
                        if res.duration > 0.0:
                            self.steps += 1
                            inst.pending = res
                            self._seq += 1
                            push(heap, (now + res.duration, self._seq, _STEP_END, inst, inst.epoch))
                        else:
                            inst.stepping = False
                            inst.pending = None
                    else:
                        inst.stepping = False
                        inst.pending = None
                elif kind == _REACH:
                    r = a
                    if r.status == "running":  # not cancelled on the way
                        inst = r.inst
                        if inst.down:  # sent to an engine that died meanwhile: connection refused
                            self._push(now + r.half_rtt, _FAULT, self._leg_failed_fn(r, "engine_died", now))
                        else:
                            r.reach_s = now
                            inst.engine.add_request(SimRequest(r.eid, r.leg_prompt, r.leg_hashes, r.leg_out, now))
                            active[r.eid] = r
                            if inst.frozen_until > now:  # stalled: the gateway's deadlines will notice
                                self._watch_stalled(r, inst, now)
                            elif not inst.stepping:
                                self._step(inst, now)
                elif kind == _DONE:
                    r = a
                    if r.status == "running":
                        r.status = "completed"
                        r.end = now
                        r.inst.inflight -= 1
                        self._observe(self._outcome(r, now, cancelled=False))
                        self._after_release(now)
                elif kind == _CANCEL:
                    self._cancel(a, now)
                elif kind == _POLL:
                    if now >= self._wake_at:  # else superseded by an earlier wake-up
                        self._wake_at = float("inf")
                        self._poll_admission(now)
                elif kind == _TICK:
                    interval, fn = a
                    fn(self, now)
                    if i < n or active:  # keep ticking while there is work to come
                        self._push(now + interval, _TICK, a)
                elif kind == _READY:
                    a.ready = True
                    self._after_release(now)  # queued work may start on it
                    if b is not None:
                        b(a.iid, now)
                elif kind == _SYNC:
                    a(now)  # a gateway replica hears of another's dispatch or release
                elif kind == _FAULT:
                    a(now)  # an engine fails, restarts or resumes; a request hears of it
                else:  # _ABORT
                    a.engine.abort(b)
            elif i < n:
                inp = inputs[i]
                i += 1
                now = inp.arrival_s
                next_arrival = inputs[i].arrival_s if i < n else float("inf")
                r = self._arrive(inp, now)
                reqs.append(r)
            else:
                break
            ticks += 1
            if progress is not None and not ticks & 0x3FFF:
                progress(min(i, n - 1), n)  # 100% only once the run has drained

        warnings = []
        for r in reqs:
            if r.status == "queued":
                self._reject(r, now, "still queued at the end of the run")
            elif r.status == "running":  # an engine that never finished it: a bug, do not hide it
                r.status = "cancelled"
                r.reason = "unfinished at the end of the run"
                r.end = now
                warnings.append(f"request {r.inp.request_id} never finished")
        if progress is not None:
            progress(n, n)
        records = [self._record(r) for r in reqs]
        failures = self.failure_stats.as_dict() if self.failures is not None else None
        return SimResult(records, time.perf_counter() - wall0, self.steps, self.preemptions, now, warnings,
                         failures)

    def _arrive(self, inp: SimInput, now: float) -> _Req:
        profile = RequestProfile(
            request_id=inp.request_id, model=inp.model, model_version=inp.model_version,
            prompt_tokens=inp.prompt_tokens, block_hashes=inp.block_hashes, block_size=inp.block_size, max_tokens=inp.output_tokens,
            tenant=inp.tenant, request_class=inp.request_class, stream=True, client_region=inp.region,
            arrival=now, deadline=(now + inp.deadline_s) if inp.deadline_s is not None else None)
        r = _Req(inp, profile)
        if inp.timeout_s is not None:
            self._push(now + inp.timeout_s, _CANCEL, r)
        if not self._offer(r, now):
            r.status = "queued"
            if self._hook_queues:
                self._held[inp.request_id] = r
                self._poll_admission(now)
            else:
                self._queue.append(r)
        return r

    def _cancel(self, r: _Req, now: float) -> None:
        if r.status == "queued":
            r.status = "cancelled"
            r.reason = "client timeout while queued"
            r.end = now
            if self._held.pop(r.inp.request_id, None) is not None:
                self.admission.cancel(r.inp.request_id, now)
            return
        if r.status != "running":
            return
        r.status = "cancelled"
        r.reason = "client timeout"
        r.end = now
        if self.pd is not None:
            self.pd.on_cancel(r, now)
        inst = r.inst
        assert inst is not None  # running implies dispatched
        inst.inflight -= 1
        self._active.pop(r.eid, None)
        self._push(now + r.half_rtt, _ABORT, inst, r.eid)
        self._observe(self._outcome(r, now, cancelled=True))
        self._after_release(now)

    def _record(self, r: _Req) -> RequestRecord:
        inp = r.inp
        h = r.half_rtt
        ttft = tpot = e2e = queue = None
        end = r.end if r.end is not None else float("inf")
        if r.first is not None and r.last is not None and (r.status != "cancelled" or r.first + h <= end):
            ttft = r.first + h - inp.arrival_s
            queue = (r.dispatch_s - inp.arrival_s) + (r.engine_wait or 0.0)
            if r.status == "completed":
                e2e = r.last + h - inp.arrival_s
                if r.ntok > 1:
                    tpot = (r.last - r.first) / (r.ntok - 1)
        return RequestRecord(
            request_id=inp.request_id, arrival_s=inp.arrival_s, prompt_tokens=inp.prompt_tokens,
            status=cast(Status, r.status), tenant=inp.tenant, model=inp.model, request_class=inp.request_class,
            output_tokens=r.ntok,
            cached_tokens=r.cached, ttft_s=ttft, tpot_s=tpot, e2e_s=e2e, queue_s=queue, end_s=r.end,
            deadline_s=inp.deadline_s, site=r.site, instance=r.inst.iid if r.inst else None, reason=r.reason)

    # -- failures and continuation (fleetsim.failures) ---------------------------------
    # A death replaces the engine (new epoch: the old one's step end is dropped) and ends
    # every leg on it; a stall freezes it. Each failed leg is then retried (before its first
    # token) or continued (after it) through `_place`, the same placement as a first attempt.

    def inject(self, instance_id: str, kind: FaultKind, at: float) -> None:
        """A failure at a chosen time (besides the model's random ones); needs a `FailureModel`.
        Ignored if the instance is already dead or stalled then."""
        if self.failures is None:
            raise ValueError("inject needs a FailureModel (failures=...)")
        inst = self._by_id[instance_id]

        def fire(now: float) -> None:
            if not (inst.down or inst.frozen_until > now):
                (self._die if kind == "death" else self._stall)(inst, now)
        self._push(at, _FAULT, fire)

    def _start_failures(self, first_arrival: float, last_arrival: float) -> None:
        self._last_arrival = last_arrival
        for inst in self._insts:
            self._arm_faults(inst, first_arrival)

    def _arm_faults(self, inst: _Inst, t: float) -> None:
        self._arm_fault(inst, "death", t)
        self._arm_fault(inst, "stall", t)

    def _arm_fault(self, inst: _Inst, kind: FaultKind, t: float) -> None:
        assert self._fault_clock is not None
        at = self._fault_clock.next_after(inst.iid, kind, t)
        if at is not None:
            self._push(at, _FAULT, lambda now: self._fault(inst, kind, now))

    def _restart_s(self, inst: _Inst) -> float:
        assert self.failures is not None
        if self.failures.restart_s is not None:
            return self.failures.restart_s
        from .planning import startup_s  # planning imports this module: import at call time
        return startup_s(self.fleet, inst.site, inst.model)

    def _work_left(self, now: float) -> bool:
        return now < self._last_arrival or bool(self._active or self._queue or self._held)

    def _fault(self, inst: _Inst, kind: FaultKind, now: float) -> None:
        if not self._work_left(now):
            return  # the workload is over: no failure to count, none to arm
        if inst.down or inst.frozen_until > now:
            self._arm_fault(inst, kind, now)  # it fails only while it runs (memoryless: draw again)
            return
        if kind == "death":
            self._die(inst, now)
        else:
            self._stall(inst, now)

    def _die(self, inst: _Inst, now: float) -> None:
        self.failure_stats.deaths += 1
        inst.epoch += 1
        inst.down = True
        inst.ready = False  # a refused connection takes it out at once
        inst.engine = SimEngine(inst.spec.engine)  # a new process: the KV cache is gone
        inst.stepping = False
        inst.pending = None
        inst.shift = 0.0
        for r in [r for r in self._active.values() if r.inst is inst]:
            del self._active[r.eid]
            # the connection resets; the gateway hears it half a round trip later
            self._push(now + r.half_rtt, _FAULT, self._leg_failed_fn(r, "engine_died", now))
        self._push(now + self._restart_s(inst), _FAULT, lambda t: self._restarted(inst, t))

    def _restarted(self, inst: _Inst, now: float) -> None:
        inst.down = False
        inst.ready = True
        self._arm_fault(inst, "death", now)
        self._after_release(now)  # queued work may start on it

    def _stall(self, inst: _Inst, now: float) -> None:
        assert self.failures is not None
        self.failure_stats.stalls += 1
        inst.frozen_until = now + self.failures.stall_s
        if inst.stepping:
            inst.shift = self.failures.stall_s  # the step under way ends that much later
        for r in [r for r in self._active.values() if r.inst is inst]:
            self._watch_stalled(r, inst, now)
        self._push(now + self._health_detect_s, _FAULT, lambda t: self._health_missed(inst, t))
        self._push(inst.frozen_until, _FAULT, lambda t: self._stall_ended(inst, t))

    def _health_missed(self, inst: _Inst, now: float) -> None:
        if inst.frozen_until > now:
            inst.ready = False

    def _stall_ended(self, inst: _Inst, now: float) -> None:
        inst.ready = True  # its health checks pass again
        if not inst.stepping and inst.engine.has_work():
            self._step(inst, now)
        self._arm_fault(inst, "stall", now)
        self._after_release(now)

    def _step_held(self, inst: _Inst, now: float, epoch: int) -> None:
        """A step end that must not be applied now: dropped (its engine died) or put off (stall)."""
        if epoch != inst.epoch:
            return
        self._seq += 1
        heapq.heappush(self._heap, (now + inst.shift, self._seq, _STEP_END, inst, epoch))
        inst.shift = 0.0

    def _watch_stalled(self, r: _Req, inst: _Inst, now: float) -> None:
        """Arm the relay's deadline for `r`'s leg on a stalled `inst`: idle after a token of
        this leg, first byte before one."""
        g = self.fleet.gateway
        if r.ntok > r.leg_base and r.last is not None:
            due = r.last + r.half_rtt + g.stream_idle_timeout_s
        else:
            due = r.leg_dispatch_s + first_byte_deadline_s(g, r.predicted_ttft)
        leg, seen = r.legs, r.ntok
        self._push(max(due, now), _FAULT, lambda t: self._stall_deadline(r, inst, leg, seen, t))

    def _stall_deadline(self, r: _Req, inst: _Inst, leg: int, seen: int, now: float) -> None:
        if r.status != "running" or r.legs != leg or r.inst is not inst:
            return
        if r.ntok != seen:  # a token came since: not silent for the whole deadline
            if inst.frozen_until > now:
                self._watch_stalled(r, inst, now)
            return
        assert self.failures is not None
        if inst.frozen_until > now:  # the relay marks it failed; a stall already over passes the next check
            inst.ready = False
        self._active.pop(r.eid, None)
        self._leg_failed(r, leg, "stalled", inst.frozen_until - self.failures.stall_s, now)

    def _leg_failed_fn(self, r: _Req, reason: ContinuationReason, failed_at: float) -> Callable[[float], None]:
        leg = r.legs
        return lambda now: self._leg_failed(r, leg, reason, failed_at, now)

    def _leg_failed(self, r: _Req, leg: int, reason: ContinuationReason, failed_at: float, now: float) -> None:
        """The gateway learns that `r`'s current leg failed: retry, continue, or fail it."""
        if r.status != "running" or r.legs != leg:
            return  # the client gave up meanwhile
        inst = r.inst
        assert inst is not None
        inst.inflight -= 1
        r.excluded.append(inst.iid)
        if reason == "stalled":  # the relay drops the connection: the engine aborts it when it can
            self._push(now + r.half_rtt, _ABORT, inst, r.eid)
        failed = replace(self._outcome(r, now, cancelled=False), ok=False, error=reason)
        for observe in self._observers[:2]:  # router and site chooser hear every attempt (relay.observe)
            observe(failed)
        if r.ntok == 0:
            self._retry(r, now, failed)
        else:
            self._continue(r, reason, failed_at, now, failed)

    def _retry(self, r: _Req, now: float, failed: RequestOutcome) -> None:
        """Before the first token: the relay's retry elsewhere, failed instances excluded."""
        if 1 + r.retries >= ATTEMPTS_BEFORE_FIRST_BYTE:
            self._fail(r, now, failed, "retry_spent", "upstream_failed: the instance failed and the retry is spent")
            return
        inst = self._place(r, r.profile, now, self.view(), exclude=r.excluded)
        if isinstance(inst, str):
            self._fail(r, now, failed, "no_instance", f"upstream_failed: {inst}")
            return
        self.failure_stats.retries += 1
        r.retries += 1
        self._new_leg(r)
        self.admission.note_retry(r.inp.request_id)
        self._send(r, inst, now)

    def _continue(self, r: _Req, reason: ContinuationReason, failed_at: float, now: float,
                  failed: RequestOutcome) -> None:
        """After the first token: prompt + generated tokens re-prefilled elsewhere, for the
        remaining budget, if `fleetcore.continuation` allows it."""
        assert self.failures is not None
        inp, done = r.inp, r.ntok
        why = refusal(Faithfulness(), continuations_done=r.conts, generated_tokens=done,
                      prompt_tokens=inp.prompt_tokens, remaining_tokens=remaining_budget(inp.output_tokens, done),
                      limits=self.failures.limits)
        if why is not None:
            self.failure_stats.refused[why] += 1
            self._fail(r, now, failed, f"refused_{why}", f"stream ended by the failure: continuation refused ({why})")
            return
        tail = tail_block_hashes(inp.request_id, inp.block_hashes, (inp.prompt_tokens + done) // inp.block_size)
        profile = continuation_profile(r.profile, generated_tokens=done, tail_block_hashes=tail)
        inst = self._place(r, profile, now, self.view(), exclude=r.excluded)
        if isinstance(inst, str):
            self._fail(r, now, failed, "no_instance", f"stream ended by the failure: nowhere to continue ({inst})")
            return
        self.failure_stats.continued(inp.request_id, reason)
        r.conts += 1
        self._new_leg(r)
        r.leg_prompt = profile.prompt_tokens
        r.leg_hashes = profile.block_hashes
        r.leg_out = inp.output_tokens - done
        r.leg_base = done
        r.failed_at = failed_at
        old_h = r.half_rtt
        self._send(r, inst, now)
        if r.first is not None and r.half_rtt != old_h:
            # Another site: keep r.first + half_rtt the client's first-token time (TTFT, TPOT).
            r.first += old_h - r.half_rtt

    def _new_leg(self, r: _Req) -> None:
        r.legs += 1
        r.eid = f"{r.inp.request_id}/{r.legs}"  # a stalled engine may still hold the old leg

    def _resumed(self, r: _Req, cached: int, now: float) -> None:
        """A continuation's first token: the re-prefill is through."""
        st = self.failure_stats
        st.reprefill_tokens += r.leg_prompt - cached
        st.reprefill_cached_tokens += cached
        st.lost_s.append(now + r.half_rtt - r.failed_at)

    def _fail(self, r: _Req, now: float, failed: RequestOutcome, label: str, reason: str) -> None:
        """The request ends with an error (the client's stream with an error event)."""
        r.status = "failed"
        r.reason = reason
        r.end = now
        self.failure_stats.failed[label] += 1
        self.admission.observe(failed)  # the final outcome, once (the relay's release)
        self._after_release(now)


# --- capacity -------------------------------------------------------------------


def estimate_capacity(fleet: FleetConfig, requests: Sequence[TraceLike]) -> dict[str, Any]:
    """Saturation throughput of the fleet for this workload's mix, from the engine physics.

    Per request, the work on an instance is its prefill of the *uncached* prompt in
    `max_num_batched_tokens` chunks (step times from the engine's physics, attention
    over the cached context included) plus each output token's cost in a full
    decode batch: its linear layers at the prefill rate, reading its own KV, and
    its share of the step's weight read, the batch being as large as the KV cache
    holds at the mean context (capped by max_num_seqs). Two cache cases bracket
    the routing policy's effect: `ideal_cache` (infinite and shared: leading trace
    blocks seen before are free) and `no_cache`. Scheduling and preemption are
    ignored, so these are estimates, not bounds; `deploy/sim/*.yaml` records the
    measured knee next to them.

    Returns, per cache case, the offered load at the workload's own rate, the
    rate-scale that would saturate the fleet, and the rate-scales for 60/80/95%.
    """
    from fleetcore.roofline import StepTimer

    reqs = list(requests)
    if not reqs:
        return {}
    specs = fleet_instances(fleet)
    default_model = fleet.models[0].name
    seen: set[int] = set()
    hits: list[int] = []
    for r in reqs:
        k = 0
        ids = r.hash_ids or ()
        for h in ids:
            if h not in seen:
                break
            k += 1
        seen.update(ids)
        bt = getattr(r, "block_tokens", 512) or 512
        hits.append(min(k * bt, max(0, r.input_length - 1)))
    span = (max(r.timestamp_ms for r in reqs) - min(r.timestamp_ms for r in reqs)) / 1000.0
    offered = len(reqs) / span if span > 0 else float("inf")
    # One timer per distinct (model, engine) shape; instances of a shape share the work figure.
    by_shape: dict[tuple, list[InstanceSpec]] = {}
    for s in specs:
        by_shape.setdefault((s.model, s.gpu.lower(), s.tp, s.engine.max_num_batched_tokens), []).append(s)
    # Per model: requests/s its instances complete at full tilt, (ideal cache, no cache).
    pool_rate: dict[str, list[float]] = {}
    shapes_out = []
    for (model, _gpu, tp, chunk), insts in by_shape.items():
        cfg = insts[0].engine
        t = StepTimer(cfg.model, cfg.gpu, cfg.tp)
        per_tok = 1.0 / t.prefill_throughput_tokens_per_s()
        floor = t.step_time([], [0])
        mine = [(r, h) for r, h in zip(reqs, hits) if (r.model or default_model) == model]
        if not mine:
            continue
        # Decode batch at saturation: as many sequences as the KV cache holds at the mean context.
        kv_tokens = (cfg.num_gpu_blocks_override * cfg.block_size if cfg.num_gpu_blocks_override
                     else t.kv_capacity_tokens(cfg.gpu_memory_utilization))
        mean_ctx = sum(r.input_length + max(1, r.output_length) / 2 for r, _ in mine) / len(mine)
        batch = max(1.0, min(float(cfg.max_num_seqs), kv_tokens / mean_ctx))
        share_of_floor = floor / batch
        work = [0.0, 0.0]
        for r, hit in mine:
            for v, start in enumerate((hit, 0)):
                p, left = start, max(1, r.input_length - start)
                while left > 0:
                    n = min(chunk, left)
                    work[v] += t.step_time([(n, p)], [])
                    p += n
                    left -= n
            n_out = max(1, r.output_length)
            dec = n_out * (per_tok + share_of_floor + t.step_time([], [r.input_length + n_out // 2]) - floor)
            work[0] += dec
            work[1] += dec
        rates = pool_rate.setdefault(model, [0.0, 0.0])
        for v in (0, 1):
            rates[v] += len(insts) * len(mine) / work[v]
        shapes_out.append({"model": model, "gpu": insts[0].gpu, "tp": tp, "instances": len(insts),
                           "mean_work_s_ideal_cache": round(work[0] / len(mine), 4),
                           "mean_work_s_no_cache": round(work[1] / len(mine), 4),
                           "decode_batch": round(batch, 1)})
    if not pool_rate:
        return {}
    count = {m: sum(1 for r in reqs if (r.model or default_model) == m) for m in pool_rate}
    out: dict[str, Any] = {
        "method": "engine physics: chunked prefill of uncached tokens + decode in KV-limited full batches",
        "offered_rps": round(offered, 4),
    }
    for v, label in enumerate(("ideal_cache", "no_cache")):
        # The mix saturates when its busiest model pool does.
        cap = min(pool_rate[m][v] * len(reqs) / count[m] for m in pool_rate)
        full = cap / offered if offered != float("inf") else 0.0
        out[label] = {
            "capacity_rps": round(cap, 4),
            "load_at_rate_scale_1": round(offered / cap, 4),
            "saturating_rate_scale": round(full, 3),
            "rate_scale_for": {"60%": round(0.6 * full, 3), "80%": round(0.8 * full, 3),
                               "95%": round(0.95 * full, 3)},
        }
    out["shapes"] = shapes_out
    return out


def simulate(fleet: FleetConfig, router: InstanceRouter, inputs: Sequence[SimInput], **kw) -> SimResult:
    """Convenience: one fresh simulator, one run."""
    return FleetSimulator(fleet, router, **kw).run(inputs)


__all__ = [
    "Admission", "AdmissionAction", "AdmissionDecision", "AdmitAll", "FleetSimulator", "HashCache", "InstanceSpec", "SiteChooser",
    "SimInput", "SimResult", "TraceLike", "estimate_capacity", "fleet_instances", "prepare", "simulate",
    "site_rtt_s",
]
