"""Routing records shared between gateway replicas: each replica's router hears where the others
dispatched which requests, and when those ended, one period late.

A replica knows exactly what it dispatched; of the others' dispatches it knows only the in-flight
counts (`gateway.load_sync`) and, without engine KV events, nothing of which prompts they placed
where. Each replica therefore appends a small record per dispatch (request key, instance, prompt
tokens, max_tokens, stream or not, at most `MAX_BLOCKS` leading prefix block hashes), per first
token and per end (a release: the key alone) to one Redis stream every `gateway.route_share_s`, in
one pipeline with the read of what the others appended since its last read. The others' records
go to its router through the policy contract (`fleetcore.policies.InstanceRouter`):
`note_dispatch` (priced against this replica's snapshot of the instance), `on_first_token`,
`note_release`. The simulator's replicas (`fleetsim.replicas`) deliver through the same methods,
so live and simulated replicas hear each other the same way. What a router does with them is its
own: TokenPilot books the dispatch as it books its own (backlog, outstanding prefill, streams,
history-mode prefix index); the peers learn the prefix (`note_route`) and take the load from the
in-flight counts.

Bounds: the stream is capped (`MAXLEN ~`); the outbox is bounded (under a burst the oldest unsent
records are dropped: a dispatch not heard, or a release not heard, which the expiry below
covers); the others' dispatches booked in the router are at most `MAX_REMOTE` (the oldest is
released first) and each is released after `REMOTE_TTL_S` at the latest (its replica died, its
release was dropped). Instances with exact KV events need no prefix record (every replica
subscribes to the engines' events); their index ignores remote routes the same way it treats its
own.

Staleness: one period plus a round trip. Redis unreachable: records stay in the bounded outbox,
the others' are not heard, and what was booked for them is released (stale load with no release
to come is worse than none): each replica routes on what it saw itself, as one does.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from fleetcore.policies import InstanceRouter
from fleetcore.types import InstanceSnapshot, RequestProfile
from gateway.background import cancel_and_wait
from gateway.policy_store import StoreUnavailable
from gateway.shared_state import SharedRedis

log = logging.getLogger("tokenfleet.gateway")

MAX_BLOCKS = 256  # leading prefix blocks a shared dispatch carries
OUTBOX = 4096  # records waiting to be sent; more: the oldest are dropped
STREAM_MAXLEN = 20_000  # entries kept in Redis (approximate trim)
READ_COUNT = 2000  # entries read per period at most
MAX_REMOTE = 4096  # the others' dispatches booked in the router at once; more: the oldest is released
REMOTE_TTL_S = 600.0  # a booked dispatch whose release never came is released after this

DISPATCH, FIRST_TOKEN, END = "d", "f", "e"


@dataclass(frozen=True, slots=True)
class Record:
    """One record of another replica: `kind` DISPATCH (every field), FIRST_TOKEN or END (the key)."""

    replica: str
    kind: str
    key: str  # the request id at its replica
    instance_id: str = ""
    prompt_tokens: int = 0
    max_tokens: int | None = None
    stream: bool = False
    block_size: int = 16
    block_hashes: tuple[int, ...] = ()


def encode_dispatch(profile: RequestProfile, instance_id: str, replica_id: str) -> dict[str, str]:
    return {"r": replica_id, "k": DISPATCH, "q": profile.request_id, "i": instance_id,
            "p": str(profile.prompt_tokens), "m": "" if profile.max_tokens is None else str(profile.max_tokens),
            "s": "1" if profile.stream else "0", "b": str(profile.block_size),
            "h": ",".join(map(str, profile.block_hashes[:MAX_BLOCKS]))}


def encode_mark(kind: str, request_id: str, replica_id: str) -> dict[str, str]:
    return {"r": replica_id, "k": kind, "q": request_id}


def decode(fields: dict[str, str]) -> Record | None:
    """The record, or None for an entry that is not one (malformed input is skipped, not trusted)."""
    try:
        kind, replica, key = fields["k"], fields["r"], fields["q"]
        if kind in (FIRST_TOKEN, END):
            return Record(replica, kind, key)
        if kind != DISPATCH:
            return None
        raw, m = fields.get("h", ""), fields.get("m", "")
        rec = Record(replica, kind, key, fields["i"], int(fields["p"]), int(m) if m else None,
                     fields.get("s") == "1", int(fields.get("b", "16")),
                     tuple(int(x) for x in raw.split(",")) if raw else ())
    except (KeyError, ValueError):
        return None
    ok = rec.prompt_tokens >= 0 and rec.block_size > 0 and len(rec.block_hashes) <= MAX_BLOCKS
    return rec if ok else None


class RouteShare:
    """`dispatched` / `first_token` / `ended` from the relay; the exchange runs every `period_s`
    (`start`/`stop`). `snapshot(instance_id)`: this replica's view of an instance (None: unknown)."""

    def __init__(self, shared: SharedRedis, router: InstanceRouter, clock: Callable[[], float],
                 period_s: float, snapshot: Callable[[str], InstanceSnapshot | None]) -> None:
        self.shared = shared
        self.router = router
        self.clock = clock
        self.period_s = period_s
        self.snapshot = snapshot
        self.outbox: deque[dict[str, str]] = deque(maxlen=OUTBOX)
        self.last_id = "$"  # only what is appended after this replica started
        self.heard = 0  # dispatches of other replicas handed to the router, since start
        # The others' dispatches booked in the router (request key at this replica -> when heard),
        # oldest first: what a release, the bound or the expiry releases.
        self.booked: OrderedDict[str, float] = OrderedDict()
        self._task: asyncio.Task[None] | None = None

    def dispatched(self, profile: RequestProfile, instance_id: str) -> None:
        self.outbox.append(encode_dispatch(profile, instance_id, self.shared.replica_id))

    def first_token(self, request_id: str) -> None:
        self.outbox.append(encode_mark(FIRST_TOKEN, request_id, self.shared.replica_id))

    def ended(self, request_id: str) -> None:
        self.outbox.append(encode_mark(END, request_id, self.shared.replica_id))

    async def exchange(self) -> int:
        """Send the outbox, read the others' new records; the dispatches heard. StoreUnavailable on failure."""
        s = self.shared
        key = s.key("routes")
        if self.last_id == "$":  # the stream's current end, so the first read gets only what follows
            info = await s.call("route_share", s.redis.xrevrange(key, count=1))
            self.last_id = info[0][0] if info else "0-0"
        sending = list(self.outbox)
        pipe = s.redis.pipeline(transaction=False)
        for fields in sending:
            pipe.xadd(key, fields, maxlen=STREAM_MAXLEN, approximate=True)
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
                if rec is not None and rec.replica != s.replica_id:
                    heard += self._hear(rec, now)
        self._expire(now)
        self.heard += heard
        return heard

    def _hear(self, rec: Record, now: float) -> int:
        rid = f"{rec.replica}/{rec.key}"  # namespaced: never one of this replica's own request ids
        if rec.kind == FIRST_TOKEN:
            if rid in self.booked:
                self.router.on_first_token(rid, now)
            return 0
        if rec.kind == END:
            if self.booked.pop(rid, None) is not None:
                self.router.note_release(rid, now)
            return 0
        snap = self.snapshot(rec.instance_id)
        if snap is None:  # an instance this replica does not know (yet): nothing to book it on
            return 0
        profile = RequestProfile(request_id=rid, model=snap.model, prompt_tokens=rec.prompt_tokens,
                                 block_hashes=rec.block_hashes, block_size=rec.block_size,
                                 max_tokens=rec.max_tokens, stream=rec.stream, arrival=now)
        self.router.note_dispatch(profile, snap, now)  # a retry elsewhere: the router releases the earlier one
        self.booked[rid] = now
        self.booked.move_to_end(rid)
        while len(self.booked) > MAX_REMOTE:
            self.router.note_release(self.booked.popitem(last=False)[0], now)
        return 1

    def _expire(self, now: float) -> None:
        while self.booked:
            rid, heard_at = next(iter(self.booked.items()))
            if now - heard_at <= REMOTE_TTL_S:
                break
            del self.booked[rid]
            self.router.note_release(rid, now)

    def release_all(self) -> None:
        """Redis unreachable: what was booked for the others is released (no release would come)."""
        now = self.clock()
        while self.booked:
            self.router.note_release(self.booked.popitem(last=False)[0], now)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="route-share")

    async def _run(self) -> None:
        while True:
            try:
                await self.exchange()
            except StoreUnavailable:
                self.release_all()  # counted and logged by SharedRedis; the outbox waits (bounded)
            except Exception:  # a bug must not end the exchange: the next period tries again
                log.exception("route sharing failed")
            await asyncio.sleep(self.period_s)

    async def stop(self) -> None:
        await cancel_and_wait([self._task])
        self._task = None
