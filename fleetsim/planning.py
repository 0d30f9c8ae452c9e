"""Run FleetMind's placement planner inside a simulation (its long cycle, in virtual time).

Every `cycle_s` the loop tells the planner what demand arrived since the last cycle
(engine work, attributed to each request's *home* site: the nearest site serving its
model, i.e. where capacity was wanted; and to the site that served it) and the goodput
of the last window, then
carries out what the planner decides: a move drains one replica at the source
(it finishes its requests) and starts one at the destination, ready `startup_s`
later; a rollback does the inverse.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fleetcore.slo import ClassSLO
from fleetmind.demand import DemandModel
from fleetmind.planner import Move, Planner

from .simulator import FleetSimulator


@dataclass
class PlannerLoop:
    planner: Planner
    demand: DemandModel
    cycle_s: float = 30.0
    startup_s: float = 60.0
    window_s: float = 60.0
    slos: Mapping[str, ClassSLO] = field(kw_only=True)  # the fleet's SLO map (AdmissionConfig.slos)
    _seen: int = 0
    # (request, its work) arrived and not yet booked to the site that serves it
    _unrouted: list[tuple[Any, float]] = field(default_factory=list)

    def __call__(self, sim: FleetSimulator, now: float) -> None:
        reqs = sim.requests
        for r in reqs[self._seen:]:
            inp = r.inp
            work = self.demand.work_s(inp.model, inp.prompt_tokens, inp.output_tokens)
            self.planner.record_demand(self.demand.home(inp.region, inp.model), inp.model, work)
            self._unrouted.append((r, work))
        self._seen = len(reqs)
        pending, self._unrouted = self._unrouted, []
        for r, work in pending:
            if r.site is not None:
                self.planner.record_served(r.site, r.inp.model, work)
            elif r.status in ("new", "queued"):
                self._unrouted.append((r, work))
        self.planner.record_goodput(self._good_fraction(sim, now), now)
        undo = self.planner.check(now)
        if undo is not None:
            self._carry_out(sim, undo, now)
        move = self.planner.plan(sim.placement(), now)
        if move is not None and self._carry_out(sim, move, now):
            self.planner.applied(move, now)

    def _carry_out(self, sim: FleetSimulator, move: Move, now: float) -> bool:
        done = 0
        for _ in range(move.count):
            if move.from_site is not None and sim.drain_instance(move.from_site, move.model) is None:
                break
            if move.to_site is not None:
                sim.add_instance(move.to_site, move.model, now, self.startup_s)
            done += 1
        return done > 0

    def _good_fraction(self, sim: FleetSimulator, now: float) -> float:
        """Goodput normalised by demand: of the output tokens of requests that ended in the last
        window, the share from requests that met their SLO (rejections count as misses)."""
        lo = now - self.window_s
        good = total = 0
        for r in reversed(sim.requests):
            if r.inp.arrival_s < lo - 600:
                break  # nothing that old can have ended inside the window
            if r.end is None or r.end < lo:
                continue
            total += max(r.ntok, r.inp.output_tokens if r.status == "rejected" else r.ntok)
            if r.status != "completed" or r.first is None:
                continue
            ttft = r.first + r.half_rtt - r.inp.arrival_s
            tpot = (r.last - r.first) / (r.ntok - 1) if r.ntok > 1 and r.last is not None else None
            slo = self.slos.get(r.inp.request_class)
            if slo is None or slo.met(ttft, tpot, r.end - r.inp.arrival_s):
                good += r.ntok
        return good / total if total else 1.0
