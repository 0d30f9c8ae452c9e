"""Routing records shared between gateway replicas: the history-mode prefix index of each replica
learns where the others sent which prompts.

Without engine KV events the router estimates each instance's cache from where it sent
prompts (history mode). With several replicas each would see only its own share of the
traffic and miss the prefixes the others placed. Each replica therefore appends its routes
(instance, leading prefix block hashes) to one Redis stream every `gateway.route_share_s`,
in one pipeline with the read of what the others appended since its last read, and hands
those to its router (`InstanceRouter.note_route`). The stream is capped (`MAXLEN ~`), a
route carries at most `MAX_BLOCKS` leading blocks (the shared prefix is what matters), and
the outbox is bounded: under a burst the oldest unsent routes are dropped, which only makes
the index a little less complete. Instances with exact KV events need none of this (every
replica subscribes to the engines' events); their index ignores remote routes the same way it
treats its own.

Staleness: one period plus a round trip. Redis unreachable: routes stay in the bounded
outbox, the others' are not heard; each replica routes on what it saw itself, as one does.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence

from fleetcore.policies import InstanceRouter
from gateway.background import cancel_and_wait
from gateway.policy_store import StoreUnavailable
from gateway.shared_state import SharedRedis

log = logging.getLogger("tokenfleet.gateway")

MAX_BLOCKS = 256  # leading prefix blocks a shared route carries
OUTBOX = 4096  # routes waiting to be sent; more: the oldest are dropped
STREAM_MAXLEN = 20_000  # entries kept in Redis (approximate trim)
READ_COUNT = 2000  # entries read per period at most


def encode(instance_id: str, block_hashes: Sequence[int], replica_id: str) -> dict[str, str]:
    return {"r": replica_id, "i": instance_id, "h": ",".join(map(str, block_hashes[:MAX_BLOCKS]))}


def decode(fields: dict[str, str]) -> tuple[str, str, list[int]] | None:
    """(replica, instance, block hashes), or None for an entry that is not one of ours."""
    try:
        raw = fields.get("h", "")
        return fields["r"], fields["i"], [int(x) for x in raw.split(",")] if raw else []
    except (KeyError, ValueError):
        return None


class RouteShare:
    """`routed(instance, hashes)` from the relay; the exchange runs every `period_s` (`start`/`stop`)."""

    def __init__(self, shared: SharedRedis, router: InstanceRouter, clock: Callable[[], float],
                 period_s: float) -> None:
        self.shared = shared
        self.router = router
        self.clock = clock
        self.period_s = period_s
        self.outbox: deque[tuple[str, tuple[int, ...]]] = deque(maxlen=OUTBOX)
        self.last_id = "$"  # only what is appended after this replica started
        self.heard = 0  # routes of other replicas handed to the router, since start
        self._task: asyncio.Task[None] | None = None

    def routed(self, instance_id: str, block_hashes: Sequence[int]) -> None:
        if block_hashes:
            self.outbox.append((instance_id, tuple(block_hashes[:MAX_BLOCKS])))

    async def exchange(self) -> int:
        """Send the outbox, read the others' new routes; the number heard. StoreUnavailable on failure."""
        s = self.shared
        key = s.key("routes")
        if self.last_id == "$":  # the stream's current end, so the first read gets only what follows
            info = await s.call("route_share", s.redis.xrevrange(key, count=1))
            self.last_id = info[0][0] if info else "0-0"
        sending = list(self.outbox)
        pipe = s.redis.pipeline(transaction=False)
        for iid, hashes in sending:
            pipe.xadd(key, encode(iid, hashes, s.replica_id), maxlen=STREAM_MAXLEN, approximate=True)
        pipe.xread({key: self.last_id}, count=READ_COUNT)
        results = await s.call("route_share", pipe.execute())
        for _ in sending:  # sent: drop exactly those (new ones may have been appended meanwhile)
            self.outbox.popleft()
        heard = 0
        now = self.clock()
        for _stream, entries in results[-1] or []:
            for entry_id, fields in entries:
                self.last_id = entry_id
                rec = decode(fields)
                if rec is None or rec[0] == s.replica_id:
                    continue
                self.router.note_route(rec[1], rec[2], now)
                heard += 1
        self.heard += heard
        return heard

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="route-share")

    async def _run(self) -> None:
        while True:
            try:
                await self.exchange()
            except StoreUnavailable:
                pass  # counted and logged by SharedRedis; the outbox waits (bounded)
            except Exception:  # a bug must not end the exchange: the next period tries again
                log.exception("route sharing failed")
            await asyncio.sleep(self.period_s)

    async def stop(self) -> None:
        await cancel_and_wait([self._task])
        self._task = None
