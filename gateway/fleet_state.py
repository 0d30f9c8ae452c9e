"""What the gateway knows about the fleet right now, and the `FleetView` the policies read.

Each instance is polled by its own task (health + load snapshot, with a per-call
timeout), so a hung engine goes unready without delaying anyone else's update.
The gateway also keeps its own in-flight count per instance: engine metrics
lag one scrape, the count does not. An instance being taken out of service (FleetMind's
planner moving a replica) is *draining*: it finishes what it has and gets nothing new.
Each probe's round trip (its health check's, not the load scrape's beside it) is kept too:
the lowest of the last few is the network RTT the gateway sees to that instance's site (an
engine's own work adds to every probe, so the minimum, not the mean). The lowest over a site's
instances is the site's round trip (`network_rtt_s`): what the view tells the policies
(`SiteSnapshot.probe_rtt_ms`: the TTFT the gateway reports carries it, `fleetmind.place`) and
what each outcome's TTFT is said to hold (`RequestOutcome.network_s`: TokenPilot learns engine
speeds without it). A failed connection marks an instance unready at once; only a health
check that *started after* the failure may bring it back (an older, slower check must not undo
fresh evidence).

Health checks have hysteresis: a ready instance is taken out only after
`health_misses_to_unready` consecutive missed checks (no answer within
`health_timeout_s`, or an answer that is not healthy); certain death — a refused
connection, an engine process its adapter reports dead or restarting, a failure the relay
saw — takes it out at once. A check's deadline counts only time in which the event loop
could run (`gateway.loop_monitor`): a gateway stalled by its own load does not blame its
engines and empty the fleet. An engine its adapter restarted comes back cold: listeners
(`on_restart`, the router's cache index) forget what it held.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from engine_adapters.base import EngineAdapter, EngineDown, Instance, LoadSnapshot
from fleetcore.fleet_config import FleetConfig
from fleetcore.types import FleetView, InstanceSnapshot, SiteSnapshot
from gateway.background import cancel_and_wait
from gateway.loop_monitor import LoopMonitor

log = logging.getLogger("tokenfleet.gateway")

# A check stretched by loop stalls gives up (neither a hit nor a miss) after this many timeouts
# of wall time: a loop that busy cannot judge anyone.
_MAX_STRETCH = 10.0


@dataclass(slots=True)
class InstanceState:
    adapter: EngineAdapter
    instance: Instance
    load: LoadSnapshot | None = None
    ready: bool = False
    inflight: int = 0  # this replica's dispatches not yet finished
    remote_inflight: int = 0  # the other replicas' (gateway.load_sync), one period stale
    failed_at: float = float("-inf")  # clock time of the last failed connection
    last_poll: float | None = None
    last_error: str | None = None
    draining: bool = False
    added_at: float = 0.0  # clock time the gateway first saw it
    ready_at: float | None = None  # clock time of its first ready health check
    probe_s: deque[float] = field(default_factory=lambda: deque(maxlen=8))
    misses: int = 0  # consecutive missed health checks
    restarts: int = 0  # its adapter's restart count, as last seen

    @property
    def probe_rtt_ms(self) -> float | None:
        return 1000 * min(self.probe_s) if self.probe_s else None

    @property
    def up(self) -> bool:
        """Ready, and its process not known dead (the adapter knows before the next check)."""
        return self.ready and not self.adapter.down(self.instance)

    @property
    def serving(self) -> bool:
        """Up and taking new work (not draining)."""
        return self.up and not self.draining


# --- pure helpers ---

def instance_snapshot(st: InstanceState) -> InstanceSnapshot:
    inst, load = st.instance, st.load
    return InstanceSnapshot(
        instance_id=inst.instance_id, site=inst.site, model=inst.model, version=inst.version,
        url=inst.url, ready=st.up, draining=st.draining, role=inst.role,
        inflight=st.inflight + st.remote_inflight,
        num_running=load.num_running if load else 0,
        num_waiting=load.num_waiting if load else 0,
        kv_usage=load.kv_usage if load else 0.0,
        block_size=(load.block_size if load and load.block_size else inst.block_size),
        max_model_len=inst.max_model_len)


def build_view(config: FleetConfig, states: Iterable[InstanceState],
               site_rtt_ms: Mapping[str, float] | None = None) -> FleetView:
    """Sites in fleet-file order; instances of a site the file does not name are left out.
    `site_rtt_ms`: the measured round trip per site (`site_network_rtt_ms`), where known."""
    by_site: dict[str, list[InstanceSnapshot]] = {s.name: [] for s in config.sites}
    for st in states:
        if st.instance.site in by_site:
            by_site[st.instance.site].append(instance_snapshot(st))
    measured = site_rtt_ms or {}
    return FleetView(tuple(
        SiteSnapshot(name=s.name, region=s.region, jurisdiction=s.jurisdiction,
                     rtt_ms=dict(s.rtt_ms),
                     instances=tuple(sorted(by_site[s.name], key=lambda i: i.instance_id)),
                     probe_rtt_ms=measured.get(s.name))
        for s in config.sites))


@dataclass(slots=True)
class PoolCounts:
    """One site's instances of one model version, by state (what operators watch)."""

    ready: int = 0
    starting: int = 0  # never ready yet: loading
    draining: int = 0
    unready: int = 0  # was ready, failing now
    inflight: int = 0
    num_waiting: int = 0
    kv_usage_max: float = 0.0


def pool_counts(states: Iterable[InstanceState]) -> dict[tuple[str, str, str], PoolCounts]:
    """Per (site, model, version)."""
    out: dict[tuple[str, str, str], PoolCounts] = {}
    for st in states:
        inst, load = st.instance, st.load
        c = out.setdefault((inst.site, inst.model, inst.version), PoolCounts())
        if st.draining:
            c.draining += 1
        elif st.up:
            c.ready += 1
        elif st.ready_at is None:
            c.starting += 1
        else:
            c.unready += 1
        c.inflight += st.inflight
        if load is not None:
            c.num_waiting += load.num_waiting
            c.kv_usage_max = max(c.kv_usage_max, load.kv_usage)
    return out


def placement(pools: dict[tuple[str, str, str], PoolCounts]) -> dict[tuple[str, str], int]:
    """Replicas per (site, model), all versions, that serve or are starting (loading for the first
    time, as a move's new replica does). Not counted: draining ones (on their way out) and
    unready ones — a crashed engine being restarted serves nothing until it is back."""
    out: dict[tuple[str, str], int] = {}
    for (site, model, _), c in pools.items():
        out[(site, model)] = out.get((site, model), 0) + c.ready + c.starting
    return out


def site_network_rtt_ms(states: Iterable[InstanceState], site: str) -> float | None:
    """One site's round trip: the lowest recent probe of any of its instances (each probe is one
    round trip on a kept-alive connection plus the engine's answer, which only adds: the lowest
    is the nearest to the network alone); None when none of them answered a probe yet."""
    lows = [min(st.probe_s) for st in states if st.instance.site == site and st.probe_s]
    return 1000 * min(lows) if lows else None


def site_probe_rtt_ms(states: Iterable[InstanceState]) -> dict[str, float]:
    """Per site: the median over its instances of each one's lowest recent probe round trip."""
    by_site: dict[str, list[float]] = {}
    for st in states:
        rtt = st.probe_rtt_ms
        if rtt is not None:
            by_site.setdefault(st.instance.site, []).append(rtt)
    return {site: statistics.median(v) for site, v in by_site.items()}


@dataclass(frozen=True, slots=True)
class ReadyCounts:
    """Instances serving (ready, process up, not draining), by model and site."""

    ready: int
    total: int
    by_model: dict[str, int] = field(default_factory=dict)
    by_site: dict[str, int] = field(default_factory=dict)

    @property
    def unserved_models(self) -> list[str]:
        return sorted(m for m, n in self.by_model.items() if n == 0)

    @property
    def degraded(self) -> bool:
        """A model the fleet should serve has no ready instance."""
        return any(n == 0 for n in self.by_model.values())


def ready_counts(states: Iterable[InstanceState], models: Iterable[str] = ()) -> ReadyCounts:
    """`models`: those expected to be served even when no instance of theirs is known."""
    by_model: dict[str, int] = dict.fromkeys(models, 0)
    by_site: dict[str, int] = {}
    ready = total = 0
    for st in states:
        total += 1
        by_model.setdefault(st.instance.model, 0)
        by_site.setdefault(st.instance.site, 0)
        if st.serving:
            ready += 1
            by_model[st.instance.model] += 1
            by_site[st.instance.site] += 1
    return ReadyCounts(ready, total, by_model, by_site)


async def _probe(st: InstanceState, clock: Callable[[], float]) -> tuple[bool, LoadSnapshot, float]:
    """(healthy, load, the health check's own round trip in seconds). The round trip is the health
    check's alone: the load snapshot beside it (a metrics scrape, the engine's heavier answer)
    would only add the engine's work to it."""
    # A coroutine, not a bare gather future, so that cancelling the poll (shutdown, timeout)
    # also collects the gather's result instead of leaving it "never retrieved".
    # `check`, not `health`: it raises EngineDown when the engine is certainly gone.
    async def timed_check() -> tuple[bool, float]:
        t0 = clock()
        healthy = await st.adapter.check(st.instance)
        return healthy, clock() - t0
    (healthy, round_trip), load = await asyncio.gather(timed_check(), st.adapter.snapshot(st.instance))
    return healthy, load, round_trip


# --- the live state ---

class FleetState:
    """`poll_interval_s`, `call_timeout_s`, `misses_to_unready` default to the fleet file's
    `gateway:` block (health_interval_s, health_timeout_s, health_misses_to_unready)."""

    def __init__(self, config: FleetConfig, adapters: Sequence[EngineAdapter],
                 poll_interval_s: float | None = None, call_timeout_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic, *,
                 misses_to_unready: int | None = None, loop_monitor: LoopMonitor | None = None) -> None:
        g = config.gateway
        self.config = config
        self.adapters = list(adapters)
        self.poll_interval_s = g.health_interval_s if poll_interval_s is None else poll_interval_s
        # A check that gets no answer in this much responsive loop time is a miss.
        self.call_timeout_s = g.health_timeout_s if call_timeout_s is None else call_timeout_s
        self.misses_to_unready = g.health_misses_to_unready if misses_to_unready is None else misses_to_unready
        self.clock = clock
        # The app's monitor when given (it starts and stops it); else one of our own.
        self.lag = loop_monitor if loop_monitor is not None else LoopMonitor()
        self._own_lag = loop_monitor is None
        # Called with an instance whose engine its adapter restarted (its cache is cold now).
        self.on_restart: list[Callable[[Instance], None]] = []
        # Told when an instance starts draining (the relay moves streams that would outlive the drain).
        self.on_drain: list[Callable[[str], None]] = []
        self._models = sorted({d.model for d in config.deployments})
        self._states: dict[str, InstanceState] = {}
        self._pollers: dict[str, asyncio.Task[None]] = {}
        self._supervisor: asyncio.Task[None] | None = None
        self._view: FleetView | None = None  # the last `view()` and what it was built from
        self._view_key: tuple[object, ...] = ()
        # Per site, the measured round trip (`site_network_rtt_ms`), kept up to date as probes end
        # (not per request), and a count of its changes (the view's key).
        self._site_rtt_ms: dict[str, float] = {}
        self._site_rtt_changes = 0

    # lifecycle

    async def start(self) -> None:
        """First poll of everything (so the gateway starts with a real view), then poll forever."""
        if self._own_lag:
            self.lag.start()
        self.sync_instances()
        await self.refresh()
        self._supervisor = asyncio.create_task(self._supervise(), name="fleet-state")

    async def stop(self) -> None:
        await cancel_and_wait([self._supervisor, *self._pollers.values()])
        if self._own_lag:
            self.lag.stop()
        self._supervisor = None
        self._pollers.clear()

    def sync_instances(self) -> None:
        """Adapters may launch or stop instances while the gateway runs; follow them."""
        seen: set[str] = set()
        for adapter in self.adapters:
            for inst in adapter.instances:
                seen.add(inst.instance_id)
                st = self._states.get(inst.instance_id)
                if st is None or st.instance != inst:
                    self._states[inst.instance_id] = InstanceState(
                        adapter, inst, added_at=self.clock(),
                        restarts=adapter.restart_counts().get(inst.instance_id, 0))
        for gone in set(self._states) - seen:
            site = self._states.pop(gone).instance.site
            task = self._pollers.pop(gone, None)
            if task is not None:
                task.cancel()
            self._measure_site(site)

    async def refresh(self) -> None:
        await asyncio.gather(*(self.poll_instance(i) for i in list(self._states)))

    async def _supervise(self) -> None:
        while True:
            self.sync_instances()
            for iid in self._states:
                if iid not in self._pollers or self._pollers[iid].done():
                    self._pollers[iid] = asyncio.create_task(self._poll_loop(iid), name=f"poll-{iid}")
            await asyncio.sleep(self.poll_interval_s)

    async def _poll_loop(self, instance_id: str) -> None:
        while instance_id in self._states:
            await asyncio.sleep(self.poll_interval_s)
            await self.poll_instance(instance_id)

    async def poll_instance(self, instance_id: str) -> None:
        st = self._states.get(instance_id)
        if st is None:
            return
        self._follow_restart(st)
        started = self.clock()
        if st.adapter.down(st.instance):
            self._taken_out(st, started, "engine process down (being restarted)")
            return
        try:
            result = await self._timed_probe(st)
        except asyncio.CancelledError:
            raise
        except EngineDown as e:
            self._taken_out(st, started, str(e))
            return
        except Exception as e:  # a broken adapter or engine is a missed check, not a crash
            self._apply(instance_id, started, False, None, f"{type(e).__name__}: {e}")
            return
        if result is None:
            st.last_error = "check stretched by a stalled event loop: not counted"
            log.info("health check of %s not counted: the gateway's event loop was stalled", instance_id)
            return
        healthy, load, round_trip = result
        st.probe_s.append(round_trip)
        self._measure_site(st.instance.site)
        self._apply(instance_id, started, bool(healthy) and load.ready, load,
                    None if healthy and load.ready else "health check failed")

    async def _timed_probe(self, st: InstanceState) -> tuple[bool, LoadSnapshot, float] | None:
        """Health + load within `call_timeout_s` of *responsive* loop time. Raises TimeoutError
        when the engine had that long and did not answer; None when the loop was stalled so
        long the check proves nothing. The loop monitor ticks finely meanwhile (`hold`): an idle
        gateway's monitor ticks every 250 ms, too coarse to tell a stall from a slow engine."""
        self.lag.hold()
        try:
            return await self._timed_probe_held(st)
        finally:
            self.lag.release_hold()

    async def _timed_probe_held(self, st: InstanceState) -> tuple[bool, LoadSnapshot, float] | None:
        loop = asyncio.get_running_loop()
        t0, s0 = loop.time(), self.lag.stalled_s()
        task = loop.create_task(_probe(st, self.clock))
        try:
            while True:
                wall = loop.time() - t0
                left = self.call_timeout_s - (wall - (self.lag.stalled_s() - s0))
                if left <= 0:
                    raise asyncio.TimeoutError(f"no answer in {self.call_timeout_s:g} s")
                cap = _MAX_STRETCH * self.call_timeout_s - wall
                if cap <= 0:
                    return None
                # After a stall the engine still gets the rest of its responsive time.
                await asyncio.wait({task}, timeout=min(left, cap))
                if task.done():
                    return task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=1.0)
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: a late failure of an abandoned check is not news

    def _follow_restart(self, st: InstanceState) -> None:
        n = st.adapter.restart_counts().get(st.instance.instance_id, 0)
        if n == st.restarts:
            return
        st.restarts = n
        # A new process: nothing the old one held or said is true of it.
        self._taken_out(st, self.clock(), f"engine restarted (restart {n})")
        for listener in self.on_restart:
            try:
                listener(st.instance)
            except Exception:
                log.exception("restart listener failed for %s", st.instance.instance_id)

    def _taken_out(self, st: InstanceState, now: float, reason: str) -> None:
        """Certain death: unready at once; only a check started after now brings it back."""
        st.last_poll = now
        st.last_error = reason
        st.failed_at = now
        st.misses = max(st.misses, self.misses_to_unready)
        if st.ready:
            log.warning("instance %s is now unready (%s)", st.instance.instance_id, reason)
        st.ready = False

    def _apply(self, instance_id: str, started: float, ready: bool, load: LoadSnapshot | None,
               error: str | None) -> None:
        st = self._states.get(instance_id)
        if st is None:
            return
        st.last_poll = started
        st.last_error = error
        if load is not None:
            st.load = load
        if not ready:
            st.misses += 1
            if st.ready and st.misses < self.misses_to_unready:
                log.info("instance %s missed a health check (%d of %d before it is taken out): %s",
                         instance_id, st.misses, self.misses_to_unready, error)
                return
            if st.ready:
                st.failed_at = self.clock()
                log.warning("instance %s is now unready after %d missed checks (%s)",
                            instance_id, st.misses, error)
            st.ready = False
            return
        if started < st.failed_at:
            return  # this check began before the failure we saw; wait for a newer one
        st.misses = 0
        if not st.ready:
            log.info("instance %s is now ready", instance_id)
        if st.ready_at is None:
            st.ready_at = started
        st.ready = True

    # used by the relay

    def mark_failed(self, instance_id: str, reason: str) -> None:
        st = self._states.get(instance_id)
        if st is None:
            return
        st.failed_at = self.clock()
        st.last_error = reason
        st.misses = max(st.misses, self.misses_to_unready)
        if st.ready:
            log.warning("instance %s marked unready: %s", instance_id, reason)
        st.ready = False

    def begin(self, instance_id: str) -> int:
        st = self._states.get(instance_id)
        if st is None:
            return 0
        st.inflight += 1
        return st.inflight

    def end(self, instance_id: str) -> int:
        st = self._states.get(instance_id)
        if st is None:
            return 0
        st.inflight = max(0, st.inflight - 1)
        return st.inflight

    # used by the placement loop

    def drain(self, instance_id: str) -> bool:
        """Route nothing new to the instance; False when it is unknown."""
        st = self._states.get(instance_id)
        if st is None:
            return False
        if not st.draining:
            log.info("instance %s draining (%d in flight)", instance_id, st.inflight)
            st.draining = True
            for listener in self.on_drain:
                try:
                    listener(instance_id)
                except Exception:  # a listener's bug must not stop the drain
                    log.exception("drain listener failed")
        return True

    def idle(self, instance_id: str) -> bool:
        """Nothing of ours in flight and, as last scraped, nothing running or waiting on the engine."""
        st = self._states.get(instance_id)
        if st is None:
            return True
        load = st.load
        return st.inflight == 0 and (load is None or load.num_running + load.num_waiting == 0)

    # reading

    def get(self, instance_id: str) -> InstanceState | None:
        return self._states.get(instance_id)

    def states(self) -> list[InstanceState]:
        return list(self._states.values())

    def snapshot(self, instance_id: str) -> InstanceSnapshot | None:
        """One instance as the policies see it (None: not in this fleet)."""
        st = self._states.get(instance_id)
        return instance_snapshot(st) if st is not None else None

    def view(self) -> FleetView:
        """`build_view` of the states now; the previous view again when nothing it is built from
        changed since (a request asks three times: admission, placement, the release's poll)."""
        states = self._states.values()
        # Every input of `instance_snapshot`, per instance in order, and the count of changes to the
        # sites' measured round trips: a view is a pure function of these (and of the config's sites,
        # fixed for this object), so equal keys mean equal views.
        # Tuples compare item by item, identity first: the same Instance and LoadSnapshot objects
        # cost a pointer comparison; `up` asks the adapter, as build_view does.
        key = (self._site_rtt_changes,
               *((st.instance, st.up, st.draining, st.inflight + st.remote_inflight, st.load) for st in states))
        if key != self._view_key or self._view is None:
            self._view = build_view(self.config, states, self._site_rtt_ms)
            self._view_key = key
        return self._view

    def counts(self) -> ReadyCounts:
        """Serving instances; models the fleet file deploys count even when none is known."""
        return ready_counts(self._states.values(), self._models)

    def placement(self) -> dict[tuple[str, str], int]:
        return placement(self.pools())

    def pools(self) -> dict[tuple[str, str, str], PoolCounts]:
        return pool_counts(self._states.values())

    def probe_rtt_ms(self) -> dict[str, float]:
        return site_probe_rtt_ms(self._states.values())

    def network_rtt_s(self, site: str) -> float:
        """The round trip to `site` a request's TTFT holds (`RequestOutcome.network_s`), seconds:
        its probes' lowest recent one (`site_network_rtt_ms`). 0 before any probe answered: then
        the gateway knows nothing of it (its first poll at start measures every instance that
        answers, so that is an instance no request could have reached), and 0 teaches the router
        what it learned before this was measured, never less engine time than there was."""
        ms = self._site_rtt_ms.get(site)
        return ms / 1000.0 if ms is not None else 0.0

    def _measure_site(self, site: str) -> None:
        ms = site_network_rtt_ms(self._states.values(), site)
        if ms == self._site_rtt_ms.get(site):
            return
        if ms is None:
            del self._site_rtt_ms[site]
        else:
            self._site_rtt_ms[site] = ms
        self._site_rtt_changes += 1
