"""FleetMind's long cycle in the live gateway: the async executor of `fleetmind.placement_cycle`.

The decisions (what demand to book, how goodput is judged, which move, when a new replica
counts as ready, which replica drains, when it stops) are made by the pure
`PlacementCycle`, which the simulator (`fleetsim.planning`) runs too. This module only
feeds it and carries out its commands, in wall-clock time, through the engine adapters:
- demand: the relay's `arrived(profile)` for every request; served load and learnt
  output lengths: `observe(outcome)` for every attempt that ended;
- verdicts: `released(profile, outcome, met)` (the admission gate's `on_released`) for every
  admitted request that ran at a site;
- goodput: every `cycle_s`, the goodput ledger's cumulative ended / met-SLO counts
  (rejected, cancelled and failed requests count as ended and not met);
- replicas: the fleet state's instances (health-checked readiness, draining, in flight).
Commands: `start` asks the deployment's adapter for one more instance (only adapters that
launch their engines can scale: `sim` now; a move that needs another kind is logged as
skipped), `drain` stops routing to an instance, `stop` removes it through its adapter.
Between cycles the executor advances the steps under way whenever a draining instance
finishes a request, and at least every `poll_s` while one is loading (readiness comes from
the health checks). With several replicas every start, drain and stop first passes the
planner lease's fence (`fence`, gateway.lease `LeaderLease.fenced`: the token compared and
the move recorded in one Redis script); a refused step is logged as failed and not done.
Plans, applies, keeps and rollbacks and every step are served at
`GET /admin/v1/planner`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

from engine_adapters.base import EngineAdapter
from fleetcore.types import RequestOutcome, RequestProfile
from fleetmind.placement_cycle import MODES, Action, Command, Mode, PlacementCycle, Replica
from fleetmind.planner import Move
from gateway.background import cancel_and_wait
from gateway.fleet_state import FleetState
from gateway.routing import forget_instances, register_instances
from fleetcore.policies import InstanceRouter

__all__ = ["MODES", "Mode", "PlacementLoop"]

log = logging.getLogger("tokenfleet.placement")
REFUSED = "refused by the planner lease's fencing token (another replica leads now)"


class PlacementLoop:
    def __init__(self, core: PlacementCycle, state: FleetState, router: InstanceRouter, ledger: Any,
                 clock: Callable[[], float], *, poll_s: float = 0.25) -> None:
        self.core = core
        self.state = state
        self.router = router
        self.ledger = ledger  # slomax.ledger.GoodputLedger: cumulative `totals` per tenant x class
        self.clock = clock
        self.poll_s = poll_s
        self._nudge = asyncio.Event()  # something a step under way waits for may have happened
        self._logged = 0
        self._task: asyncio.Task[None] | None = None
        self._work: set[asyncio.Task[None]] = set()
        # With several replicas, only the holder of the planner lease acts (gateway.lease); None: always.
        self.may_act: Callable[[], bool] | None = None
        # ... and each step it carries out must pass the lease's fence (kind, target, detail) -> allowed.
        self.fence: Callable[[str, str, str], Awaitable[bool]] | None = None
        self.refused = 0  # steps the fence refused
        self.on_removed: list[Callable[[str], None]] = []  # an instance stopped for good (its metrics go)

    @property
    def mode(self) -> Mode:
        return self.core.mode

    @property
    def actions(self) -> list[Action]:
        return list(self.core.actions)

    # -- what the relay tells it ----------------------------------------------------
    def arrived(self, profile: RequestProfile) -> None:
        self.core.arrived(profile)

    def observe(self, outcome: RequestOutcome) -> None:
        st = self.state.get(outcome.instance_id)
        if st is None:
            return
        self.core.ended(outcome.site, st.instance.model, outcome.prompt_tokens, outcome.output_tokens, outcome.ok)
        if st.draining:
            self._nudge.set()  # it may be idle now: time to stop it

    def released(self, profile: RequestProfile, outcome: RequestOutcome, met: bool) -> None:
        """An admitted request ended (`AdmissionGate.on_released`): the ledger's verdict at its site."""
        if outcome.site:
            self.core.judged(outcome.site, profile.model, met, self.clock())

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="placement-planner")

    async def stop(self) -> None:
        await cancel_and_wait([self._task, *self._work])
        self._task = None
        self._work.clear()

    async def _run(self) -> None:
        next_cycle = self.clock() + self.core.settings.cycle_s
        while True:
            wake = next_cycle
            if self.core.busy:  # readiness comes from health checks, not events: look again soon
                wake = min(wake, self.clock() + self.poll_s, self.core.next_due() or wake)
            await self._wait(wake - self.clock())
            if self.clock() >= next_cycle and self.may_act is not None and not self.may_act():
                next_cycle = self.clock() + self.core.settings.cycle_s
                continue  # another replica holds the lease: it plans; this one only records demand
            try:
                if self.clock() >= next_cycle:
                    next_cycle = self.clock() + self.core.settings.cycle_s
                    await self.cycle()
                else:
                    await self.advance()
            except Exception:  # a planner bug must not stop the gateway, nor the next cycle
                log.exception("placement cycle failed")

    async def _wait(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._nudge.wait(), max(0.0, timeout_s))
        except asyncio.TimeoutError:
            pass
        self._nudge.clear()

    async def settle(self, timeout_s: float | None = None) -> None:
        """Wait for the steps under way to finish (tests, shutdown of a benchmark)."""
        s = self.core.settings
        deadline = self.clock() + (timeout_s if timeout_s is not None else s.ready_timeout_s + s.drain_timeout_s)
        while self.core.busy or self._work:
            if self.clock() > deadline:
                raise TimeoutError(f"placement steps still under way after {deadline:.0f}")
            if self._task is None:  # nobody else drives the steps
                await self.advance()
            if self._work:
                await asyncio.wait(list(self._work), timeout=self.poll_s)
            else:
                await self._wait(self.poll_s)

    # -- one cycle ------------------------------------------------------------------
    async def cycle(self) -> None:
        self.core.goodput_from(self.ledger.totals.values())
        await self._execute(self.core.cycle(self.clock(), self.state.placement(), self._replicas()))

    async def advance(self) -> None:
        await self._execute(self.core.advance(self.clock(), self._replicas()))

    async def carry_out(self, move: Move) -> bool:
        """Carry out `move` now (not watched by the planner); True when a replica started or drained
        (and the fence refused none of its steps)."""
        before, refused = dict(self.core.action_counts), self.refused
        await self._execute(self.core.carry_out(move, self.clock(), self._replicas()))
        after = dict(self.core.action_counts)
        return self.refused == refused and any(after.get(k, 0) > before.get(k, 0) for k in ("start", "drain"))

    def set_mode(self, mode: Mode, actor: str) -> None:
        self.core.set_mode(mode, actor, self.clock())
        self._log_new()

    def _replicas(self) -> list[Replica]:
        return [Replica(st.instance.instance_id, st.instance.site, st.instance.model, st.up, st.draining,
                        self.state.idle(st.instance.instance_id), st.inflight) for st in self.state.states()]

    # -- carrying out commands -----------------------------------------------------
    async def _execute(self, commands: list[Command]) -> None:
        todo = list(commands)
        while todo:
            cmd = todo.pop(0)
            if cmd.kind == "start":
                todo += await self._start(cmd)
            elif cmd.kind == "drain":
                assert cmd.instance_id is not None
                if await self._fenced("drain", cmd.instance_id):
                    self.state.drain(cmd.instance_id)
                else:  # it keeps serving; the move's stop is dropped with it
                    self.core.stop_failed(cmd.instance_id, self.clock(), REFUSED)
            else:
                self._spawn(self._stop(cmd))
        self._log_new()

    async def _start(self, cmd: Command) -> list[Command]:
        adapter = self._adapter(cmd.site, cmd.model)
        if adapter is None:
            return self.core.start_failed(cmd.step, self.clock(), f"no deployment of {cmd.model} in {cmd.site} "
                                                                  "whose adapter can add instances", skipped=True)
        if not await self._fenced("start", f"{cmd.site}/{cmd.model}"):
            return self.core.start_failed(cmd.step, self.clock(), REFUSED)
        try:
            inst = await adapter.add_instance()
        except Exception as e:
            return self.core.start_failed(cmd.step, self.clock(), f"could not start a replica: {e}")
        register_instances(self.router, [inst])
        self.state.sync_instances()
        return self.core.started(cmd.step, inst.instance_id, self.clock(), f"started at {inst.url}; loading")

    async def _stop(self, cmd: Command) -> None:
        assert cmd.instance_id is not None
        st = self.state.get(cmd.instance_id)
        if st is None:  # already gone (its adapter stopped it)
            self.core.stopped(cmd.instance_id, self.clock())
        elif not await self._fenced("stop", cmd.instance_id):
            # Drained while this replica led; the leader now decides its fate. Until then it serves
            # here again rather than sit drained and unstopped (nothing was done to its engine).
            st.draining = False
            self.core.stop_failed(cmd.instance_id, self.clock(), REFUSED)
        else:
            self.state.drain(cmd.instance_id)
            try:
                await st.adapter.remove_instance(st.instance)
            except Exception as e:
                self.core.stop_failed(cmd.instance_id, self.clock(), str(e))
            else:
                self.state.sync_instances()
                forget_instances(self.router, [cmd.instance_id])
                for hook in self.on_removed:
                    try:
                        hook(cmd.instance_id)
                    except Exception:  # a listener's bug must not leave the step unrecorded
                        log.exception("on_removed listener failed for %s", cmd.instance_id)
                self.core.stopped(cmd.instance_id, self.clock())
        self._log_new()

    # -- helpers ------------------------------------------------------------------
    async def _fenced(self, kind: str, target: str) -> bool:
        if self.fence is None or await self.fence(kind, target, f"mode {self.mode}"):
            return True
        self.refused += 1
        return False

    def _adapter(self, site: str, model: str) -> EngineAdapter | None:
        for a in self.state.adapters:
            if a.scalable and getattr(a, "site", None) == site and getattr(a, "model", None) == model:
                return a
        return None

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._work.add(task)
        task.add_done_callback(self._work.discard)

    def _log_new(self) -> None:
        """Log the steps the cycle recorded since the last call (the cycle itself does no I/O)."""
        total = sum(self.core.action_counts.values())
        new, self._logged = total - self._logged, total
        for a in list(self.core.actions)[-new:] if new > 0 else ():
            (log.warning if a.kind in ("failed", "skipped") else log.info)(
                "placement %s %s %s: %s", a.kind, a.move, a.instance or a.site or "", a.detail)

    # -- what the admin API shows ------------------------------------------------------
    def report(self, limit: int = 200) -> dict[str, Any]:
        placement = self.state.placement()
        return {
            "enabled": True,
            "mode": self.mode,
            "cycle_s": self.core.settings.cycle_s,
            "placement": [{"site": s, "model": m, "replicas": n} for (s, m), n in sorted(placement.items())],
            "entries": [{"at": e.at, "kind": e.kind, "move": e.move.describe() if e.move else None,
                         "reason": e.reason} for e in self.core.planner.log[-limit:]],
            "actions": [asdict(a) for a in self.actions[-limit:]],
        }
