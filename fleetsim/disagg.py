"""Prefill/decode disaggregation in a simulation: the P -> KV transfer -> D flow, and role flips.

`tokenfleet simulate --disagg MODE`:

* `off`: every instance mixed, roles ignored: the simulator as before (no `PDRuntime`).
* `static`: the fleet file's roles; TokenPilot decides per request (`tokenpilot.disagg`).
* `elastic`: `static`, plus FleetMind's P/D role controller (`fleetmind.pd_roles`) run every
  `PDRolesConfig.cycle_s` (None: `planner.cycle_s`) on the simulator's controller tick (the
  loop the placement planner runs on), and at the first arrival (its start: by default the
  colocated fleet). An instance that leaves the prefill role hands the
  split requests queued there, unstarted, to their decode instance, which prefills them
  itself (`PDRuntime._replace_queued`; the router's booking of that prefill moves with it,
  `TokenPilot.prefill_withdrawn`).
* `dynamo_conditional`, `llm_d_decider`: the fleet file's roles, the published rules
  (`tokenpilot.disagg_baselines`).

A split request: dispatched to the prefill instance (rtt/2 on the wire), prefilled there in
prefill-only mode; when its first token is made, the decode instance reserves the prompt's
blocks (waiting for room when it has none), the KV of the prompt less the prefix the decode
instance already caches crosses the sender's link (`fleetcore.interconnect`: FIFO per
sending instance, latency + bytes / bandwidth), both ends holding the blocks meanwhile; when
it has arrived the prefill instance frees its copy, the first token goes out from the decode
instance and it decodes the rest. Its TTFT therefore includes the transfer. The gateway counts
it in flight on both instances while it prefills, on the decode instance after.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine_adapters.sim.engine import RequestEvent, SimRequest, StepResult
from fleetcore.fleet_config import FleetConfig
from fleetcore.interconnect import LinkQueue, kv_bytes, link_between
from fleetcore.slo import ClassSLO
from fleetcore.types import FleetView, Role
from fleetmind.pd_roles import PDRoleController, PDRolesConfig, RoleInstance, SLOWindow
from tokenpilot.disagg import DisaggConfig, DisaggPolicy, SplitDemand, TokenPilotDisagg
from tokenpilot.disagg_baselines import DynamoConditional, LlmDDecider
from tokenpilot.router import TokenPilot

if TYPE_CHECKING:
    from .simulator import FleetSimulator, _Inst, _Req

DISAGG_MODES: tuple[str, ...] = ("off", "static", "elastic", "dynamo_conditional", "llm_d_decider")
# A decode instance with no room for a transfer's blocks is asked again this often (the
# transfers waiting for it queue FIFO behind the first).
RECEIVE_RETRY_S = 0.02


def pd_fleet(fleet: FleetConfig, mode: str) -> FleetConfig:
    """The fleet a `--disagg` mode runs: for every mode but `off` (which ignores roles), each model's
    engines take its `pd_max_num_batched_tokens` as their token budget, where one is set (engines
    and the router's priors both read the fleet, so they agree). `off`: the fleet as it is."""
    if mode == "off" or all(m.engine.pd_max_num_batched_tokens is None for m in fleet.models):
        return fleet
    models = [m if m.engine.pd_max_num_batched_tokens is None else
              m.model_copy(update={"engine": m.engine.model_copy(
                  update={"max_num_batched_tokens": m.engine.pd_max_num_batched_tokens})})
              for m in fleet.models]
    return fleet.model_copy(update={"models": models})


def make_disagg_policy(mode: str, router: object, config: DisaggConfig | None = None) -> DisaggPolicy | None:
    """The per-request P/D policy of a `--disagg` mode (None for `off`); `config` tunes TokenPilot's
    (`static`, `elastic`) and the baselines' shared placer (default: `DisaggConfig()`)."""
    if mode == "off":
        return None
    if mode not in DISAGG_MODES:
        raise ValueError(f"unknown disagg mode {mode!r} (known: {', '.join(DISAGG_MODES)})")
    if not isinstance(router, TokenPilot):
        raise ValueError(f"--disagg {mode} prices options with TokenPilot's cost model: use --policy tokenpilot")
    if mode in ("static", "elastic"):
        return TokenPilotDisagg(router, config)
    if mode == "dynamo_conditional":
        return DynamoConditional(router, config=config)
    return LlmDDecider(router, config=config)


class SimLinks:
    """The fleet's KV links in virtual time: one FIFO per sending instance and destination site."""

    def __init__(self, fleet: FleetConfig, sim: FleetSimulator) -> None:
        self._fleet = fleet
        self._sim = sim
        self._queues: dict[tuple[str, str], LinkQueue] = {}

    def _queue(self, src: str, dst: str) -> LinkQueue:
        a, b = self._sim.instance(src), self._sim.instance(dst)
        key = (src, b.site)
        q = self._queues.get(key)
        if q is None:
            q = self._queues[key] = LinkQueue(link_between(self._fleet, a.site, b.site))
        return q

    def _bytes(self, dst: str, tokens: int) -> int:
        return kv_bytes(self._sim.instance(dst).spec.engine.model, tokens)

    def predict_s(self, src: str, dst: str, tokens: int, now: float) -> float:
        q = self._queue(src, dst)
        return q.wait_s(now) + q.link.transfer_s(self._bytes(dst, tokens))

    def reserve(self, src: str, dst: str, tokens: int, now: float) -> float:
        """Book a transfer; returns when its last byte arrives."""
        return self._queue(src, dst).reserve(now, self._bytes(dst, tokens))[1]


@dataclass(slots=True)
class _Leg:
    r: _Req
    pre: _Inst
    dec: _Inst
    stage: str = "prefill"  # prefill | room (waiting for decode KV) | transfer
    reach_s: float = 0.0
    waited: bool = False


@dataclass
class PDStats:
    splits: int = 0
    local: int = 0
    transfer_ms: list[float] = field(default_factory=list)
    receive_waits: int = 0  # split requests whose decode instance had no room at first
    replaced: int = 0  # split requests whose prefill leg had not started when its instance left prefill
    waited_ended: int = 0  # ... since the role controller last read (and reset) it


class PDRuntime:
    """The simulator's P/D half (`FleetSimulator(pd=...)`): it places every request with the
    P/D policy, runs split requests' prefill legs and KV transfers, and flips roles."""

    def __init__(self, sim: FleetSimulator, policy: DisaggPolicy) -> None:
        self.sim = sim
        self.policy = policy
        self.links = SimLinks(sim.fleet, sim)
        self.legs: dict[str, _Leg] = {}
        self._room: dict[str, deque[_Leg]] = {}  # decode instance -> transfers waiting for its KV
        self.stats = PDStats()
        self._role_since: dict[str, tuple[Role, float, float]] = {}  # iid -> (role, since, busy then)
        self.role_time: dict[Role, list[float]] = {}  # role -> [instance-seconds, busy seconds]

    # -- placing -----------------------------------------------------------------------
    def dispatch(self, r: _Req, now: float, view: FleetView, avoid: Collection[str]) -> None:
        sim, profile = self.sim, r.profile
        site = sim.site_chooser.choose(profile, view, now, exclude_instances=tuple(avoid))
        if site.site is None and avoid:
            site = sim.site_chooser.choose(profile, view, now)
        if site.site is None:
            sim._undispatchable(r, now, site.reason)
            return
        pool = view.site(site.site).pool(profile.model, profile.model_version)
        pool = tuple(i for i in pool if i.instance_id not in avoid) or pool
        d = self.policy.decide(profile, pool, self.links, now)
        if d.decode is None:
            sim._undispatchable(r, now, d.reason)
            return
        dec = sim.instance(d.decode)
        need = r.inp.prompt_tokens + r.inp.output_tokens
        if not d.split:
            if need > dec.max_model_len:
                sim._undispatchable(r, now, f"context_length_exceeded on {dec.iid}")
                return
            self.stats.local += 1
            sim._send(r, dec, now)
            return
        assert d.prefill is not None
        pre = sim.instance(d.prefill)
        if need > min(dec.max_model_len, pre.max_model_len):
            sim._undispatchable(r, now, f"context_length_exceeded on {pre.iid} -> {dec.iid}")
            return
        self.stats.splits += 1
        sim._start(r, dec, now)
        pre.inflight += 1
        leg = _Leg(r, pre, dec)
        self.legs[r.inp.request_id] = leg
        sim.schedule(now + r.half_rtt, lambda t: self._reach_prefill(leg, t))

    def _reach_prefill(self, leg: _Leg, now: float) -> None:
        if self.legs.get(leg.r.inp.request_id) is not leg:
            return  # cancelled on the way
        inp = leg.r.inp
        leg.reach_s = now
        leg.pre.engine.add_request(SimRequest(inp.request_id, inp.prompt_tokens, inp.block_hashes,
                                              inp.output_tokens, now, mode="prefill"))
        self.sim.kick(leg.pre, now)

    # -- the prefill leg's events, the transfer ------------------------------------------
    def on_prefill_event(self, ev: RequestEvent, res: StepResult, now: float) -> None:
        leg = self.legs.get(ev.request_id)
        if leg is None or leg.stage != "prefill":
            return  # an aborted request's event
        if ev.preempted:
            self.sim.preemptions += 1
            return
        if ev.first_token:
            leg.r.cached = ev.cached_tokens
            leg.r.engine_wait = res.start - leg.reach_s
        if ev.finished:
            self._start_transfer(leg, now)

    def _start_transfer(self, leg: _Leg, now: float) -> None:
        q = self._room.get(leg.dec.iid)
        if q:  # others wait for room there already: behind them
            q.append(leg)
            self._waited(leg)
            return
        if not self._try_send(leg, now):
            self._room[leg.dec.iid] = deque([leg])
            self._waited(leg)
            self.sim.schedule(now + RECEIVE_RETRY_S, lambda t: self._retry(leg.dec.iid, t))

    def _waited(self, leg: _Leg) -> None:
        leg.stage = "room"
        if not leg.waited:
            leg.waited = True
            self.stats.receive_waits += 1
            self.stats.waited_ended += 1

    def _retry(self, dec_iid: str, now: float) -> None:
        q = self._room[dec_iid]
        while q and self._try_send(q[0], now):
            q.popleft()
        if q:
            self.sim.schedule(now + RECEIVE_RETRY_S, lambda t: self._retry(dec_iid, t))
        else:
            del self._room[dec_iid]

    def _try_send(self, leg: _Leg, now: float) -> bool:
        """Reserve the decode side's blocks and start the transfer; False when it has no room.
        A leg cancelled meanwhile lets its prefill side go (and counts as sent)."""
        inp = leg.r.inp
        if self.legs.get(inp.request_id) is not leg:
            self._release_prefill(leg, now)
            return True
        here = leg.dec.engine.receive(SimRequest(inp.request_id, inp.prompt_tokens, inp.block_hashes,
                                                 inp.output_tokens, now))
        if here is None:
            return False
        leg.stage = "transfer"
        end = self.links.reserve(leg.pre.iid, leg.dec.iid, inp.prompt_tokens - here, now)
        self.stats.transfer_ms.append(1000.0 * (end - now))
        self.sim.schedule(end, lambda t: self._kv_arrived(leg, t))
        return True

    def _kv_arrived(self, leg: _Leg, now: float) -> None:
        self._release_prefill(leg, now)
        rid = leg.r.inp.request_id
        if self.legs.pop(rid, None) is not leg or leg.r.status != "running":
            leg.dec.engine.abort(rid)
            if leg.dec.engine.has_work():
                self.sim.kick(leg.dec, now)
            return
        leg.dec.engine.kv_arrived(rid)
        self.sim.kv_arrived(leg.r, leg.dec, now)

    def _release_prefill(self, leg: _Leg, now: float) -> None:
        if leg.pre.engine.release_kv(leg.r.inp.request_id):
            leg.pre.inflight -= 1
            # Its blocks are free: a prefill waiting for KV there can start (the engine may
            # have gone idle with work it could not schedule).
            if leg.pre.engine.has_work():
                self.sim.kick(leg.pre, now)

    def on_cancel(self, r: _Req, now: float) -> None:
        leg = self.legs.get(r.inp.request_id)
        if leg is None or leg.stage != "prefill":
            # waiting for room or in transfer: `_try_send` / `_kv_arrived` let both ends go
            if leg is not None:
                del self.legs[r.inp.request_id]
            return
        del self.legs[r.inp.request_id]
        leg.pre.inflight -= 1
        self.sim.schedule(now + r.half_rtt, lambda t: leg.pre.engine.abort(r.inp.request_id))

    # -- roles -------------------------------------------------------------------------
    def set_role(self, iid: str, role: Role, now: float) -> None:
        inst = self.sim.instance(iid)
        self._close_role(inst, now)
        was = inst.role
        inst.role = role
        inst.draining = False
        self._role_since[iid] = (role, now, inst.busy_s)
        if was == "prefill" and role != "prefill":
            self._replace_queued(inst, now)

    def _replace_queued(self, inst: _Inst, now: float) -> None:
        """An instance left the prefill role: the split requests still queued there with nothing
        prefilled (the gateway can withdraw such a leg at no loss) run whole on their decode
        instance instead, which prefills them locally; otherwise a shrunk prefill pool's queues
        outlive the move (Mooncake: 44 prefill legs drained one by one on three instances for
        230 s after the trace had ended, bench/DISAGG.md). Legs already prefilling stay."""
        sim = self.sim
        for rid, leg in list(self.legs.items()):
            if leg.pre is not inst or leg.stage != "prefill" or not inst.engine.is_queued(rid):
                continue
            inst.engine.abort(rid)
            del self.legs[rid]
            inst.inflight -= 1
            self.stats.replaced += 1
            self.policy.prefill_withdrawn(leg.r.profile, sim.snapshot(leg.dec), now)
            sim.reach_local(leg.r, now)

    def _close_role(self, inst: _Inst, now: float) -> None:
        role, since, busy = self._role_since.get(inst.iid, (inst.role, 0.0, 0.0))
        acc = self.role_time.setdefault(role, [0.0, 0.0])
        acc[0] += max(0.0, now - since)
        acc[1] += inst.busy_s - busy

    def utilisation(self, end: float) -> dict[str, float]:
        """Per role: engine busy time / instance time in that role, from 0 to `end`."""
        for inst in self.sim.instances():
            self._close_role(inst, end)
            self._role_since[inst.iid] = (inst.role, end, inst.busy_s)
        return {role: round(busy / t, 4) if t > 0 else 0.0 for role, (t, busy) in sorted(self.role_time.items())}


def idle(inst: _Inst) -> bool:
    e = inst.engine
    return inst.inflight == 0 and not e.has_work() and e.num_held == 0


@dataclass
class PDRolesLoop:
    """FleetMind's P/D role controller on the simulator's controller tick: each cycle it is fed
    the SLO misses of the requests that ended since the previous one and the instances' state,
    and its commands are carried out (drain: no new work; set_role: the new role, taking work)."""

    core: PDRoleController
    slos: dict[str, ClassSLO]
    _seen: int = 0
    _open: list[Any] = field(default_factory=list)

    @property
    def at_start(self) -> bool:
        """Run at the first arrival too (the simulator's tick): the controller's starting fleet
        (`PDRolesConfig.start_colocated`) is in place before the first request is placed."""
        return self.core.config.start_colocated

    def __call__(self, sim: FleetSimulator, now: float) -> None:
        pd = sim.pd
        assert isinstance(pd, PDRuntime)
        window = self._window(sim)
        insts = [RoleInstance(i.iid, i.role, i.draining, idle(i), i.inflight, i.engine.kv.usage())
                 for i in sim.instances() if i.role != "mixed" and i.ready]
        for c in self.core.cycle(now, insts, window):
            if c.kind == "drain":
                sim.drain(c.instance_id)
            else:
                assert c.role is not None
                pd.set_role(c.instance_id, c.role, now)

    def _window(self, sim: FleetSimulator) -> SLOWindow:
        pd = sim.pd
        assert isinstance(pd, PDRuntime)
        reqs = sim.requests
        self._open.extend(reqs[self._seen:])
        self._seen = len(reqs)
        ended = met = ttft_missed = tpot_missed = 0
        still = []
        for r in self._open:
            if r.end is None:
                still.append(r)
                continue
            ended += 1
            slo = self.slos.get(r.inp.request_class)
            ttft = r.first + r.half_rtt - r.inp.arrival_s if r.first is not None else None
            tpot = (r.last - r.first) / (r.ntok - 1) if r.first is not None and r.last is not None \
                and r.ntok > 1 else None
            if r.status != "completed":
                ttft_missed += ttft is None
            elif slo is None or slo.met(ttft, tpot, r.end - r.inp.arrival_s):
                met += 1
            else:
                if slo.ttft_s is not None and (ttft is None or ttft > slo.ttft_s):
                    ttft_missed += 1
                if slo.tpot_s is not None and tpot is not None and tpot > slo.tpot_s:
                    tpot_missed += 1
        self._open = still
        blocked, pd.stats.waited_ended = pd.stats.waited_ended, 0
        take = getattr(pd.policy, "take_demand", None)  # (a policy without split demand: none)
        dm = take() if take is not None else SplitDemand()
        return SLOWindow(ended, met, ttft_missed, tpot_missed, blocked, dm.placed, dm.starved,
                         dm.starved_prefill_s, dm.split_prefill_s)


def pd_controllers(mode: str, fleet: FleetConfig, config: PDRolesConfig | None = None) -> list[tuple[float, Any]]:
    """The role controller of `elastic` (none for the other modes), every `PDRolesConfig.cycle_s`
    (the fleet's `planner.cycle_s` where that is None)."""
    if mode != "elastic":
        return []
    cfg = config or PDRolesConfig()
    return [(cfg.cycle_s or fleet.planner.cycle_s, PDRolesLoop(PDRoleController(cfg), dict(fleet.admission.slos())))]


def pd_row(pd: PDRuntime | None, controllers: Sequence[tuple[float, Any]], end_s: float) -> dict[str, Any]:
    """A result row's P/D fields: split share, KV transfer percentiles, per-role utilisation, flips."""
    if pd is None:
        return {}
    xs = sorted(pd.stats.transfer_ms)

    def pct(q: float) -> float | None:
        return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None

    n = pd.stats.splits + pd.stats.local
    row: dict[str, Any] = {
        "split_share": round(pd.stats.splits / n, 4) if n else 0.0,
        "kv_transfer_ms": {"count": len(xs), "p50": pct(0.5), "p95": pct(0.95), "p99": pct(0.99)},
        "role_utilisation": pd.utilisation(end_s),
        "kv_receive_waits": pd.stats.receive_waits,
        "replaced_prefill_legs": pd.stats.replaced,
    }
    loops = [fn for _, fn in controllers if isinstance(fn, PDRolesLoop)]
    if loops:
        row["role_flips"] = [{"at": round(e.at, 3), "kind": e.kind, "instance": e.instance_id,
                              "role": e.to_role, "reason": e.reason} for e in loops[0].core.log]
    return row
