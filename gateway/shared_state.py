"""State several gateway replicas share through one Redis: the connection, the replica roster, metrics.

Each kind of state has its own module and mechanism (README "Several replicas"):
budgets (`gateway.budget_store`), goodput ledger (`gateway.ledger_sync`), admin state
(`gateway.admin_store`), planner lease (`gateway.lease`). This module holds what they
share:

- one bounded redis-py client: a connect timeout and one deadline of `gateway.store_timeout_s`
  over every call (`asyncio.timeout`, in the caller's task: no socket read timeout on top, no
  extra task per call as `wait_for` makes on 3.11; both were measured on the admission path),
  no retries inside redis-py, a bounded pool; every failure is `StoreUnavailable` (the same
  contract as the policy store);
- the roster: every replica announces itself each `replica_heartbeat_s` in a sorted set
  scored by Redis server time (`TIME`, so replicas' clocks never need to agree); an entry
  older than `replica_ttl_s` is a replica that is gone. `live` is the count the budgets'
  local share divides by;
- `up`: whether Redis answered the last call. A failure flips it at once, so the admission
  path stops paying the timeout; the heartbeat probes and flips it back;
- the last known roster count on local disk (`RosterFile`, under the state dir), written while
  Redis answers: a replica (re)started while Redis is down takes `live` from it, so it enforces
  budget / that count rather than the whole budget as if it were alone. A count older than
  `ROSTER_MAX_AGE_S` is not trusted (the fleet may have been resized since): then 1, logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fleetcore.fleet_config import GatewaySettings
from gateway.background import cancel_and_wait
from gateway.policy_snapshot import write_atomic
from gateway.policy_store import StoreUnavailable

log = logging.getLogger("tokenfleet.gateway")
_T = TypeVar("_T")

# Announce this replica (score: server time in ms), drop the ones not heard of within the TTL,
# count the rest. One round trip; server time so that skewed replica clocks cannot disagree.
_HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
redis.call('PEXPIRE', KEYS[1], ARGV[2] * 10)
return redis.call('ZCARD', KEYS[1])
"""


ROSTER_REFRESH_S = 60.0  # an unchanged count is rewritten this often (so its age says it is current)
ROSTER_MAX_AGE_S = 3600.0  # an older count is not trusted at a start without Redis


class RosterFile:
    """The last replica count Redis gave, on local disk: `{"live": n, "saved_unix": t}`."""

    def __init__(self, path: Path, *, max_age_s: float = ROSTER_MAX_AGE_S, refresh_s: float = ROSTER_REFRESH_S,
                 wall: Callable[[], float] = time.time) -> None:
        self.path = path
        self.max_age_s = max_age_s
        self.refresh_s = refresh_s
        self.wall = wall  # wall clock: the age must survive a restart (a monotonic clock does not)
        self._written: tuple[int, float] | None = None  # (count, when) last written by this process

    def read(self) -> int | None:
        """The stored count, or None when there is none, it is unreadable, or older than `max_age_s`."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            live, saved = int(data["live"]), float(data["saved_unix"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError) as e:
            log.error("replica roster: cannot read %s (%s)", self.path, e)
            return None
        age = self.wall() - saved
        if not -5.0 <= age <= self.max_age_s or live < 1:  # a few seconds of clock step back allowed
            log.warning("replica roster: the last known count (%d, %.0f s old) is outside %.0f s; not used",
                        live, age, self.max_age_s)
            return None
        return live

    async def note(self, live: int) -> None:
        """Store `live` when it changed or the stored one is `refresh_s` old (off the loop; errors logged)."""
        now = self.wall()
        if self._written is not None and self._written[0] == live and now - self._written[1] < self.refresh_s:
            return
        body = json.dumps({"live": live, "saved_unix": now})
        try:
            await asyncio.to_thread(write_atomic, self.path, body)
        except OSError as e:
            log.error("replica roster: cannot write %s (%s)", self.path, e)
            return
        self._written = (live, now)


def new_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class SharedRedis:
    """The replicas' shared Redis, with the roster heartbeat (`start`/`stop`)."""

    def __init__(self, url: str, settings: GatewaySettings, *, replica_id: str | None = None,
                 roster_file: RosterFile | None = None) -> None:
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.url = url
        self.settings = settings
        self.timeout_s = settings.store_timeout_s
        self.prefix = settings.redis_prefix
        self.replica_id = replica_id or new_replica_id()
        # One attempt per deadline (the loops are the retry); a bounded pool: when every connection
        # is stuck the next call fails instead of queueing behind them. Reads are bounded by `call`'s
        # deadline, not a socket timeout: redis-py arms a second timer around every read for that.
        self.redis = aioredis.from_url(url, decode_responses=True, socket_connect_timeout=self.timeout_s,
                                       retry=Retry(NoBackoff(), 0), max_connections=64)
        self.up = False  # until the first heartbeat answers
        self.live = 1  # replicas alive, this one included (the last count Redis gave)
        self.roster_file = roster_file  # where that count outlives this process
        self.errors: dict[str, int] = {}  # failed calls by operation, since start
        self._heartbeat = self.redis.register_script(_HEARTBEAT)
        self._task: asyncio.Task[None] | None = None
        self.on_beat: list[Callable[[], Coroutine[Any, Any, None]]] = []  # run after each beat (stream counts)

    def key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    async def call(self, op: str, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run one Redis operation within `store_timeout_s`; StoreUnavailable on any failure."""
        from redis.exceptions import RedisError

        try:
            async with asyncio.timeout(self.timeout_s):  # the one deadline (see the module docstring)
                result = await coro
        except TimeoutError:
            self._failed(op, f"no answer within {self.timeout_s:g} s")
            raise StoreUnavailable(f"shared state: {op}: no answer within {self.timeout_s:g} s") from None
        except (RedisError, OSError) as e:
            self._failed(op, f"{type(e).__name__}: {e}")
            raise StoreUnavailable(f"shared state: {op}: {type(e).__name__}: {e}") from None
        self.up = True
        return result

    def _failed(self, op: str, why: str) -> None:
        self.errors[op] = self.errors.get(op, 0) + 1
        if self.up:
            log.warning("shared state: Redis unavailable (%s: %s); replicas fall back to local state", op, why)
        self.up = False

    async def beat(self) -> int:
        ttl_ms = round(self.settings.replica_ttl_s * 1000)
        was_up = self.up
        live = int(await self.call("heartbeat", self._heartbeat(keys=[self.key("replicas")],
                                                                 args=[self.replica_id, ttl_ms])))
        if not was_up:
            log.warning("shared state: Redis reachable; %d replica(s) live", live)
        self.live = max(1, live)
        if self.roster_file is not None:
            await self.roster_file.note(self.live)
        return self.live

    async def start(self) -> None:
        try:
            await self.beat()  # bounded by store_timeout_s: a down Redis does not hold up the start
        except StoreUnavailable:
            known = self.roster_file.read() if self.roster_file is not None else None
            if known is not None:  # not alone: the others are most likely still serving
                self.live = known
            log.warning("shared state: Redis unreachable at start; assuming %d replica(s) live (%s)", self.live,
                        "the last count known here" if known is not None else "no recent count known here")
        self._task = asyncio.create_task(self._run(), name="replica-heartbeat")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.replica_heartbeat_s)
            try:
                await self.beat()
                for hook in self.on_beat:
                    await hook()
            except StoreUnavailable:
                pass  # already counted and logged; the next beat probes again
            except Exception:  # a bug must not end the roster: the next beat tries again
                log.exception("replica heartbeat failed")

    async def stop(self) -> None:
        await cancel_and_wait([self._task])
        self._task = None
        try:  # leave the roster at once, so the others' shares grow now rather than after the TTL
            await self.call("leave", self.redis.zrem(self.key("replicas"), self.replica_id))
        except StoreUnavailable:
            pass
        await self.redis.aclose()


class SharedStateCollector(Collector):
    """tokenfleet_budget_mode{mode}, tokenfleet_shared_state_up, tokenfleet_replicas_live,
    tokenfleet_shared_state_errors_total{op}, and whatever `extra` adds (the lease)."""

    def __init__(self, shared: SharedRedis | None, budgets: Any = None,
                 extra: list[Callable[[], Iterator[Metric]]] | None = None) -> None:
        self.shared = shared
        self.budgets = budgets  # gateway.budget_store.SharedBudgets, or None
        self.extra = extra if extra is not None else []

    def collect(self) -> Iterator[Metric]:
        mode = GaugeMetricFamily("tokenfleet_budget_mode", "How tenant budgets are enforced now (1: this mode): "
                                 "shared (exact in Redis), local_share (budget / live replicas), local (one replica)",
                                 labels=["mode"])
        current = self.budgets.mode if self.budgets is not None else "local"
        for m in ("shared", "local_share", "local"):
            mode.add_metric([m], 1.0 if m == current else 0.0)
        yield mode
        s = self.shared
        yield GaugeMetricFamily("tokenfleet_shared_state_up", "Whether the shared Redis answered the last call",
                                value=1.0 if s is not None and s.up else 0.0)
        yield GaugeMetricFamily("tokenfleet_replicas_live", "Gateway replicas alive (heartbeat roster)",
                                value=float(s.live if s is not None else 1))
        errors = CounterMetricFamily("tokenfleet_shared_state_errors", "Failed shared-state calls", labels=["op"])
        for op, n in sorted((s.errors if s is not None else {}).items()):
            errors.add_metric([op], float(n))
        yield errors
        for more in self.extra:
            yield from more()
