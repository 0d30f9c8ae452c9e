"""Tenant budgets: token buckets for tokens/min and requests/min, a counter for concurrent streams.

A bucket holds at most one minute's allowance (so a tenant may burst a full minute's
worth after being idle, the usual per-minute-limit semantics) and refills linearly.
Its level is computed from the last *charge* — level_at_anchor + (now - anchor) x rate —
never by adding small increments on every read, so reading it often cannot drift it.

Tokens are charged at admission as prompt + output budget (max_tokens, or a default
when the request sets none) and settled when the request ends: unused output budget
is given back, and a request turned away before it ran gets all its tokens back (its
request still counts against requests/min: the tenant did ask).

Several gateway replicas share one budget (README "Several replicas"). The book stays
pure: the gateway asks the fleet-wide store and hands the verdict in (`preset`), which the
next check of that tenant returns instead of its local buckets; the local buckets are still
charged, so they know this replica's own use. When the store is gone the gateway sets a
`share` (1 / live replicas): every limit is scaled to it, so N replicas together stay
within the budget (concurrency rounds up: at most N streams over).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import Budgets


class TokenBucket:
    """`capacity` units, refilled at `rate_per_s`; the level may go negative (debt) on settlement."""

    __slots__ = ("_anchor", "_level", "capacity", "rate_per_s")

    def __init__(self, capacity: float, rate_per_s: float, now: float, level: float | None = None) -> None:
        if capacity <= 0 or rate_per_s <= 0:
            raise ValueError("a bucket needs a positive capacity and rate")
        self.capacity = float(capacity)
        self.rate_per_s = float(rate_per_s)
        self._level = float(capacity) if level is None else min(float(capacity), float(level))  # full unless told
        self._anchor = now

    @classmethod
    def per_minute(cls, amount: int, now: float) -> TokenBucket:
        return cls(amount, amount / 60.0, now)

    def level(self, now: float) -> float:
        return min(self.capacity, self._level + max(0.0, now - self._anchor) * self.rate_per_s)

    def _rebase(self, now: float) -> None:
        if now > self._anchor:
            self._level = self.level(now)
            self._anchor = now

    def reconfigure(self, capacity: float, rate_per_s: float, now: float) -> None:
        """New size and rate from `now` on; what was refilled so far stays."""
        if capacity <= 0 or rate_per_s <= 0:
            raise ValueError("a bucket needs a positive capacity and rate")
        self._rebase(now)
        self.capacity = float(capacity)
        self.rate_per_s = float(rate_per_s)
        self._level = min(self._level, self.capacity)

    def can_take(self, n: float, now: float) -> bool:
        return self.level(now) >= n

    def take(self, n: float, now: float) -> None:
        """Charge `n` (unconditionally: callers check `can_take` first)."""
        self._rebase(now)
        self._level -= n

    def give(self, n: float, now: float) -> None:
        """Return `n` (refund), never above capacity."""
        self._rebase(now)
        self._level = min(self.capacity, self._level + n)

    def wait_s(self, n: float, now: float) -> float:
        """Seconds until `n` can be taken; inf if it never can (more than the capacity)."""
        if n > self.capacity:
            return math.inf
        missing = n - self.level(now)
        return 0.0 if missing <= 0 else missing / self.rate_per_s


@dataclass(frozen=True, slots=True)
class BudgetVerdict:
    ok: bool
    code: str = ""  # budget_tokens | budget_requests | budget_concurrency
    limit_type: str = ""  # OpenAI's error `type` for 429s: "tokens" | "requests"
    reason: str = ""
    retry_after_s: float = 0.0


OK = BudgetVerdict(True)


class TenantBudget:
    """One tenant's budgets and what it has in flight."""

    def __init__(self, budgets: Budgets, now: float, share: float = 1.0) -> None:
        self.budgets = budgets
        self.tokens = TokenBucket.per_minute(budgets.tokens_per_minute, now) if budgets.tokens_per_minute else None
        self.requests = (TokenBucket.per_minute(budgets.requests_per_minute, now)
                         if budgets.requests_per_minute else None)
        self.streams = 0  # admitted (or queued) and not yet ended
        self.share = 1.0
        self.preset: BudgetVerdict | None = None  # the fleet-wide verdict for the next check
        if share != 1.0:
            self.set_share(share, now)

    def set_share(self, share: float, now: float) -> None:
        """Enforce `share` (0 < share <= 1) of every limit from `now` on."""
        if not 0 < share <= 1:
            raise ValueError("a budget share is in (0, 1]")
        self.share = share
        b = self.budgets
        for bucket, amount in ((self.tokens, b.tokens_per_minute), (self.requests, b.requests_per_minute)):
            if bucket is not None and amount:
                bucket.reconfigure(amount * share, amount * share / 60.0, now)

    def check(self, tokens: int, now: float) -> BudgetVerdict:
        """Would a request of `tokens` (prompt + output budget) fit now? No side effects but one:
        a preset (fleet-wide) verdict is used once."""
        if self.preset is not None:
            verdict, self.preset = self.preset, None
            return verdict
        b = self.budgets
        streams_limit = None if b.concurrent_streams is None else math.ceil(b.concurrent_streams * self.share)
        if streams_limit is not None and self.streams >= streams_limit:
            return BudgetVerdict(False, "budget_concurrency", "requests",
                                 f"concurrent streams limit reached: {self.streams} of {streams_limit} "
                                 "in flight", 1.0)
        if self.requests is not None and not self.requests.can_take(1, now):
            wait = self.requests.wait_s(1, now)
            return BudgetVerdict(False, "budget_requests", "requests",
                                 f"requests per minute limit reached: limit {b.requests_per_minute}", wait)
        if self.tokens is not None and not self.tokens.can_take(tokens, now):
            wait = self.tokens.wait_s(tokens, now)
            used = max(0, round(self.tokens.capacity - self.tokens.level(now)))
            if math.isinf(wait):
                reason = (f"request too large for the tokens per minute limit: limit {b.tokens_per_minute}, "
                          f"requested {tokens} (prompt + max_tokens); lower max_tokens or the prompt")
                wait = 60.0
            else:
                reason = (f"tokens per minute limit reached: limit {b.tokens_per_minute}, used {used}, "
                          f"requested {tokens}")
            return BudgetVerdict(False, "budget_tokens", "tokens", reason, wait)
        return OK

    def charge(self, tokens: int, now: float) -> None:
        if self.requests is not None:
            self.requests.take(1, now)
        if self.tokens is not None:
            self.tokens.take(tokens, now)
        self.streams += 1

    def settle(self, charged_tokens: int, used_tokens: int, now: float) -> None:
        """The request ended: free its stream, give back (or charge) the token difference."""
        self.streams = max(0, self.streams - 1)
        if self.tokens is not None and used_tokens != charged_tokens:
            diff = charged_tokens - used_tokens
            if diff > 0:
                self.tokens.give(diff, now)
            else:
                self.tokens.take(-diff, now)


class BudgetBook:
    """Every tenant's budget, created on first use (unknown tenants are unlimited)."""

    def __init__(self, budgets: dict[str, Budgets]) -> None:
        self._config = budgets
        self._tenants: dict[str, TenantBudget] = {}
        self.share = 1.0  # of every limit this book enforces (local share: 1 / live replicas)

    def get(self, tenant: str, now: float) -> TenantBudget:
        tb = self._tenants.get(tenant)
        if tb is None:
            tb = self._tenants[tenant] = TenantBudget(self._config.get(tenant, Budgets()), now, self.share)
        return tb

    def budgets_of(self, tenant: str) -> Budgets:
        return self._config.get(tenant, Budgets())

    def set_share(self, share: float, now: float) -> None:
        """Scale every tenant's limits to `share` of the configured ones (1.0: the whole budget)."""
        if share == self.share:
            return
        self.share = share
        for tb in self._tenants.values():
            tb.set_share(share, now)

    def preset(self, tenant: str, verdict: BudgetVerdict | None, now: float) -> None:
        """The verdict the next check of `tenant` returns (None: its local buckets decide)."""
        self.get(tenant, now).preset = verdict

    def snapshot(self, now: float) -> dict[str, dict[str, float | int | None]]:
        out: dict[str, dict[str, float | int | None]] = {}
        for name, tb in sorted(self._tenants.items()):
            out[name] = {
                "streams": tb.streams,
                "tokens_left": None if tb.tokens is None else round(tb.tokens.level(now), 1),
                "requests_left": None if tb.requests is None else round(tb.requests.level(now), 3),
            }
        return out
