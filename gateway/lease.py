"""The planner leader lease: only the replica holding it runs the placement planner.

Acquire: one Lua script does `SET key holder NX PX ttl` and, when that took, `INCR` of a
fence counter, storing `holder:fence` as the lease value — so every new hold has a
fencing token strictly greater than all before it (they come from one counter in the
same atomic step). Renew: a compare-and-renew script extends the TTL only if the value is
still this holder's; release: compare-and-delete. No home-made consensus: Redis orders it.

A holder stops acting *before* its lease can run out in Redis: `leader` is true only until
`sent + ttl_s * SAFETY`, where `sent` is the local monotonic time the last successful
acquire/renew was *sent* (Redis started the TTL no earlier than that). A renewal that fails
or times out (bounded by `store_timeout_s`) does not extend it, and a renewal that finds the
key gone or someone else's ends the hold at once. So two replicas never act at once unless
a clock runs more than (1 - SAFETY) fast over one TTL, and a dead holder is replaced within
ttl + one renew period.

The holder publishes its planner report (`publish`) with each renewal; other replicas read
it (`holder_report`) so `GET /admin/v1/planner` shows the same log on any replica. Without
Redis there is no lease object: the single replica is the leader.

Fencing where moves are carried out (`fenced`): before the planner's executor
(`gateway.placement`) starts, drains or stops a replica, one script compares this hold's
value (`holder:fence`) with the lease key and its token with the fence counter, and in the
same atomic step appends the move to a capped audit stream (who, what, under which token,
accepted or refused). It also asks that the hold have `FENCE_MARGIN` of its TTL left in Redis,
so no other replica can take over for that long after an accepted answer (the step starts
at once; what the engine then does is not fenced: adapters take no token). A deposed leader whose local clock still trusts its hold (paused,
partitioned, its renewals held up) is refused there: the check and the record cannot be
separated by another replica's takeover. Redis unreachable: refused (fails closed).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.background import cancel_and_wait
from gateway.policy_store import StoreUnavailable
from gateway.shared_state import SharedRedis

log = logging.getLogger("tokenfleet.gateway")

SAFETY = 0.8  # share of the TTL a holder trusts its hold for (local clock drift, scheduling delay)

_ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local fence = redis.call('INCR', KEYS[2])
  redis.call('SET', KEYS[1], ARGV[1] .. ':' .. fence, 'PX', ARGV[2])
  return fence
end
return 0
"""
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: lease, fence counter, move log. ARGV: this hold's value, its fence, holder, kind, target,
# detail, log length, least time left (ms). Accepted only while the lease is this hold's, its token
# the newest issued, and the hold has that long left in Redis (no takeover can follow the answer
# sooner: the step starts well within it).
_FENCED = """
local cur = redis.call('GET', KEYS[1])
local newest = tonumber(redis.call('GET', KEYS[2]) or '0')
local ok = cur == ARGV[1] and tonumber(ARGV[2]) == newest and redis.call('PTTL', KEYS[1]) >= tonumber(ARGV[8])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[7], '*', 'holder', ARGV[3], 'fence', ARGV[2],
           'kind', ARGV[4], 'target', ARGV[5], 'detail', ARGV[6], 'outcome', ok and 'accepted' or 'refused',
           'current', cur or '', 'newest', tostring(newest))
if ok then return 1 end
return 0
"""
FENCE_MARGIN = 0.2  # share of the TTL a hold must have left in Redis for a move to be accepted
MOVE_LOG_LEN = 1000  # audit entries kept (approximately: XADD MAXLEN ~)
MOVES_SHOWN = 50  # the newest ones each replica keeps for `GET /admin/v1/planner`


class LeaderLease:
    def __init__(self, shared: SharedRedis, name: str = "planner", *, ttl_s: float | None = None,
                 renew_s: float | None = None, clock: Callable[[], float] = time.monotonic,
                 report: Callable[[], dict[str, Any]] | None = None) -> None:
        self.shared = shared
        self.ttl_s = ttl_s if ttl_s is not None else shared.settings.lease_ttl_s
        self.renew_s = renew_s if renew_s is not None else shared.settings.lease_renew_s
        if self.renew_s * 3 > self.ttl_s * (1 + 1e-9):
            raise ValueError("renew at most every third of the lease TTL")
        self.clock = clock
        self.report = report  # this replica's planner report, published while it leads
        self.key = shared.key("lease", name)
        self.fence_key = shared.key("lease", name, "fence")
        self.report_key = shared.key("lease", name, "report")
        self.moves_key = shared.key("lease", name, "moves")  # the fenced moves' audit stream
        self.holder = shared.replica_id
        self.fence = 0  # the fencing token of the current (or last) hold
        self._value: str | None = None  # the lease value while held
        self._valid_until = 0.0  # local monotonic time the hold is trusted until
        self._acquire = shared.redis.register_script(_ACQUIRE)
        self._renew = shared.redis.register_script(_RENEW)
        self._release = shared.redis.register_script(_RELEASE)
        self._fenced = shared.redis.register_script(_FENCED)
        self.refused = 0  # moves refused by the fence (this replica)
        self.recent_moves: list[dict[str, str]] = []  # the audit stream's newest, as last read
        self._task: asyncio.Task[None] | None = None
        self.changed = asyncio.Event()  # set on every gain or loss (tests, logs)
        self._was_leader = False
        self.remote: dict[str, Any] | None = None  # the holder's published report (on other replicas)

    @property
    def leader(self) -> bool:
        return self._value is not None and self.clock() < self._valid_until

    async def tick(self) -> bool:
        """Acquire or renew once; True while this replica holds the lease."""
        ttl_ms = round(self.ttl_s * 1000)
        sent = self.clock()
        try:
            if self._value is not None:
                kept = int(await self.shared.call("lease", self._renew(keys=[self.key], args=[self._value, ttl_ms])))
                if kept:
                    self._valid_until = sent + self.ttl_s * SAFETY
                else:
                    log.warning("planner lease %d lost (expired or taken over)", self.fence)
                    self._value = None
            if self._value is None:
                fence = int(await self.shared.call("lease", self._acquire(keys=[self.key, self.fence_key],
                                                                          args=[self.holder, ttl_ms])))
                if fence:
                    self.fence = fence
                    self._value = f"{self.holder}:{fence}"
                    self._valid_until = sent + self.ttl_s * SAFETY
                    log.warning("planner lease acquired (fencing token %d): this replica runs the planner", fence)
        except StoreUnavailable:
            pass  # the hold is trusted only until _valid_until; not extended
        self._note()
        return self.leader

    async def fenced(self, kind: str, target: str, detail: str = "") -> bool:
        """May this replica carry out the move now? Checked and recorded atomically in Redis
        against the current lease and fence counter; False (and logged) when it is not the
        current holder, or when Redis does not answer."""
        value = f"{self.holder}:{self.fence}"  # what the lease holds while this hold is current
        keys = [self.key, self.fence_key, self.moves_key]
        args = [value, self.fence, self.holder, kind, target, detail, MOVE_LOG_LEN,
                round(self.ttl_s * FENCE_MARGIN * 1000)]
        try:
            ok = bool(int(await self.shared.call("lease_fence", self._fenced(keys=keys, args=args))))
        except StoreUnavailable as e:
            ok, why = False, str(e)
        else:
            why = "another replica holds the planner lease now, or this hold expired or is about to"
        if not ok:
            self.refused += 1
            log.warning("planner move refused by the fence: %s %s under token %d: %s", kind, target, self.fence, why)
        return ok

    async def moves(self, limit: int = 200) -> list[dict[str, str]]:
        """The fenced moves' audit log, newest first: holder, fence, kind, target, detail, outcome."""
        rows = await self.shared.call("lease_moves", self.shared.redis.xrevrange(self.moves_key, count=limit))
        return [{"id": rid, **fields} for rid, fields in rows]

    async def refresh_moves(self) -> None:
        """Read the newest fenced moves for the admin API (each lease period; kept when Redis is down)."""
        self.recent_moves = await self.moves(MOVES_SHOWN)

    def _note(self) -> None:
        now = self.leader
        if now != self._was_leader:
            self._was_leader = now
            self.changed.set()

    async def publish(self) -> None:
        if self.report is None or not self.leader:
            return
        body = json.dumps({"leader": self.holder, "fence": self.fence, "published_unix": time.time(),
                           **self.report()})
        await self.shared.call("lease_report", self.shared.redis.set(self.report_key, body,
                                                                     px=round(self.ttl_s * 3000)))

    async def fetch_remote(self) -> None:
        raw = await self.shared.call("lease_report", self.shared.redis.get(self.report_key))
        try:
            self.remote = json.loads(raw) if raw else None
        except ValueError:
            self.remote = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"lease-{self.key}")

    async def _run(self) -> None:
        while True:
            try:
                if await self.tick():
                    await self.publish()
                else:
                    await self.fetch_remote()
                await self.refresh_moves()
            except StoreUnavailable:
                pass
            except Exception:  # a bug must not end the lease loop (it only fails to act, never acts twice)
                log.exception("planner lease loop failed")
            # Wake in time to renew, and also when the trusted hold ends, so `changed` fires promptly.
            wait = self.renew_s
            if self._value is not None:
                wait = max(0.0, min(wait, self._valid_until - self.clock()))
            await asyncio.sleep(wait if wait > 0 else self.renew_s)
            self._note()

    async def stop(self, release: bool = True) -> None:
        await cancel_and_wait([self._task])
        self._task = None
        value, self._value = self._value, None
        self._note()
        if release and value is not None:
            try:  # hand over now rather than after the TTL
                await self.shared.call("lease", self._release(keys=[self.key], args=[value]))
            except StoreUnavailable:
                pass

    def metrics(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("tokenfleet_planner_leader", "1 while this replica holds the planner lease",
                                value=1.0 if self.leader else 0.0)
        yield GaugeMetricFamily("tokenfleet_planner_lease_fence", "Fencing token of this replica's last hold",
                                value=float(self.fence))
        yield CounterMetricFamily("tokenfleet_planner_moves_refused", "Planner moves the fencing token refused",
                                  value=float(self.refused))
