"""FleetMind's long cycle in the live gateway: feed the placement planner, carry out its moves.

Every `cycle_s` the loop gives the pure planner (`fleetmind.planner`) what it needs:
- demand: each request that arrived, as engine work booked to its home site
  (`fleetmind.demand`); output length is not known on arrival, so the model's mean
  observed output (capped by the request's max_tokens) stands in for it;
- served load: each attempt that ended, as the work it did at the site that ran it;
- goodput normalised by demand: of the requests that ended since the last cycle, the
  share that met its class SLO, from admission's goodput ledger (rejected, cancelled and
  failed requests count as misses, so refusing work cannot look like success);
- the placement: replicas per (site, model) that serve or are starting; draining ones and
  unready ones (a crashed engine its adapter is restarting) are not counted.
It then lets the planner judge the move it is watching (a rollback is a move too) and
propose at most one new move.

A move is carried out make-before-break, through the engine adapters: a replica is
started at the destination (a simulated worker loads for its `startup_s`, a real engine
for as long as it takes), and only once it is ready does a replica at the source drain —
routing sends it nothing new, what it runs finishes — and stop when idle (or after
`drain_timeout_s`). Only adapters that launch their engines can scale (`sim` now);
a move that needs another kind is logged as not carried out. Each step is an `Action`;
the planner's plans, applies, keeps and rollbacks and these actions are served at
`GET /admin/v1/planner`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from engine_adapters.base import EngineAdapter, Instance
from fleetcore.types import RequestOutcome, RequestProfile
from fleetmind.demand import DemandModel
from fleetmind.planner import Move, Planner
from gateway.background import cancel_and_wait
from gateway.fleet_state import FleetState
from gateway.routing import forget_instances, register_instances
from tokenpilot.policy import InstanceRouter

log = logging.getLogger("tokenfleet.placement")

ActionKind = Literal["start", "ready", "drain", "stop", "failed", "skipped", "mode"]
# auto: plans are carried out; advise: logged for operators only; off: no planning at all
# (demand is still recorded, so switching back on starts from a warm history).
Mode = Literal["auto", "advise", "off"]
MODES: tuple[Mode, ...] = ("auto", "advise", "off")
# Output length assumed for a model before any of its requests has finished.
DEFAULT_OUTPUT_TOKENS = 256.0
_OUTPUT_EWMA = 0.05


@dataclass(frozen=True, slots=True)
class Action:
    at: float
    kind: ActionKind
    move: str
    site: str | None
    instance: str | None
    detail: str


class PlacementLoop:
    def __init__(self, planner: Planner, demand: DemandModel, state: FleetState, router: InstanceRouter,
                 ledger: Any, clock: Callable[[], float], *, cycle_s: float = 30.0,
                 drain_timeout_s: float = 600.0, ready_timeout_s: float = 900.0,
                 poll_s: float = 0.25, keep_actions: int = 500, mode: Mode = "auto") -> None:
        self.planner = planner
        self.demand = demand
        self.state = state
        self.router = router
        self.ledger = ledger  # slomax.ledger.GoodputLedger: cumulative `totals` per tenant x class
        self.clock = clock
        self.cycle_s = cycle_s
        self.mode: Mode = mode
        self.drain_timeout_s = drain_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.poll_s = poll_s
        self.actions: deque[Action] = deque(maxlen=keep_actions)
        self.action_counts: dict[ActionKind, int] = {}  # since start (the deque forgets)
        self._mean_output: dict[str, float] = {}
        self._last_ended: tuple[int, int] | None = None
        self._task: asyncio.Task[None] | None = None
        self._work: set[asyncio.Task[None]] = set()
        # With several replicas, only the holder of the planner lease acts (gateway.lease); None: always.
        self.may_act: Callable[[], bool] | None = None

    # -- what the relay tells it ----------------------------------------------------
    def arrived(self, profile: RequestProfile) -> None:
        out = self._mean_output.get(profile.model, DEFAULT_OUTPUT_TOKENS)
        if profile.max_tokens is not None:
            out = min(out, profile.max_tokens)
        self.planner.record_demand(self.demand.home(profile.client_region, profile.model), profile.model,
                                   self.demand.work_s(profile.model, profile.prompt_tokens, round(out)))

    def observe(self, outcome: RequestOutcome) -> None:
        """A request ended at a site: the work it did there is that site's served load."""
        st = self.state.get(outcome.instance_id)
        if st is None:
            return
        model = st.instance.model
        self.planner.record_served(outcome.site, model,
                                   self.demand.work_s(model, outcome.prompt_tokens, outcome.output_tokens))
        if outcome.ok:
            mean = self._mean_output.get(model, DEFAULT_OUTPUT_TOKENS)
            self._mean_output[model] = mean + _OUTPUT_EWMA * (outcome.output_tokens - mean)

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="placement-planner")

    async def stop(self) -> None:
        await cancel_and_wait([self._task, *self._work])
        self._task = None
        self._work.clear()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.cycle_s)
            if self.may_act is not None and not self.may_act():
                continue  # another replica holds the lease: it plans; this one only records demand
            try:
                await self.cycle()
            except Exception:  # a planner bug must not stop the gateway, nor the next cycle
                log.exception("placement cycle failed")

    async def settle(self) -> None:
        """Wait for the moves under way (tests, shutdown of a benchmark)."""
        while self._work:
            await asyncio.gather(*list(self._work), return_exceptions=True)

    # -- one cycle ------------------------------------------------------------------
    async def cycle(self) -> None:
        now = self.clock()
        self.planner.record_goodput(self._attainment(), now)
        if self.mode == "off":
            return
        undo = self.planner.check(now)
        if undo is not None:
            await self.carry_out(undo)
        move = self.planner.plan(self.state.placement(), self.clock())
        if move is None:
            return
        if self.mode == "advise":
            self.planner.advised(move, self.clock(), "advise mode: not carried out")
        elif await self.carry_out(move):
            self.planner.applied(move, self.clock())
        else:
            self.planner.advised(move, self.clock(), "could not be carried out (see actions)")

    def set_mode(self, mode: Mode, actor: str) -> None:
        if mode != self.mode:
            self._act("mode", "", None, None, f"{self.mode} -> {mode} by {actor}")
            self.mode = mode

    def _attainment(self) -> float:
        """Met / ended over the requests that ended since the last cycle (1.0 when none did)."""
        ended = met = 0
        for cell in self.ledger.totals.values():
            ended += cell.completed + cell.rejected + cell.cancelled + cell.failed
            met += cell.met_slo
        last, self._last_ended = self._last_ended, (ended, met)
        if last is None or ended == last[0]:
            return 1.0
        return (met - last[1]) / (ended - last[0])

    async def carry_out(self, move: Move) -> bool:
        """Start what the move adds (returns once started); retire what it removes in the background."""
        what = move.describe()
        target = self._adapter(move.to_site, move.model) if move.to_site is not None else None
        if move.to_site is not None and target is None:
            self._act("skipped", what, move.to_site, None,
                      f"no deployment of {move.model} in {move.to_site} whose adapter can add instances")
            return False
        started = 0
        for _ in range(move.count):
            if target is None:  # remove only
                if not self._retire(move, what, after=None):
                    break
                started += 1
                continue
            try:
                inst = await target.add_instance()
            except Exception as e:
                self._act("failed", what, move.to_site, None, f"could not start a replica: {e}")
                break
            register_instances(self.router, [inst])
            self.state.sync_instances()
            self._act("start", what, inst.site, inst.instance_id, f"started at {inst.url}; loading")
            self._spawn(self._bring_up(move, what, target, inst))
            started += 1
        return started > 0

    # -- the steps ------------------------------------------------------------------
    async def _bring_up(self, move: Move, what: str, adapter: EngineAdapter, inst: Instance) -> None:
        t0 = self.clock()
        while self.clock() - t0 < self.ready_timeout_s:
            st = self.state.get(inst.instance_id)
            if st is not None and st.up:
                self._act("ready", what, inst.site, inst.instance_id, f"ready after {self.clock() - t0:.1f} s")
                if move.from_site is not None:
                    self._retire(move, what, after=inst.instance_id)
                return
            await asyncio.sleep(self.poll_s)
        self._act("failed", what, inst.site, inst.instance_id,
                  f"not ready after {self.ready_timeout_s:.0f} s; stopped, the source keeps its replica")
        self.state.drain(inst.instance_id)
        await self._remove(adapter, inst, what)

    def _retire(self, move: Move, what: str, after: str | None) -> bool:
        """Drain one replica of the move's model at its source; False when there is none to drain."""
        assert move.from_site is not None
        victims = [st for st in self.state.states()
                   if st.instance.site == move.from_site and st.instance.model == move.model and not st.draining]
        if not victims:
            self._act("skipped", what, move.from_site, None, f"no replica of {move.model} left to drain")
            return False
        # Prefer one that is not serving (still loading: a rollback of a fresh move), then the least busy.
        st = min(victims, key=lambda s: (s.up, s.inflight, s.instance.instance_id))
        self.state.drain(st.instance.instance_id)
        because = f" (replaced by {after})" if after else ""
        self._act("drain", what, st.instance.site, st.instance.instance_id,
                  f"draining with {st.inflight} in flight{because}")
        self._spawn(self._drain_and_stop(st.adapter, st.instance, what))
        return True

    async def _drain_and_stop(self, adapter: EngineAdapter, inst: Instance, what: str) -> None:
        t0 = self.clock()
        while not self.state.idle(inst.instance_id) and self.clock() - t0 < self.drain_timeout_s:
            await asyncio.sleep(self.poll_s)
        busy = not self.state.idle(inst.instance_id)
        await self._remove(adapter, inst, what, f"drained in {self.clock() - t0:.1f} s"
                           + (" (timed out with requests in flight)" if busy else ""))

    async def _remove(self, adapter: EngineAdapter, inst: Instance, what: str, detail: str = "stopped") -> None:
        try:
            await adapter.remove_instance(inst)
        except Exception as e:
            self._act("failed", what, inst.site, inst.instance_id, f"could not stop: {e}")
            return
        self.state.sync_instances()
        forget_instances(self.router, [inst.instance_id])
        self._act("stop", what, inst.site, inst.instance_id, detail)

    # -- helpers ------------------------------------------------------------------
    def _adapter(self, site: str, model: str) -> EngineAdapter | None:
        for a in self.state.adapters:
            if a.scalable and getattr(a, "site", None) == site and getattr(a, "model", None) == model:
                return a
        return None

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._work.add(task)
        task.add_done_callback(self._work.discard)

    def _act(self, kind: ActionKind, move: str, site: str | None, instance: str | None, detail: str) -> None:
        a = Action(self.clock(), kind, move, site, instance, detail)
        self.actions.append(a)
        self.action_counts[kind] = self.action_counts.get(kind, 0) + 1
        (log.warning if kind in ("failed", "skipped") else log.info)("placement %s %s %s: %s", kind, move,
                                                                    instance or site or "", detail)

    # -- what the admin API shows ------------------------------------------------------
    def report(self, limit: int = 200) -> dict[str, Any]:
        placement = self.state.placement()
        return {
            "enabled": True,
            "mode": self.mode,
            "cycle_s": self.cycle_s,
            "placement": [{"site": s, "model": m, "replicas": n} for (s, m), n in sorted(placement.items())],
            "entries": [{"at": e.at, "kind": e.kind, "move": e.move.describe() if e.move else None,
                         "reason": e.reason} for e in self.planner.log[-limit:]],
            "actions": [asdict(a) for a in list(self.actions)[-limit:]],
        }

