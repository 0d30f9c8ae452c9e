"""Carry engines' KV cache events to the router's cache index (TokenPilot's exact mode).

One follower task per instance whose adapter publishes events. A stream that
breaks (engine restart, network) is re-opened with backoff; while it is down the
router's index ages the instance back to its approximate mode by itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from fleetcore.policies import InstanceRouter
from gateway.background import cancel_and_wait
from gateway.fleet_state import FleetState

log = logging.getLogger("tokenfleet.gateway")

BACKOFF_S = (0.5, 1.0, 2.0, 5.0)


class KVEventFeed:
    def __init__(self, state: FleetState, sink: InstanceRouter, clock: Callable[[], float],
                 resync_s: float = 1.0) -> None:
        self.state = state
        self.sink = sink
        self.clock = clock
        self.resync_s = resync_s
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
        while True:
            st = self.state.get(instance_id)
            if st is None:
                return
            stream = st.adapter.kv_events(st.instance)
            if stream is None:
                return
            try:
                async for batch in stream:
                    failures = 0
                    self.batches += 1
                    self.sink.observe_kv_events(instance_id, batch.seq, batch.events, self.clock())
                    # Batches the stream has buffered come without a suspension point, so a
                    # burst of them (thousands of blocks each) would hold the loop for all of
                    # them in one step: each batch is one step instead (issue 14).
                    await asyncio.sleep(0)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.debug("kv events from %s interrupted: %s", instance_id, e)
            await asyncio.sleep(BACKOFF_S[min(failures, len(BACKOFF_S) - 1)])
            failures += 1
