"""Carry engines' KV cache events to the router's cache index (TokenPilot's exact mode).

One follower task per instance whose adapter publishes events. A stream that
breaks (engine restart, network) is re-opened with backoff; while it is down the
router's index ages the instance back to its approximate mode by itself.

That fallback is silent in routing (decisions go on, with less cache affinity), so the feed says
so to the operator: each batch applied and each interruption is counted per instance
(`KVFeedMetrics`: `tokenfleet_kv_event_batches_total`, `tokenfleet_kv_feed_interruptions_total`
by reason, `ended` when the engine closed the stream, `error` when it broke or sent what could not
be read), and the first interruption of a run is a warning, its recovery an info line.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from fleetcore.policies import InstanceRouter
from gateway.background import cancel_and_wait
from gateway.fleet_state import FleetState

log = logging.getLogger("tokenfleet.gateway")

BACKOFF_S = (0.5, 1.0, 2.0, 5.0)


class KVFeedMetrics(Protocol):
    """What the feed reports (`gateway.metrics.GatewayMetrics` implements it)."""

    def kv_batch(self, instance: str) -> None: ...

    def kv_interrupted(self, instance: str, reason: str) -> None: ...


class _Unreported:
    def kv_batch(self, instance: str) -> None:
        return None

    def kv_interrupted(self, instance: str, reason: str) -> None:
        return None


class KVEventFeed:
    def __init__(self, state: FleetState, sink: InstanceRouter, clock: Callable[[], float],
                 resync_s: float = 1.0, metrics: KVFeedMetrics | None = None) -> None:
        self.state = state
        self.sink = sink
        self.clock = clock
        self.resync_s = resync_s
        self.metrics: KVFeedMetrics = metrics if metrics is not None else _Unreported()
        self.batches = 0
        self._followers: dict[str, asyncio.Task[None]] = {}
        self._supervisor: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._supervisor = asyncio.create_task(self._supervise(), name="kv-feed")

    async def stop(self) -> None:
        await cancel_and_wait([self._supervisor, *self._followers.values()])
        self._followers.clear()

    async def _supervise(self) -> None:
        while True:
            live = {st.instance.instance_id: st for st in self.state.states()}
            for iid, task in list(self._followers.items()):
                if iid not in live:
                    task.cancel()
                    del self._followers[iid]
            for iid, st in live.items():
                if iid not in self._followers or self._followers[iid].done():
                    if st.adapter.kv_events(st.instance) is not None:
                        self._followers[iid] = asyncio.create_task(self._follow(iid), name=f"kv-{iid}")
            await asyncio.sleep(self.resync_s)

    async def _follow(self, instance_id: str) -> None:
        failures = 0
        metrics = self.metrics
        while True:
            st = self.state.get(instance_id)
            if st is None:
                return
            stream = st.adapter.kv_events(st.instance)
            if stream is None:
                return
            reason, detail = "ended", "the engine closed the stream"
            try:
                async for batch in stream:
                    if failures:
                        log.info("kv events from %s resumed", instance_id)
                        failures = 0
                    self.batches += 1
                    self.sink.observe_kv_events(instance_id, batch.seq, batch.events, self.clock())
                    metrics.kv_batch(instance_id)
                    # Batches the stream has buffered come without a suspension point, so a
                    # burst of them (thousands of blocks each) would hold the loop for all of
                    # them in one step: each batch is one step instead (issue 14).
                    await asyncio.sleep(0)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                reason, detail = "error", f"{type(e).__name__}: {e}"
            metrics.kv_interrupted(instance_id, reason)
            # One warning per run of failures (an engine that is down fails every backoff)
            (log.debug if failures else log.warning)(
                "kv events from %s interrupted (%s); its cache index falls back to approximate until "
                "they resume", instance_id, detail[:200])
            await asyncio.sleep(BACKOFF_S[min(failures, len(BACKOFF_S) - 1)])
            failures += 1
