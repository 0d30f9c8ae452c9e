"""Run FleetMind's placement cycle inside a simulation: the virtual-time executor of
`fleetmind.placement_cycle` (`gateway.placement` is the wall-clock one; both run the same
cycle, so demand booking, goodput judgment, timings and make-before-break are the same).

Every `cycle_s` the loop feeds the cycle what the gateway would know by then: each request
that arrived (its profile: demand booked with what is known at arrival), each dispatched
request that ended (served load at its site, output length learnt, and admission's verdict
on it), and the admission ledger's ended / met-SLO counts; then it carries out the commands. `start` adds a replica
that becomes ready `startup_s` later (the deployment's `startup_s` option, else
`DEFAULT_STARTUP_S`), and at that instant the cycle is advanced, so the source drains
then, as it does live once the new replica passes its health check. `drain` stops routing
to a replica; `stop` is bookkeeping here: a drained replica takes no work either way (and
one still busy at `drain_timeout_s` finishes its requests instead of losing them, which
the live gateway cannot promise).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fleetcore.fleet_config import FleetConfig
from fleetmind.placement_cycle import Command, PlacementCycle, Replica
from slomax.ledger import LedgeredAdmission

from .simulator import FleetSimulator

# Start-up of a replica whose deployment does not say (a real engine loading its weights).
DEFAULT_STARTUP_S = 60.0


def startup_s(fleet: FleetConfig, site: str, model: str) -> float:
    """How long a new replica of `model` at `site` takes to serve: its deployment's (else the
    model's first deployment's) `startup_s` option, as the sim adapter reads it live."""
    deps = [d for d in fleet.deployments if d.model == model]
    d = next((d for d in deps if d.site == site), deps[0] if deps else None)
    value = d.options.get("startup_s") if d is not None else None
    return DEFAULT_STARTUP_S if value is None else float(value)


@dataclass
class PlannerLoop:
    core: PlacementCycle
    fleet: FleetConfig
    _seen: int = 0
    _open: list[Any] = field(default_factory=list)  # requests arrived and not yet ended

    def __call__(self, sim: FleetSimulator, now: float) -> None:
        self._observe(sim)
        if isinstance(sim.admission, LedgeredAdmission):  # as the gateway's: its goodput ledger
            self.core.goodput_from(sim.admission.ledger.totals.values())
        self._execute(sim, self.core.cycle(now, sim.placement(), _replicas(sim)), now)

    def _observe(self, sim: FleetSimulator) -> None:
        reqs = sim.requests
        for r in reqs[self._seen:]:
            self.core.arrived(r.profile)
            self._open.append(r)
        self._seen = len(reqs)
        still = []
        for r in self._open:
            if r.end is None:
                still.append(r)
            elif r.site is not None:  # dispatched: an attempt ended there (as the relay reports it)
                self.core.ended(r.site, r.inp.model, r.inp.prompt_tokens, r.ntok, r.status == "completed")
                if isinstance(sim.admission, LedgeredAdmission):  # its verdict, as the gateway's `on_released`
                    o = sim._outcome(r, r.end, cancelled=r.status == "cancelled")
                    self.core.judged(r.site, r.inp.model, r.status == "completed" and sim.admission.judge(r.profile, o),
                                     r.end)
        self._open = still

    def _execute(self, sim: FleetSimulator, commands: list[Command], now: float) -> None:
        todo = list(commands)
        while todo:
            c = todo.pop(0)
            if c.kind == "start":
                wait = startup_s(self.fleet, c.site, c.model)
                try:
                    iid = sim.add_instance(c.site, c.model, now, wait, on_ready=lambda _iid, t: self._ready(sim, t))
                except ValueError as e:
                    todo += self.core.start_failed(c.step, now, f"could not start a replica: {e}")
                    continue
                todo += self.core.started(c.step, iid, now, f"loading for {wait:g} s")
            elif c.kind == "drain":
                assert c.instance_id is not None
                sim.drain(c.instance_id)
            else:
                assert c.instance_id is not None
                sim.drain(c.instance_id)
                self.core.stopped(c.instance_id, now)

    def _ready(self, sim: FleetSimulator, now: float) -> None:
        self._execute(sim, self.core.advance(now, _replicas(sim)), now)


def _replicas(sim: FleetSimulator) -> list[Replica]:
    return [Replica(i.instance_id, i.site, i.model, i.ready, i.draining,
                    i.inflight == 0 and i.num_running + i.num_waiting == 0, i.inflight)
            for i in sim.view().instances()]
