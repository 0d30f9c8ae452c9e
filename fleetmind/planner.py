"""FleetMind's long cycle: place model replicas where demand is, and undo moves that hurt.

Pure: the composition root feeds it demand and goodput observations and applies the
plans it returns through the engine adapters (the simulator through its engines).

Demand is measured as engine work: seconds of instance time (on the model's reference
hardware, `fleetmind.demand`) per second. It is booked twice: to the request's *home*
site (spilled requests count for their home, which is where capacity was missing) and
to the site that *served* it (a site busy with spilled-in work is not idle, even if no
request calls it home). Each cycle:

1. Per (site, model): replicas wanted = ceil(max(home demand, served load) / (target
   utilisation x the speed of that site's replicas)), where each rate is an EWMA over
   `window_s` extrapolated `lead_s` ahead along its trend (pre-warming: a replica takes
   `startup_s` to come up, so it is asked for before the peak, not at it). Speed is
   relative to the reference hardware: a site of slower GPUs needs more replicas for
   the same work, and a replica moved there supplies less.
2. Moves pair the largest deficit with the largest surplus of the same model
   (replicas leave a site that does not need them and start where demand is, unless
   they would run slower there than `min_speed_ratio` of their speed at the source),
   within each site's GPU budget and per-site minimums; at most one move (of up to
   `max_batch` replicas) per cycle and a `cooldown_s` between changes, so each change
   can be judged on its own.
3. After applying a move, goodput is watched for `watch_s`; if it falls more than
   `rollback_drop` below its level before the move, the move is rolled back, and the
   same move is not proposed again for `block_s`. Callers should feed goodput
   normalised by demand (good tokens / output tokens of the requests that ended), so
   that demand swinging on its own is not mistaken for the move's effect.

Every plan, apply and rollback is logged (`log`), for the admin API.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from fleetcore.fleet_config import FleetConfig
from fleetmind.demand import DemandModel

Key = tuple[str, str]  # (site, model)
MAX_VERDICTS = 4096  # served-request verdicts kept per (site, model): the window's, within a bound


@dataclass(frozen=True, slots=True)
class Move:
    model: str
    from_site: str | None  # None: add replicas without removing any
    to_site: str | None  # None: remove only
    count: int = 1

    def inverse(self) -> Move:
        return Move(self.model, self.to_site, self.from_site, self.count)

    def describe(self) -> str:
        src = self.from_site or "(new)"
        dst = self.to_site or "(released)"
        return f"{self.model}: {src} -> {dst}" + (f" x{self.count}" if self.count > 1 else "")


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    window_s: float = 60.0
    lead_s: float = 60.0  # how far ahead demand is extrapolated (>= replica start-up time)
    target_utilisation: float = 0.7
    cooldown_s: float = 120.0
    watch_s: float = 60.0
    rollback_drop: float = 0.15  # roll back when goodput falls this fraction below its baseline
    block_s: float = 600.0  # a rolled-back move is not proposed again for this long
    min_replicas: int = 1  # a site keeps at least this many replicas of a model it serves
    # ... and at least this fraction of the replicas the fleet file gives it: a quiet site
    # stripped bare has nothing to meet a burst with for minutes (see deploy/scenarios).
    keep_fraction: float = 0.5
    max_batch: int = 4  # replicas one move may carry
    demand_tolerance: float = 0.25  # demand moving more than this during a watch: inconclusive
    # A replica is not moved to a site where it would run slower than this fraction of its
    # speed where it is: the capacity it takes away is worth more than what it adds.
    min_speed_ratio: float = 0.8
    # No replicas are moved to (or started at) a site while at least this share of the
    # requests it served in the last `window_s` met their own class SLO (None: off; demand
    # alone decides). Under admission control demand counts requests admission will turn
    # away whatever the site's size (SLOMax's valve lets long prompts in about one at a time
    # per model pool, deploy/scenarios/README.md): a site that serves what it admits within
    # its SLO is not short, and the replicas taken for it are missing where they were.
    settled_met_share: float | None = None


@dataclass(frozen=True, slots=True)
class LogEntry:
    at: float
    kind: Literal["plan", "apply", "rollback", "keep", "advise"]
    move: Move | None
    reason: str


@dataclass(slots=True)
class _Rate:
    """EWMA of a rate with a trend, over irregular observations."""

    value: float = 0.0
    slope: float = 0.0
    last: float | None = None
    pending: float = 0.0

    def add(self, amount: float) -> None:
        self.pending += amount

    def roll(self, now: float, window_s: float) -> None:
        if self.last is None:
            self.last = now
            return
        dt = now - self.last
        if dt <= 0:
            return
        alpha = 1 - math.exp(-dt / window_s)
        new = self.value + alpha * (self.pending / dt - self.value)
        self.slope += alpha * ((new - self.value) / dt - self.slope)
        self.value, self.pending, self.last = new, 0.0, now

    def ahead(self, lead_s: float) -> float:
        return max(0.0, self.value + self.slope * lead_s)


@dataclass(slots=True)
class _Watch:
    move: Move
    started: float
    baseline: float
    demand: dict[str, float]  # demand rate of the move's model per site when it was applied
    samples: list[float] = field(default_factory=list)


class Planner:
    def __init__(self, replica_capacity: Mapping[str, float] | None = None,
                 gpu_budget: Mapping[str, int] | None = None, gpus_per_replica: Mapping[str, int] | None = None,
                 config: PlannerConfig | None = None, replica_speed: Mapping[Key, float] | None = None,
                 initial: Mapping[Key, int] | None = None) -> None:
        # work-seconds per second one replica of a model supplies (1.0 = fully busy)
        self.replica_capacity = dict(replica_capacity or {})
        # (site, model) -> speed of that site's replicas relative to the reference hardware
        self.replica_speed = dict(replica_speed or {})
        self.initial = dict(initial or {})  # replicas per (site, model) as the fleet file places them
        self.gpu_budget = dict(gpu_budget or {})  # site -> GPUs available for replicas
        self.gpus_per_replica = dict(gpus_per_replica or {})  # model -> GPUs (TP)
        self.config = config or PlannerConfig()
        self._demand: dict[Key, _Rate] = {}
        self._served: dict[Key, _Rate] = {}
        self._goodput: list[tuple[float, float]] = []
        self._last_change = -math.inf
        self._watch: _Watch | None = None
        self._blocked: dict[Move, float] = {}  # rolled-back move -> until when
        self._verdicts: dict[Key, deque[tuple[float, bool]]] = {}  # (end time, met SLO) of served requests
        self.log: list[LogEntry] = []

    # -- observations ---------------------------------------------------------------
    def record_demand(self, site: str, model: str, work_s: float) -> None:
        """Work of a request whose home is `site`."""
        self._demand.setdefault((site, model), _Rate()).add(work_s)

    def record_served(self, site: str, model: str, work_s: float) -> None:
        """Work of a request that ran at `site` (its home or not)."""
        self._served.setdefault((site, model), _Rate()).add(work_s)

    def record_verdict(self, site: str, model: str, met: bool, now: float) -> None:
        """A request `site` served ended at `now`; `met`: within its own class SLO."""
        q = self._verdicts.get((site, model))
        if q is None:
            q = self._verdicts[(site, model)] = deque(maxlen=MAX_VERDICTS)
        q.append((now, met))

    def met_share(self, key: Key, now: float) -> float | None:
        """Share of the requests served at `key` in the last `window_s` that met their SLO (None: none ended)."""
        q = self._verdicts.get(key)
        if q is None:
            return None
        while q and q[0][0] < now - self.config.window_s:
            q.popleft()
        return sum(m for _, m in q) / len(q) if q else None

    def _settled(self, key: Key, now: float) -> bool:
        floor = self.config.settled_met_share
        share = self.met_share(key, now) if floor is not None else None
        return share is not None and share >= floor

    def record_goodput(self, goodput_tok_s: float, now: float) -> None:
        self._goodput.append((now, goodput_tok_s))
        horizon = now - 4 * max(self.config.window_s, self.config.watch_s)
        while self._goodput and self._goodput[0][0] < horizon:
            self._goodput.pop(0)
        if self._watch is not None and now >= self._watch.started:
            self._watch.samples.append(goodput_tok_s)

    # -- the cycle ------------------------------------------------------------------
    def wanted(self, now: float) -> dict[Key, int]:
        cfg = self.config
        for rate in (*self._demand.values(), *self._served.values()):
            rate.roll(now, cfg.window_s)
        out = {}
        for key in self._demand.keys() | self._served.keys():
            need = max(r.ahead(cfg.lead_s) for r in (self._demand.get(key), self._served.get(key)) if r is not None)
            cap = self.replica_capacity.get(key[1], 1.0) * self.replica_speed.get(key, 1.0) * cfg.target_utilisation
            out[key] = math.ceil(need / cap - 1e-9) if cap > 0 else 0
        return out

    def plan(self, placement: Mapping[Key, int], now: float) -> Move | None:
        """At most one move, or None. `placement` = replicas per (site, model) now."""
        if self._watch is not None or now - self._last_change < self.config.cooldown_s:
            return None
        wanted = self.wanted(now)
        models = {m for _, m in placement} | {m for _, m in wanted}
        best: tuple[int, Move, str] | None = None
        for model in sorted(models):
            keys = sorted({k for k in placement if k[1] == model} | {k for k in wanted if k[1] == model})
            gap = {k: wanted.get(k, 0) - placement.get(k, 0) for k in keys}
            short = max((k for k in keys if not self._settled(k, now)), key=lambda k: (gap[k], k), default=None)
            if short is None or gap[short] <= 0:
                continue
            speed = self.replica_speed.get(short, 1.0)
            spare = [k for k in keys if gap[k] < 0 and placement.get(k, 0) > self._floor(k)
                     and speed >= self.config.min_speed_ratio * self.replica_speed.get(k, 1.0) - 1e-12]
            if spare:
                src = min(spare, key=lambda k: (gap[k], k))
                n = min(gap[short], -gap[src], placement.get(src, 0) - self._floor(src),
                        self.config.max_batch)
                move = Move(model, src[0], short[0], max(1, n))
                if any(m.from_site == move.from_site and m.to_site == move.to_site and m.model == model
                       and until > now for m, until in self._blocked.items()):
                    continue
                reason = (f"{short[0]} needs {wanted.get(short, 0)} replica(s) of {model}, has "
                          f"{placement.get(short, 0)}; {src[0]} has {placement.get(src, 0)}, needs {wanted.get(src, 0)}")
            elif self._free_gpus(short[0], placement) >= self.gpus_per_replica.get(model, 1) \
                    and self._blocked.get(Move(model, None, short[0]), -math.inf) <= now:
                fits = self._free_gpus(short[0], placement) // self.gpus_per_replica.get(model, 1)
                move = Move(model, None, short[0], max(1, min(gap[short], fits, self.config.max_batch)))
                reason = f"{short[0]} needs {wanted.get(short, 0)} replica(s) of {model}; GPUs are free there"
            else:
                continue
            if best is None or gap[short] > best[0]:
                best = (gap[short], move, reason)
        if best is None:
            return None
        self.log.append(LogEntry(now, "plan", best[1], best[2]))
        return best[1]

    def applied(self, move: Move, now: float) -> None:
        """The move was carried out: start watching goodput against the level before it."""
        before = [g for t, g in self._goodput if t >= now - self.config.window_s]
        if not before and self._goodput:
            # Starting the replica took longer than the window (a slow launch): the last level
            # seen is still the level before the move; 0 would make any drop look harmless.
            before = [self._goodput[-1][1]]
        baseline = sum(before) / len(before) if before else 0.0
        self._watch = _Watch(move, now, baseline, self._model_demand(move.model))
        self._last_change = now
        self.log.append(LogEntry(now, "apply", move, f"goodput before: {baseline:.2f}"))

    def advised(self, move: Move, now: float, why: str) -> None:
        """The move was only shown to operators (advise mode), or could not be carried out: it
        is not watched, but the cooldown applies so it is not proposed again every cycle."""
        self._last_change = now
        self.log.append(LogEntry(now, "advise", move, why))

    def check(self, now: float) -> Move | None:
        """After a watch period: the inverse move if goodput dropped past the threshold."""
        w = self._watch
        if w is None or now - w.started < self.config.watch_s:
            return None
        self._watch = None
        after = sum(w.samples) / len(w.samples) if w.samples else 0.0
        self.wanted(now)  # bring demand rates up to date
        demand = self._model_demand(w.move.model)
        before = sum(w.demand.values())
        moved = sum(abs(demand.get(k, 0.0) - w.demand.get(k, 0.0)) for k in set(demand) | set(w.demand))
        shift = moved / before if before > 0 else 0.0
        if shift > self.config.demand_tolerance:
            # Goodput moved with demand, not (only) with the move: no verdict on the move.
            self.log.append(LogEntry(now, "keep", w.move, f"inconclusive: demand changed {shift:.0%} "
                                                          f"(goodput {w.baseline:.2f} -> {after:.2f})"))
            return None
        if w.baseline > 0 and after < w.baseline * (1 - self.config.rollback_drop):
            undo = w.move.inverse()
            self._last_change = now
            self._blocked[w.move] = now + self.config.block_s
            self.log.append(LogEntry(now, "rollback", undo,
                                     f"goodput fell {1 - after / w.baseline:.0%} after {w.move.describe()} "
                                     f"({w.baseline:.2f} -> {after:.2f})"))
            return undo
        self.log.append(LogEntry(now, "keep", w.move, f"goodput {w.baseline:.2f} -> {after:.2f}"))
        return None

    def _model_demand(self, model: str) -> dict[str, float]:
        """Demand rate of `model` per site: a shift between sites counts, not only the total."""
        return {site: r.value for (site, m), r in self._demand.items() if m == model}

    def _floor(self, key: Key) -> int:
        return max(self.config.min_replicas, math.ceil(self.config.keep_fraction * self.initial.get(key, 0) - 1e-9))

    def _free_gpus(self, site: str, placement: Mapping[Key, int]) -> int:
        used = sum(n * self.gpus_per_replica.get(m, 1) for (s, m), n in placement.items() if s == site)
        return self.gpu_budget.get(site, 0) - used


def planner_for(fleet: FleetConfig, demand: DemandModel, **defaults: float | int) -> Planner:
    """The planner a fleet file describes: its `planner:` tuning over `defaults`, each site's
    GPU budget from its `gpus` (a site without one gets no replicas beyond those moved into
    it), GPUs per replica from the model's deployments (their TP degree), and each site's
    replica speed from its hardware (`demand.replica_speed`)."""
    gpus_per_replica: dict[str, int] = {}
    for d in fleet.deployments:
        gpus_per_replica.setdefault(d.model, d.tp)
    speed = {(d.site, d.model): demand.replica_speed(d.site, d.model) for d in fleet.deployments}
    initial: dict[Key, int] = {}
    for d in fleet.deployments:
        initial[(d.site, d.model)] = initial.get((d.site, d.model), 0) + d.instance_count
    return Planner(gpu_budget={s.name: s.gpus for s in fleet.sites if s.gpus is not None},
                   gpus_per_replica=gpus_per_replica, replica_speed=speed, initial=initial,
                   config=PlannerConfig(**{**defaults, **fleet.planner.tuning()}))  # type: ignore[arg-type]
