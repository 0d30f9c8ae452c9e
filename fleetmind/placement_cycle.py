"""FleetMind's long cycle as one clock-free state machine: observations in, replica commands out.

The live gateway (`gateway.placement`) and the simulator (`fleetsim.planning`) both run
this object and only *execute* what it returns, so a planner result from the simulator
means something about production (issue 13: the two loops used to book demand, judge
goodput and carry out moves differently). Nothing here does I/O or reads a clock: every
method that needs the time takes `now`.

What it is fed:
- `arrived(profile)`: demand, booked to the request's home site as engine work
  (`fleetmind.demand`). Only what is known at arrival counts: the output length is the
  model's mean observed output, capped by the request's `max_tokens` (`booked_output`);
- `ended(site, model, prompt, output, ok)`: served load, the work a finished attempt did
  at the site that ran it (and, when it completed, the output length learnt);
- `judged(site, model, met, now)`: the ledger's verdict on each request that ran at a site
  (the planner's `settled_met_share`: a site meeting its SLO for what it serves is not short);
- `goodput(ended, met)`: the cumulative count of requests that ended and of those that met
  their own class SLO, from admission's goodput ledger (rejections, cancellations and
  failures are ended-but-not-met, so refusing work cannot look like success). The planner
  is given the met share of the requests that ended since the previous cycle;
- the replicas as the executor sees them (`Replica`).

What it returns (`Command`): `start` a replica of a model at a site; `drain` one (route
nothing new to it; what it runs finishes); `stop` one. A move is carried out
make-before-break: one `start` per replica moved; once the new replica is up (ready) the
least busy replica of the model at the source drains, and it is stopped when idle or after
`drain_timeout_s`. A new replica not up within `ready_timeout_s` is stopped and the source
keeps its own. A planned move is handed to the planner's watch (`Planner.applied`) once
all its new replicas are up or given up: until then the placement serves as before, so
judging the move from the moment its starts were asked for would blame it for what
demand did during the start-up. The executor reports back `started` / `start_failed` / `stopped` /
`stop_failed`; each step is logged as an `Action` (start, ready, drain, stop, failed,
skipped, mode) next to the planner's own log (plan, apply, keep, rollback, advise).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

from fleetcore.fleet_config import FleetConfig, PlannerSettings
from fleetcore.types import RequestProfile
from fleetmind.demand import DemandModel
from fleetmind.planner import Key, Move, Planner, planner_for

ActionKind = Literal["start", "ready", "drain", "stop", "failed", "skipped", "mode"]
# auto: plans are carried out; advise: logged for operators only; off: no planning at all
# (demand is still recorded, so switching back on starts from a warm history).
Mode = Literal["auto", "advise", "off"]
MODES: tuple[Mode, ...] = ("auto", "advise", "off")
# Output length assumed for a model before any of its requests has completed.
DEFAULT_OUTPUT_TOKENS = 256.0
_OUTPUT_EWMA = 0.05


def booked_output(mean_output: float, max_tokens: int | None) -> int:
    """The output length a request is booked with on arrival: its true length is not known
    then, so the model's mean observed output stands in, capped by what the request allows."""
    out = mean_output if max_tokens is None else min(mean_output, max_tokens)
    return round(out)


class EndedCounts(Protocol):
    """The counters of one goodput-ledger cell (`slomax.ledger.Cell`) the cycle reads."""

    completed: int
    rejected: int
    cancelled: int
    failed: int
    met_slo: int


@dataclass(frozen=True, slots=True)
class Replica:
    """One replica as the executor sees it now."""

    instance_id: str
    site: str
    model: str
    up: bool  # ready to serve (health-checked live; past its start-up in virtual time)
    draining: bool
    idle: bool  # nothing in flight, nothing running or waiting on the engine
    inflight: int


@dataclass(frozen=True, slots=True)
class Command:
    kind: Literal["start", "drain", "stop"]
    move: str  # Move.describe() of the move it carries out
    site: str
    model: str
    step: int = 0  # `start`: the id the executor reports back with
    instance_id: str | None = None  # `drain` / `stop`


@dataclass(frozen=True, slots=True)
class Action:
    at: float
    kind: ActionKind
    move: str
    site: str | None
    instance: str | None
    detail: str


@dataclass(frozen=True, slots=True)
class CycleSettings:
    """The executors' timings: the fleet file's `planner:` block, the same for both clocks."""

    cycle_s: float = 30.0
    drain_timeout_s: float = 600.0
    ready_timeout_s: float = 900.0
    mode: Mode = "auto"

    @classmethod
    def of(cls, p: PlannerSettings) -> CycleSettings:
        return cls(p.cycle_s, p.drain_timeout_s, p.ready_timeout_s, p.mode)


@dataclass(slots=True)
class _Move:
    """A move being carried out: its starts go one after the other (a failed one ends it)."""

    move: Move
    plan: bool  # a plan of this cycle (applied/advised on outcome), not a rollback
    to_start: int
    pending: int = 0  # replicas started and not yet up or given up
    ready: int = 0


@dataclass(slots=True)
class _Loading:
    move: _Move
    instance_id: str
    since: float


@dataclass(slots=True)
class _Draining:
    what: str
    site: str
    model: str
    since: float
    stopping: bool = False
    detail: str = "stopped"  # what the stop action will say


@dataclass(slots=True)
class PlacementCycle:
    planner: Planner
    demand: DemandModel
    settings: CycleSettings = field(default_factory=CycleSettings)
    keep_actions: int = 500
    mode: Mode = "auto"
    actions: deque[Action] = field(init=False)
    action_counts: dict[ActionKind, int] = field(default_factory=dict)  # since start (the deque forgets)
    _mean_output: dict[str, float] = field(default_factory=dict)
    _last_goodput: tuple[int, int] | None = None
    _share: float = 1.0
    _step: int = 0
    _starting: dict[int, _Move] = field(default_factory=dict)  # start sent, no answer yet
    _loading: dict[str, _Loading] = field(default_factory=dict)  # new replica id -> its move
    _draining: dict[str, _Draining] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.actions = deque(maxlen=self.keep_actions)
        self.mode = self.settings.mode

    # -- observations -----------------------------------------------------------------
    def arrived(self, profile: RequestProfile) -> None:
        out = booked_output(self._mean_output.get(profile.model, DEFAULT_OUTPUT_TOKENS), profile.max_tokens)
        self.planner.record_demand(self.demand.home(profile.client_region, profile.model), profile.model,
                                   self.demand.work_s(profile.model, profile.prompt_tokens, out))

    def ended(self, site: str, model: str, prompt_tokens: int, output_tokens: int, ok: bool) -> None:
        """An attempt ended at `site`: the work it did there is that site's served load."""
        self.planner.record_served(site, model, self.demand.work_s(model, prompt_tokens, output_tokens))
        if ok:
            mean = self._mean_output.get(model, DEFAULT_OUTPUT_TOKENS)
            self._mean_output[model] = mean + _OUTPUT_EWMA * (output_tokens - mean)

    def judged(self, site: str, model: str, met: bool, now: float) -> None:
        """A request that ran at `site` ended; `met`: admission's ledger verdict (its own class SLO).
        The planner does not move replicas to a site that meets its SLO for what it serves
        (`PlannerConfig.settled_met_share`)."""
        self.planner.record_verdict(site, model, met, now)

    def goodput(self, ended: int, met: int) -> None:
        """Cumulative requests ended / met their SLO (the ledger's totals); the planner gets the
        share of those that ended since the previous call (1.0 when none did)."""
        last, self._last_goodput = self._last_goodput, (ended, met)
        self._share = 1.0 if last is None or ended == last[0] else (met - last[1]) / (ended - last[0])

    def goodput_from(self, cells: Iterable[EndedCounts]) -> None:
        """`goodput` from a goodput ledger's cumulative totals: every request that completed, was
        rejected, cancelled or failed has ended; those that met their own class SLO are good."""
        ended = met = 0
        for c in cells:
            ended += c.completed + c.rejected + c.cancelled + c.failed
            met += c.met_slo
        self.goodput(ended, met)

    # -- the long cycle -----------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Steps under way: the executor should call `advance` as replicas change."""
        return bool(self._starting or self._loading or self._draining)

    def cycle(self, now: float, placement: Mapping[Key, int], replicas: Iterable[Replica]) -> list[Command]:
        """One long cycle: judge the move being watched (a rollback is carried out like any move),
        then propose at most one new move. `placement`: replicas per (site, model) that serve or
        are starting."""
        replicas = list(replicas)
        self.planner.record_goodput(self._share, now)
        self._share = 1.0
        out = self.advance(now, replicas)
        if self.mode == "off":
            return out
        undo = self.planner.check(now)
        if undo is not None:
            out += self._begin(undo, False, now, replicas)
        if self._unsettled():  # one change at a time: the last one has not taken effect yet
            return out
        move = self.planner.plan(placement, now)
        if move is None:
            return out
        if self.mode == "advise":
            self.planner.advised(move, now, "advise mode: not carried out")
            return out
        cmds = self._begin(move, True, now, replicas)
        if not cmds:
            self.planner.advised(move, now, "could not be carried out (see actions)")
        return out + cmds

    def carry_out(self, move: Move, now: float, replicas: Iterable[Replica]) -> list[Command]:
        """Carry out `move` outside the planner's judgement (operators, tests): not watched."""
        return self._begin(move, False, now, list(replicas))

    def set_mode(self, mode: Mode, actor: str, now: float) -> None:
        if mode != self.mode:
            self._act(now, "mode", "", None, None, f"{self.mode} -> {mode} by {actor}")
            self.mode = mode

    # -- between cycles -------------------------------------------------------------------
    def advance(self, now: float, replicas: Iterable[Replica]) -> list[Command]:
        """Steps under way: a new replica up drains one at the source; a drained one stops."""
        by_id = {r.instance_id: r for r in replicas}
        out: list[Command] = []
        for iid, ld in list(self._loading.items()):
            r = by_id.get(iid)
            what = ld.move.move.describe()
            if r is not None and r.up:
                del self._loading[iid]
                self._act(now, "ready", what, r.site, iid, f"ready after {now - ld.since:.1f} s")
                if ld.move.move.from_site is not None:
                    out += self._retire(ld.move.move, now, by_id.values(), after=iid)
                ld.move.ready += 1
                self._resolved(ld.move, now)
            elif now - ld.since >= self.settings.ready_timeout_s:
                del self._loading[iid]
                site = ld.move.move.to_site or ""
                self._act(now, "failed", what, site, iid, f"not ready after {self.settings.ready_timeout_s:.0f} s; "
                                                          "stopped, the source keeps its replica")
                self._draining[iid] = _Draining(what, site, ld.move.move.model, now, stopping=True)
                out.append(Command("stop", what, site, ld.move.move.model, instance_id=iid))
                self._resolved(ld.move, now)
        for iid, d in self._draining.items():
            if d.stopping:
                continue
            r = by_id.get(iid)
            timed_out = now - d.since >= self.settings.drain_timeout_s
            if r is None or r.idle or timed_out:
                d.stopping = True
                busy = r is not None and not r.idle
                d.detail = f"drained in {now - d.since:.1f} s" + (" (timed out with requests in flight)" if busy else "")
                out.append(Command("stop", d.what, d.site, d.model, instance_id=iid))
        return out

    def next_due(self) -> float | None:
        """The earliest time a step times out (the executor wakes up by then at the latest)."""
        times = [ld.since + self.settings.ready_timeout_s for ld in self._loading.values()]
        times += [d.since + self.settings.drain_timeout_s for d in self._draining.values() if not d.stopping]
        return min(times, default=None)

    # -- what the executor reports ----------------------------------------------------------
    def started(self, step: int, instance_id: str, now: float, detail: str = "loading") -> list[Command]:
        m = self._starting.pop(step)
        m.pending += 1
        site = m.move.to_site or ""
        self._act(now, "start", m.move.describe(), site, instance_id, detail)
        self._loading[instance_id] = _Loading(m, instance_id, now)
        return self._next_start(m, now)

    def start_failed(self, step: int, now: float, why: str, *, skipped: bool = False) -> list[Command]:
        """The replica could not be started: the rest of the move is dropped, the source keeps
        its replicas."""
        m = self._starting.pop(step)
        self._act(now, "skipped" if skipped else "failed", m.move.describe(), m.move.to_site, None, why)
        m.to_start = 0
        self._settle(m, now)
        return []

    def stopped(self, instance_id: str, now: float) -> None:
        d = self._draining.pop(instance_id, None)
        if d is not None:
            self._act(now, "stop", d.what, d.site, instance_id, d.detail)

    def stop_failed(self, instance_id: str, now: float, why: str) -> None:
        d = self._draining.pop(instance_id, None)
        if d is not None:
            self._act(now, "failed", d.what, d.site, instance_id, f"could not stop: {why}")

    # -- the steps -----------------------------------------------------------------------------
    def _begin(self, move: Move, plan: bool, now: float, replicas: list[Replica]) -> list[Command]:
        if move.to_site is None:  # remove only: nothing to make first
            out: list[Command] = []
            for _ in range(move.count):
                cmds = self._retire(move, now, replicas, after=None)
                if not cmds:
                    break
                out += cmds
            if out and plan:
                self.planner.applied(move, now)
            return out
        return self._next_start(_Move(move, plan, move.count), now)

    def _next_start(self, m: _Move, now: float) -> list[Command]:
        if m.to_start <= 0:
            return []
        m.to_start -= 1
        self._step += 1
        self._starting[self._step] = m
        assert m.move.to_site is not None
        return [Command("start", m.move.describe(), m.move.to_site, m.move.model, step=self._step)]

    def _resolved(self, m: _Move, now: float) -> None:
        m.pending -= 1
        self._settle(m, now)

    def _settle(self, m: _Move, now: float) -> None:
        """Once every replica of a planned move is up (or given up), the move has taken effect:
        make-before-break leaves the placement as it was until then, so the planner's watch (and
        the goodput baseline before it) starts now, not when the starts were asked for."""
        if not m.plan or m.to_start > 0 or m.pending > 0 or any(x is m for x in self._starting.values()):
            return
        m.plan = False  # settled once
        if m.ready:
            self.planner.applied(m.move, now)
        else:
            self.planner.advised(m.move, now, "could not be carried out (see actions)")

    def _unsettled(self) -> bool:
        return any(m.plan for m in self._starting.values()) or any(ld.move.plan for ld in self._loading.values())

    def _retire(self, move: Move, now: float, replicas: Iterable[Replica], after: str | None) -> list[Command]:
        """Drain one replica of the move's model at its source; none when there is none to drain."""
        assert move.from_site is not None
        what = move.describe()
        victims = [r for r in replicas if r.site == move.from_site and r.model == move.model
                   and not r.draining and r.instance_id not in self._draining]
        if not victims:
            self._act(now, "skipped", what, move.from_site, None, f"no replica of {move.model} left to drain")
            return []
        # Prefer one that is not serving (still loading: a rollback of a fresh move), then the least busy.
        r = min(victims, key=lambda v: (v.up, v.inflight, v.instance_id))
        ld = self._loading.pop(r.instance_id, None)
        if ld is not None:  # given back before it served
            self._resolved(ld.move, now)
        because = f" (replaced by {after})" if after else ""
        self._act(now, "drain", what, r.site, r.instance_id, f"draining with {r.inflight} in flight{because}")
        self._draining[r.instance_id] = _Draining(what, r.site, r.model, now)
        return [Command("drain", what, r.site, r.model, instance_id=r.instance_id)]

    def _act(self, now: float, kind: ActionKind, move: str, site: str | None, instance: str | None,
             detail: str) -> None:
        self.actions.append(Action(now, kind, move, site, instance, detail))
        self.action_counts[kind] = self.action_counts.get(kind, 0) + 1


def placement_cycle_for(fleet: FleetConfig, demand: DemandModel) -> PlacementCycle:
    """The placement cycle a fleet file describes: its `planner:` block tunes both the planner
    and the executors' timings, for the gateway and the simulator alike."""
    return PlacementCycle(planner_for(fleet, demand), demand, CycleSettings.of(fleet.planner))
