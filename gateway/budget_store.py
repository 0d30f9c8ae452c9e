"""Tenant budgets (and API keys' own, `gateway.key_budgets`) exact across gateway replicas: one
atomic Redis script per admission.

The same semantics as SLOMax's local budgets (`slomax.budgets`): requests/min and
tokens/min are token buckets holding at most a minute's allowance, refilled linearly,
their level computed from the last charge; concurrent streams are a count. Here the
buckets live in one Redis hash per tenant and every check-and-charge is one Lua script
(`EVALSHA`, a single round trip on the admission path): Redis runs scripts one at a time,
so no two replicas can both take the last unit. The script reads Redis server time, so
replicas' clocks never need to agree.

Give-backs (unused tokens, the stream's slot) leave the request's path: `settle` queues them
(bounded) and one background flush sends everything queued since the last one as one
pipeline every `SETTLE_TICK_S`, so the admission call neither shares the loop with one
round trip per finished request nor waits behind them for a pooled connection.

Streams are counted per replica (a hash field per replica id); the script sums only
fields of replicas alive in the roster (`gateway.shared_state`), so a replica that died
with streams open stops holding them within `replica_ttl_s`, and each replica rewrites
its own field with its true count every heartbeat (repairing a settlement that was lost).
That rewrite must not race this replica's own changes to the field: a count read before an
acquire's or a settlement's change landed, and written after it, undid it until the next
heartbeat (a stream uncounted: one tenant past its `concurrent_streams` across the fleet;
`tests/test_shared_state.py::test_concurrent_streams_are_counted_across_replicas` failed so
about one run in three on a busy machine). So the repair waits for the changes in flight (the
acquires awaiting Redis, a flush being sent), sends what is queued, and writes while new ones
wait for it (`_Exclusive`: one round trip, once a heartbeat).

The policy stays pure: the gateway asks here first and hands the verdict to the policy's
BudgetBook (`preset`), which returns it instead of checking its local buckets. When Redis
is unreachable (or did not answer within `store_timeout_s`) there is no round trip until
the heartbeat sees it back; meanwhile each replica enforces its local share, budget /
live replicas (`BudgetBook.set_share`), and `tokenfleet_budget_mode` says which is on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from fleetcore.types import RequestProfile
from gateway.policy_store import StoreUnavailable
from gateway.shared_state import SharedRedis
from slomax.budgets import BudgetVerdict
from slomax.config import Budgets

log = logging.getLogger("tokenfleet.gateway")

Mode = Literal["shared", "local_share"]
_MAX_PENDING = 1024  # settlements queued at once; beyond, dropped (the heartbeat repairs streams)
SETTLE_TICK_S = 0.005  # queued settlements go out together at most this often (one pipeline)
_IDLE_EXPIRE_MS = 120_000  # a bucket untouched for over a minute is full: its hash may go

# KEYS: bucket hash, streams hash, replica roster. ARGV: replica, rpm, tpm, max streams (-1: none),
# tokens, roster ttl ms. Returns {ok, code, retry_after_s (string: Lua numbers become integers)}.
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rpm, tpm, maxs, tokens = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
if maxs >= 0 then
  local alive_since = now - tonumber(ARGV[6])
  local f = redis.call('HGETALL', KEYS[2])
  local n = 0
  for i = 1, #f, 2 do
    local seen = redis.call('ZSCORE', KEYS[3], f[i])
    if f[i] ~= ARGV[1] and (not seen or tonumber(seen) < alive_since) then
      redis.call('HDEL', KEYS[2], f[i])
    else
      n = n + tonumber(f[i + 1])
    end
  end
  if n >= maxs then return {0, 'budget_concurrency', '1', tostring(n)} end
end
local b = redis.call('HMGET', KEYS[1], 'rl', 'ra', 'tl', 'ta')
local rl, tl
if rpm > 0 then
  rl = math.min(rpm, tonumber(b[1] or rpm) + math.max(0, now - tonumber(b[2] or now)) * rpm / 60000)
  if rl < 1 then return {0, 'budget_requests', tostring((1 - rl) * 60 / rpm), tostring(rl)} end
end
if tpm > 0 then
  tl = math.min(tpm, tonumber(b[3] or tpm) + math.max(0, now - tonumber(b[4] or now)) * tpm / 60000)
  if tl < tokens then
    if tokens > tpm then return {0, 'budget_tokens', '-1', tostring(tl)} end
    return {0, 'budget_tokens', tostring((tokens - tl) * 60 / tpm), tostring(tl)}
  end
end
if rpm > 0 then redis.call('HSET', KEYS[1], 'rl', tostring(rl - 1), 'ra', now) end
if tpm > 0 then redis.call('HSET', KEYS[1], 'tl', tostring(tl - tokens), 'ta', now) end
if rpm > 0 or tpm > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[7]) end
if maxs >= 0 then
  redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
  redis.call('PEXPIRE', KEYS[2], ARGV[7])
end
return {1, '', '0', ''}
"""

# KEYS: bucket hash, streams hash. ARGV: replica, tpm, tokens to give back (negative: charge more),
# release a stream (1/0). The level never rises above a minute's allowance.
_SETTLE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local tpm, diff = tonumber(ARGV[2]), tonumber(ARGV[3])
if tpm > 0 and diff ~= 0 then
  local b = redis.call('HMGET', KEYS[1], 'tl', 'ta')
  local tl = math.min(tpm, tonumber(b[1] or tpm) + math.max(0, now - tonumber(b[2] or now)) * tpm / 60000)
  redis.call('HSET', KEYS[1], 'tl', tostring(math.min(tpm, tl + diff)), 'ta', now)
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
end
if ARGV[4] == '1' then
  if redis.call('HINCRBY', KEYS[2], ARGV[1], -1) < 0 then redis.call('HSET', KEYS[2], ARGV[1], 0) end
end
return 1
"""


TENANT = "tenant"  # the scope of tenant budgets; API keys' own budgets are scope "key" (gateway.key_budgets)


@dataclass(slots=True)
class Charge:
    """What the fleet-wide store charged for one admitted request (settled once, at its end)."""

    tenant: str  # the budget's owner within its scope: a tenant, or an API key's id
    budgets: Budgets
    tokens: int
    scope: str = TENANT


class _Exclusive:
    """Many changes at once, or one repair alone: a repair waits for the changes in flight and
    changes that start meanwhile wait for it. Every wait is bounded (`timeout_s`); past it the
    change goes ahead or the repair is skipped (the next heartbeat repairs)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._changes = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._repair: asyncio.Event | None = None  # set when the repair under way ends

    @contextlib.asynccontextmanager
    async def change(self) -> AsyncIterator[None]:
        repair = self._repair
        if repair is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(repair.wait(), self.timeout_s)
        self._changes += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._changes -= 1
            if not self._changes:
                self._idle.set()

    @contextlib.asynccontextmanager
    async def repair(self) -> AsyncIterator[bool]:
        """Yields whether the changes in flight all ended (False: skip the repair this time)."""
        done = self._repair = asyncio.Event()
        try:
            try:
                await asyncio.wait_for(self._idle.wait(), self.timeout_s)
                quiet = True
            except TimeoutError:
                quiet = False
            yield quiet
        finally:
            self._repair = None
            done.set()


class SharedBudgets:
    def __init__(self, shared: SharedRedis, policy: Any, clock: Callable[[], float]) -> None:
        self.shared = shared
        self.policy = policy  # slomax.SLOMax: `budgets` (BudgetBook) and `budget_charge`
        self.clock = clock
        self._acquire = shared.redis.register_script(_ACQUIRE)
        self._outbox: deque[tuple[list[str], list[Any]]] = deque()  # settlements not sent yet
        self._wake = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None
        self._streams: dict[tuple[str, str], int] = {}  # (scope, owner) -> open streams charged in Redis
        self.dropped = 0  # settlements not sent (too many in flight)
        self.mode: Mode = "shared"
        self._exclusive = _Exclusive(shared.timeout_s)  # this replica's stream fields: changes vs. repair
        shared.on_beat.append(self._after_beat)

    @property
    def share(self) -> float:
        """Of every limit a replica enforces on its own now: 1 while Redis decides, else 1 / live replicas."""
        return 1.0 if self.mode == "shared" else 1.0 / max(1, self.shared.live)

    def _set_mode(self, mode: Mode) -> None:
        share = 1.0 if mode == "shared" else 1.0 / max(1, self.shared.live)
        self.policy.budgets.set_share(share, self.clock())
        if mode != self.mode:
            log.warning("budgets: %s", "exact fleet-wide again (Redis)" if mode == "shared" else
                        f"Redis unreachable; each replica enforces its local share (1/{self.shared.live})")
        self.mode = mode

    def _keys(self, scope: str, owner: str) -> list[str]:
        if scope == TENANT:
            return [self.shared.key("budget", owner), self.shared.key("streams", owner)]
        return [self.shared.key(scope, "budget", owner), self.shared.key(scope, "streams", owner)]

    async def acquire(self, scope: str, owner: str, budgets: Budgets,
                      tokens: int) -> tuple[BudgetVerdict, Charge | None] | None:
        """Check and charge `owner`'s budgets fleet-wide (one round trip): the verdict, and the
        charge to settle later when admitted. None when Redis is unreachable: the caller enforces
        its local share (`share`), as the tenant budgets do."""
        if not self.shared.up:  # no round trip while Redis is known down: the heartbeat probes it
            self._set_mode("local_share")
            return None
        ttl_ms = round(self.shared.settings.replica_ttl_s * 1000)
        keys = [*self._keys(scope, owner), self.shared.key("replicas")]
        args = [self.shared.replica_id, budgets.requests_per_minute or 0, budgets.tokens_per_minute or 0,
                -1 if budgets.concurrent_streams is None else budgets.concurrent_streams, tokens, ttl_ms,
                _IDLE_EXPIRE_MS]
        async with self._exclusive.change():
            try:
                ok, code, retry, seen = await self.shared.call("budget", self._acquire(keys=keys, args=args))
            except StoreUnavailable:
                self._set_mode("local_share")
                return None
            verdict = _verdict(int(ok), code, float(retry), seen, budgets, tokens)
            if verdict.ok and budgets.concurrent_streams is not None:
                # counted here before the repair may read it (the script has counted it in Redis)
                self._streams[scope, owner] = self._streams.get((scope, owner), 0) + 1
        if self.mode != "shared" or self.policy.budgets.share != 1.0:
            self._set_mode("shared")
        if not verdict.ok:
            return verdict, None
        return verdict, Charge(owner, budgets, tokens, scope)

    async def before_admit(self, profile: RequestProfile) -> Charge | None:
        """Ask Redis (one round trip) and preset the verdict in the policy's book. Returns the charge
        to settle later, or None (no limits, over budget, or Redis gone: the local share decides)."""
        want = self.policy.budget_charge(profile)
        if want is None:
            return None
        tenant, tokens, budgets = want
        got = await self.acquire(TENANT, tenant, budgets, tokens)
        if got is None:
            return None
        self.policy.budgets.preset(tenant, got[0], self.clock())
        return got[1]

    def after_admit(self, profile: RequestProfile) -> None:
        """Drop an unused preset (the policy rejected before checking budgets: unknown class)."""
        want = self.policy.budget_charge(profile)
        if want is not None:
            self.policy.budgets.preset(want[0], None, self.clock())

    def settle(self, charge: Charge, used_tokens: int) -> None:
        """The request ended (or never ran: used 0): free its stream and give back unused tokens,
        in the background (the next flush), off the request's path."""
        owner = (charge.scope, charge.tenant)
        if charge.budgets.concurrent_streams is not None:
            n = self._streams.get(owner, 0) - 1
            if n > 0:
                self._streams[owner] = n
            else:
                self._streams.pop(owner, None)
        if len(self._outbox) >= _MAX_PENDING:
            self.dropped += 1
            return
        keys = self._keys(*owner)
        args = [self.shared.replica_id, charge.budgets.tokens_per_minute or 0, charge.tokens - used_tokens,
                "1" if charge.budgets.concurrent_streams is not None else "0", _IDLE_EXPIRE_MS]
        self._outbox.append((keys, args))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_loop(), name="budget-settle")
        self._wake.set()

    async def _flush_loop(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(SETTLE_TICK_S)  # let the tick's settlements gather
            self._wake.clear()
            try:
                await self.flush()
            except Exception:  # a bug must not end the give-backs: the next tick tries again
                log.exception("budget settlements failed")

    async def flush(self) -> int:
        """Send every queued settlement as one pipeline; how many were sent (0 on failure)."""
        async with self._exclusive.change():
            return await self._send_outbox()

    async def _send_outbox(self) -> int:
        batch = [self._outbox.popleft() for _ in range(len(self._outbox))]
        if not batch:
            return 0
        # EVAL, not EVALSHA: redis-py's pipelines check every script with an extra SCRIPT EXISTS
        # round trip, and a Redis restarted without the script would fail the whole batch.
        async with self.shared.redis.pipeline(transaction=False) as pipe:
            for keys, args in batch:
                pipe.eval(_SETTLE, len(keys), *keys, *args)
            try:
                await self.shared.call("budget_settle", pipe.execute())
            except StoreUnavailable:
                return 0  # tokens not given back: this tenant is limited a little early; streams are repaired
        return len(batch)

    async def _after_beat(self) -> None:
        """Redis answered the heartbeat: budgets are shared again, and this replica writes its true
        open-stream count per tenant (repairing any settlement that was lost)."""
        if self.mode != "shared":
            self._set_mode("shared")
        owners = {(TENANT, n) for n, t in self.policy.config.tenants.items() if t.budgets.concurrent_streams is not None}
        owners |= self._streams.keys()  # API keys with streams open here
        if not owners:
            return
        async with self._exclusive.repair() as quiet:
            if not quiet:
                return  # a change still in flight: written now, the count could undo it
            # The counts first: a settlement made from here on is off the count after these are
            # written (the flush waits for this repair); the ones queued before, already off it, land first.
            counts = {owner: self._streams.get(owner, 0) for owner in sorted(owners | self._streams.keys())}
            await self._send_outbox()
            async with self.shared.redis.pipeline(transaction=False) as pipe:
                for owner, n in counts.items():
                    pipe.hset(self._keys(*owner)[1], self.shared.replica_id, n)
                await self.shared.call("streams", pipe.execute())

    async def close(self) -> None:
        """Send what is queued (within `store_timeout_s`), then stop the flush."""
        flusher, self._flusher = self._flusher, None
        if flusher is not None:
            flusher.cancel()
            await asyncio.wait([flusher], timeout=self.shared.timeout_s)
        await self.flush()  # bounded by the store's deadline


def _verdict(ok: int, code: str, retry: float, seen: str, b: Budgets, tokens: int) -> BudgetVerdict:
    if ok:
        return BudgetVerdict(True)
    if code == "budget_concurrency":
        return BudgetVerdict(False, code, "requests", f"concurrent streams limit reached: {seen} of "
                             f"{b.concurrent_streams} in flight across the gateway's replicas", 1.0)
    if code == "budget_requests":
        return BudgetVerdict(False, code, "requests",
                             f"requests per minute limit reached: limit {b.requests_per_minute}", retry)
    if retry < 0:
        return BudgetVerdict(False, code, "tokens",
                             f"request too large for the tokens per minute limit: limit {b.tokens_per_minute}, "
                             f"requested {tokens} (prompt + max_tokens); lower max_tokens or the prompt", 60.0)
    used = max(0, round((b.tokens_per_minute or 0) - float(seen or 0)))
    return BudgetVerdict(False, code, "tokens", f"tokens per minute limit reached: limit {b.tokens_per_minute}, "
                                                f"used {used}, requested {tokens}", math.ceil(retry))
