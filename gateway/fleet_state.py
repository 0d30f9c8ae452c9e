"""What the gateway knows about the fleet right now, and the `FleetView` the policies read.

Each instance is polled by its own task (health + load snapshot, with a per-call
timeout), so a hung engine goes unready without delaying anyone else's update.
The gateway also keeps its own in-flight count per instance: engine metrics
lag one scrape, the count does not. An instance being taken out of service (FleetMind's
planner moving a replica) is *draining*: it finishes what it has and gets nothing new.
Each probe's round trip is kept too: the lowest of the last few is the network RTT the
gateway sees to that instance's site (an engine's own work adds to every probe, so the
minimum, not the mean). A failed connection marks an instance
unready at once; only a health check that *started after* the failure may
bring it back (an older, slower check must not undo fresh evidence).
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from engine_adapters.base import EngineAdapter, Instance, LoadSnapshot
from fleetcore.fleet_config import FleetConfig
from fleetcore.types import FleetView, InstanceSnapshot, SiteSnapshot
from gateway.background import cancel_and_wait

log = logging.getLogger("tokenfleet.gateway")


@dataclass(slots=True)
class InstanceState:
    adapter: EngineAdapter
    instance: Instance
    load: LoadSnapshot | None = None
    ready: bool = False
    inflight: int = 0
    failed_at: float = float("-inf")  # clock time of the last failed connection
    last_poll: float | None = None
    last_error: str | None = None
    draining: bool = False
    added_at: float = 0.0  # clock time the gateway first saw it
    ready_at: float | None = None  # clock time of its first ready health check
    probe_s: deque[float] = field(default_factory=lambda: deque(maxlen=8))

    @property
    def probe_rtt_ms(self) -> float | None:
        return 1000 * min(self.probe_s) if self.probe_s else None


# --- pure helpers ---

def instance_snapshot(st: InstanceState) -> InstanceSnapshot:
    inst, load = st.instance, st.load
    return InstanceSnapshot(
        instance_id=inst.instance_id, site=inst.site, model=inst.model, version=inst.version,
        url=inst.url, ready=st.ready, draining=st.draining, inflight=st.inflight,
        num_running=load.num_running if load else 0,
        num_waiting=load.num_waiting if load else 0,
        kv_usage=load.kv_usage if load else 0.0,
        block_size=(load.block_size if load and load.block_size else inst.block_size),
        max_model_len=inst.max_model_len)


def build_view(config: FleetConfig, states: Iterable[InstanceState]) -> FleetView:
    """Sites in fleet-file order; instances of a site the file does not name are left out."""
    by_site: dict[str, list[InstanceSnapshot]] = {s.name: [] for s in config.sites}
    for st in states:
        if st.instance.site in by_site:
            by_site[st.instance.site].append(instance_snapshot(st))
    return FleetView(tuple(
        SiteSnapshot(name=s.name, region=s.region, jurisdiction=s.jurisdiction,
                     rtt_ms=dict(s.rtt_ms),
                     instances=tuple(sorted(by_site[s.name], key=lambda i: i.instance_id)))
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
        elif st.ready:
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
    """Replicas per (site, model), all versions, that serve or are starting; draining ones are on
    their way out."""
    out: dict[tuple[str, str], int] = {}
    for (site, model, _), c in pools.items():
        out[(site, model)] = out.get((site, model), 0) + c.ready + c.starting + c.unready
    return out


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
    ready: int
    total: int
    by_model: dict[str, int] = field(default_factory=dict)
    by_site: dict[str, int] = field(default_factory=dict)


def ready_counts(states: Iterable[InstanceState]) -> ReadyCounts:
    by_model: dict[str, int] = {}
    by_site: dict[str, int] = {}
    ready = total = 0
    for st in states:
        total += 1
        by_model.setdefault(st.instance.model, 0)
        by_site.setdefault(st.instance.site, 0)
        if st.ready:
            ready += 1
            by_model[st.instance.model] += 1
            by_site[st.instance.site] += 1
    return ReadyCounts(ready, total, by_model, by_site)


async def _probe(st: InstanceState) -> tuple[bool, LoadSnapshot]:
    # A coroutine, not a bare gather future, so that cancelling the poll (shutdown, timeout)
    # also collects the gather's result instead of leaving it "never retrieved".
    healthy, load = await asyncio.gather(st.adapter.health(st.instance), st.adapter.snapshot(st.instance))
    return healthy, load


# --- the live state ---

class FleetState:
    def __init__(self, config: FleetConfig, adapters: Sequence[EngineAdapter],
                 poll_interval_s: float = 0.5, call_timeout_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.adapters = list(adapters)
        self.poll_interval_s = poll_interval_s
        # A check slower than this counts as a failed one.
        self.call_timeout_s = call_timeout_s if call_timeout_s is not None else max(1.0, 2 * poll_interval_s)
        self.clock = clock
        self._states: dict[str, InstanceState] = {}
        self._pollers: dict[str, asyncio.Task[None]] = {}
        self._supervisor: asyncio.Task[None] | None = None

    # lifecycle

    async def start(self) -> None:
        """First poll of everything (so the gateway starts with a real view), then poll forever."""
        self.sync_instances()
        await self.refresh()
        self._supervisor = asyncio.create_task(self._supervise(), name="fleet-state")

    async def stop(self) -> None:
        await cancel_and_wait([self._supervisor, *self._pollers.values()])
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
                    self._states[inst.instance_id] = InstanceState(adapter, inst, added_at=self.clock())
        for gone in set(self._states) - seen:
            del self._states[gone]
            task = self._pollers.pop(gone, None)
            if task is not None:
                task.cancel()

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
        started = self.clock()
        try:
            healthy, load = await asyncio.wait_for(_probe(st), self.call_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a broken adapter or engine is an unready instance, not a crash
            self._apply(instance_id, started, False, None, f"{type(e).__name__}: {e}")
            return
        st.probe_s.append(self.clock() - started)
        self._apply(instance_id, started, bool(healthy) and load.ready, load, None)

    def _apply(self, instance_id: str, started: float, ready: bool, load: LoadSnapshot | None,
               error: str | None) -> None:
        st = self._states.get(instance_id)
        if st is None:
            return
        st.last_poll = started
        st.last_error = error
        if load is not None:
            st.load = load
        if ready and started < st.failed_at:
            return  # this check began before the failure we saw; wait for a newer one
        if st.ready != ready:
            log.info("instance %s is now %s%s", instance_id, "ready" if ready else "unready",
                     f" ({error})" if error else "")
        if ready and st.ready_at is None:
            st.ready_at = started
        st.ready = ready

    # used by the relay

    def mark_failed(self, instance_id: str, reason: str) -> None:
        st = self._states.get(instance_id)
        if st is None:
            return
        st.failed_at = self.clock()
        st.last_error = reason
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

    def view(self) -> FleetView:
        return build_view(self.config, self._states.values())

    def counts(self) -> ReadyCounts:
        return ready_counts(self._states.values())

    def placement(self) -> dict[tuple[str, str], int]:
        return placement(self.pools())

    def pools(self) -> dict[tuple[str, str, str], PoolCounts]:
        return pool_counts(self._states.values())

    def probe_rtt_ms(self) -> dict[str, float]:
        return site_probe_rtt_ms(self._states.values())
