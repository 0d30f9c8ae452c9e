"""How long the gateway's event loop could not run anything: the measure that keeps health
checks honest under load.

A task sleeps `tick_s` at a time; however much later than asked it wakes is time the loop
was blocked (a long tokenization, a GC pause, a burst of callbacks). A health check that
timed out while the loop was blocked says nothing about the engine, so the fleet state
gives each check its deadline in *responsive* loop time (`gateway.fleet_state`).
"""

from __future__ import annotations

import asyncio

from gateway.background import cancel_and_wait


class LoopLagMonitor:
    def __init__(self, tick_s: float = 0.05) -> None:
        self.tick_s = tick_s
        self.stalled_total_s = 0.0  # sum of every tick's lateness since start
        self.max_stall_s = 0.0  # the longest single stall seen
        self._due: float | None = None  # loop time the pending tick should wake at
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-lag")

    async def stop(self) -> None:
        await cancel_and_wait([self._task])
        self._task = None
        self._due = None

    def stalled_s(self) -> float:
        """Blocked time so far, counting the stall in progress (the tick that is overdue now):
        read right after a block ends, before the monitor itself has woken, it is already right."""
        due = self._due
        if due is None:
            return self.stalled_total_s
        try:
            now = asyncio.get_running_loop().time()
        except RuntimeError:  # read from outside the loop (a metrics scrape in a thread)
            return self.stalled_total_s
        return self.stalled_total_s + max(0.0, now - due)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._due = loop.time() + self.tick_s
            await asyncio.sleep(self.tick_s)
            late = max(0.0, loop.time() - self._due)
            self.stalled_total_s += late
            self.max_stall_s = max(self.max_stall_s, late)
