"""KV event batches that an engine's stream has buffered are applied one per event-loop step
(issue 14): a burst of them (thousands of blocks each, after a burst of long prompts) used to
run in a single step and hold the loop 5-25 ms.

The feed follows a stub stream that yields its batches without ever suspending (as a stream
over an already-filled buffer does); another task on the same loop records when it runs. If
the feed applied several batches in one step, two of them would be adjacent in the record.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

from engine_adapters.base import KVEventBatch
from gateway.kv_feed import KVEventFeed

BATCHES = 6


async def test_buffered_kv_batches_are_applied_one_per_loop_step() -> None:
    order: list[str] = []
    all_applied = asyncio.Event()

    class Sink:
        def observe_kv_events(self, instance_id: str, seq: int, events: Sequence[Mapping[str, Any]],
                              now: float) -> None:
            order.append(f"batch {seq}")
            if seq == BATCHES - 1:
                all_applied.set()

    async def stream() -> AsyncIterator[KVEventBatch]:
        for seq in range(BATCHES):  # all buffered: no suspension point between them
            yield KVEventBatch("a", seq, [{"type": "BlockStored", "block_hashes": [seq]}])
        await asyncio.Event().wait()  # the stream stays open, as an engine's does

    st = SimpleNamespace(instance=SimpleNamespace(instance_id="a"),
                         adapter=SimpleNamespace(kv_events=lambda instance: stream()))
    state = SimpleNamespace(get=lambda instance_id: st, states=lambda: [st])
    feed = KVEventFeed(state, Sink(), clock=lambda: 0.0)  # type: ignore[arg-type]

    async def other_work() -> None:
        while not all_applied.is_set():
            order.append("other")
            await asyncio.sleep(0)

    follower = asyncio.create_task(feed._follow("a"))
    other = asyncio.create_task(other_work())
    try:
        await asyncio.wait_for(all_applied.wait(), 5)
    finally:
        follower.cancel()
        await asyncio.gather(follower, other, return_exceptions=True)
    batches = [e for e in order if e.startswith("batch")]
    assert batches == [f"batch {k}" for k in range(BATCHES)]
    assert feed.batches == BATCHES
    adjacent = [(a, b) for a, b in zip(order, order[1:]) if a.startswith("batch") and b.startswith("batch")]
    assert not adjacent, order
