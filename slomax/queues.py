"""Per-class queues with capacity shares: which waiting request gets the next free capacity.

Capacity is the pool's *prefill budget* (`PrefillBudget`): uncached prompt tokens per
second (the controller's knob; unlimited until it is set), held in token buckets. A
class with protected capacity has a bucket of its own with that fraction of the rate;
the rest refills one shared bucket. A request weighs its expected uncached prompt
tokens. A request of class c may start when

* the engines take more work of the class (the owner's valve, `engines_open`), and
* the class is under its concurrency cap (`max_concurrency` per ready instance; a capped
  class with nothing in flight may always start one), and
* the budget is unlimited, or the pool has nothing in flight (one request always runs,
  however heavy), or c's own bucket, else the shared one, holds min(w, an eighth of that
  bucket). The request is charged its whole weight there, so a bucket may go into debt:
  a huge prompt (prefilled in chunks anyway) passes without waiting for a full bucket,
  then holds back the others drawing on that bucket while the debt is repaid — never
  a protected class's own bucket, so batch and long prompts cannot eat the capacity kept
  for the next chat.
* while other classes wait, c has taken no more than `max_share` of the recent budget.

Among classes with waiting work the one furthest below its share (recent budget taken /
share) goes first, so the budget is split by share under contention and all of it goes
to whoever is waiting otherwise (batch soaks up what the others leave idle). Inside a
class: tenant priority first, then the tenant furthest below its class share (in-flight
weight / tenant share), then FIFO or earliest deadline first.

Removal (client gone, rejected while waiting) is lazy: the entry is marked and
skipped when it reaches a heap top, so it is O(1) and leaves the queue at once as far
as anybody can observe (lengths, positions, picks).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from .budgets import TokenBucket
from .config import ClassPolicy


@dataclass(slots=True)
class Entry:
    """A request waiting at the gateway."""

    request_id: str
    tenant: str
    request_class: str
    model: str
    arrival: float
    enqueued_at: float
    weight: float
    prompt_tokens: int
    deadline: float | None = None  # absolute, for EDF and for giving up on it
    priority: int = 0  # the tenant's
    seq: int = 0
    removed: bool = False
    payload: object = field(default=None, repr=False)  # whatever the owner needs back


class ClassQueue:
    """One class's waiting requests, one heap per tenant."""

    def __init__(self, policy: ClassPolicy) -> None:
        self.policy = policy
        self.edf = policy.order == "edf"
        self._heaps: dict[str, list[tuple[float, int, Entry]]] = {}
        self._live: dict[str, Entry] = {}
        self._by_priority: dict[int, int] = {}  # waiting count per tenant priority
        self.weight = 0.0  # total weight waiting

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def _key(self, e: Entry) -> float:
        if self.edf:
            return e.deadline if e.deadline is not None else math.inf
        return 0.0  # FIFO: the sequence number decides

    def push(self, e: Entry) -> None:
        self._live[e.request_id] = e
        self._by_priority[e.priority] = self._by_priority.get(e.priority, 0) + 1
        self.weight += e.weight
        heapq.heappush(self._heaps.setdefault(e.tenant, []), (self._key(e), e.seq, e))

    def remove(self, request_id: str) -> Entry | None:
        e = self._live.pop(request_id, None)
        if e is not None:
            e.removed = True
            self._by_priority[e.priority] -= 1
            self.weight = self.weight - e.weight if self._live else 0.0
            if not self._live:
                self._heaps.clear()  # every entry left is a removed one (SLOMax's admit may not walk them)
        return e

    def _head(self, tenant: str) -> Entry | None:
        h = self._heaps.get(tenant)
        while h:
            e = h[0][2]
            if not e.removed:
                return e
            heapq.heappop(h)
        if h is not None:
            del self._heaps[tenant]
        return None

    def heads(self) -> Iterator[Entry]:
        for tenant in list(self._heaps):
            e = self._head(tenant)
            if e is not None:
                yield e

    def peek(self, tenant_usage: Callable[[str], float]) -> Entry | None:
        """The entry this class would start next (tenant priority, tenant fairness, order)."""
        best: Entry | None = None
        best_key: tuple[float, float, float, int] | None = None
        for e in self.heads():
            key = (-e.priority, tenant_usage(e.tenant), self._key(e), e.seq)
            if best_key is None or key < best_key:
                best, best_key = e, key
        return best

    def pop(self, e: Entry) -> None:
        """Take `e` (a head) out: it starts now."""
        self.remove(e.request_id)

    def ahead_of(self, key_deadline: float | None, priority: int) -> int:
        """How many waiting requests would go before a new one (priority, then order)."""
        if not self._live:
            return 0
        if not self.edf or len(self._live) > 512:  # FIFO: all of its priority and above; big EDF: bound it
            return sum(n for p, n in self._by_priority.items() if p >= priority)
        k = key_deadline if key_deadline is not None else math.inf
        return sum(1 for e in self._live.values()
                   if e.priority > priority or (e.priority == priority and self._key(e) <= k))

    def expire(self, hopeless: Callable[[Entry], bool]) -> list[Entry]:
        """Remove and return waiting requests that can no longer meet their SLO.

        Only heads are checked, tenant by tenant: the oldest (FIFO) or most urgent (EDF)
        entry of a tenant is always the first to become hopeless.
        """
        out: list[Entry] = []
        for tenant in list(self._heaps):
            while True:
                e = self._head(tenant)
                if e is None or not hopeless(e):
                    break
                self.remove(e.request_id)
                out.append(e)
        return out

    def entries(self) -> list[Entry]:
        return list(self._live.values())


class Usage:
    """In flight, per class and per (class, tenant): counts and weights."""

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0
        self.by_class: dict[str, float] = {}
        self.count_by_class: dict[str, int] = {}
        self.by_class_tenant: dict[tuple[str, str], float] = {}

    def add(self, request_class: str, tenant: str, w: float) -> None:
        self.total += w
        self.count += 1
        self.by_class[request_class] = self.by_class.get(request_class, 0.0) + w
        self.count_by_class[request_class] = self.count_by_class.get(request_class, 0) + 1
        k = (request_class, tenant)
        self.by_class_tenant[k] = self.by_class_tenant.get(k, 0.0) + w

    def remove(self, request_class: str, tenant: str, w: float) -> None:
        # Floats added and removed in different orders: clamp the residue to exact zero.
        self.count = max(0, self.count - 1)
        self.total = self.total - w if self.count else 0.0
        n = self.count_by_class.get(request_class, 0) - 1
        self.count_by_class[request_class] = max(0, n)
        self.by_class[request_class] = self.by_class.get(request_class, 0.0) - w if n > 0 else 0.0
        k = (request_class, tenant)
        v = self.by_class_tenant.get(k, 0.0) - w
        self.by_class_tenant[k] = v if v > 1e-9 else 0.0


class Decayed:
    """An exponentially decaying sum (time constant `tau_s`): who took the budget lately."""

    __slots__ = ("_t", "_v", "tau_s")

    def __init__(self, tau_s: float) -> None:
        self.tau_s = tau_s
        self._v = 0.0
        self._t = 0.0

    def value(self, now: float) -> float:
        dt = now - self._t
        return self._v * math.exp(-dt / self.tau_s) if dt > 0 else self._v

    def add(self, x: float, now: float) -> None:
        self._v = self.value(now) + x
        self._t = max(self._t, now)


class PrefillBudget:
    """Token buckets of uncached prompt tokens: one per protected class, one shared.

    They start full (`burst_s` of the rate to spend at once), or, `full=False`, empty: a
    budget brought in because the engines are already behind must not open with a burst
    of credit on top of what they were given."""

    def __init__(self, protected: Mapping[str, float], rate_per_s: float, burst_s: float, now: float,
                 full: bool = True) -> None:
        self.protected = {c: p for c, p in protected.items() if p > 0}
        self.burst_s = burst_s
        self.rate_per_s = rate_per_s
        self.own: dict[str, TokenBucket] = {}
        self.shared: TokenBucket | None = None
        self._start_level: float | None = None if full else 0.0
        self.set_rate(rate_per_s, now)

    def set_rate(self, rate_per_s: float, now: float) -> None:
        self.rate_per_s = rate_per_s
        parts = {**self.protected, "": max(0.0, 1.0 - sum(self.protected.values()))}
        for name, frac in parts.items():
            r = rate_per_s * frac
            if r <= 0:
                continue
            b = self.own.get(name) if name else self.shared
            if b is None:
                b = TokenBucket(r * self.burst_s, r, now, self._start_level)
                if name:
                    self.own[name] = b
                else:
                    self.shared = b
            elif b.rate_per_s != r:
                b.reconfigure(r * self.burst_s, r, now)

    def _usable(self, request_class: str) -> list[TokenBucket]:
        own = self.own.get(request_class)
        return [b for b in (own, self.shared) if b is not None]

    def bucket_for(self, request_class: str, w: float, now: float) -> TokenBucket | None:
        """The bucket that would pay for a start now (own before shared), or None."""
        for b in self._usable(request_class):
            if b.level(now) >= min(w, b.capacity / 8):
                return b
        return None

    def charge(self, request_class: str, w: float, now: float) -> None:
        b = self.bucket_for(request_class, w, now)
        if b is None:  # an idle pool lets one request through whatever the level: the last bucket pays
            usable = self._usable(request_class)
            b = usable[-1] if usable else None
        if b is not None:
            b.take(w, now)

    def wait_s(self, request_class: str, w: float, now: float) -> float:
        """Seconds until a start of weight `w` would be paid for (0: now)."""
        best = math.inf
        for b in self._usable(request_class):
            missing = min(w, b.capacity / 8) - b.level(now)
            best = min(best, 0.0 if missing <= 0 else missing / b.rate_per_s)
        return best

    def rate_for(self, request_class: str, share_fraction: float) -> float:
        """Refill a class can count on: its own bucket's, plus its part of the shared one's."""
        own = self.own.get(request_class)
        shared = self.shared.rate_per_s * share_fraction if self.shared is not None else 0.0
        return max(1e-9, (own.rate_per_s if own is not None else 0.0) + shared)

    def level(self, now: float) -> float:
        shared = self.shared.level(now) if self.shared is not None else 0.0
        return shared + sum(b.level(now) for b in self.own.values())


class ClassQueues:
    """A pool's class queues and the rule for who starts next (module docstring)."""

    def __init__(self, classes: Mapping[str, ClassPolicy], tenant_share: Callable[[str, str], float],
                 usage_tau_s: float = 10.0) -> None:
        self.classes = dict(classes)
        self.queues = {name: ClassQueue(p) for name, p in self.classes.items()}
        self.usage = Usage()
        self.taken = {name: Decayed(usage_tau_s) for name in self.classes}
        self._tenant_share = tenant_share
        self.budget: PrefillBudget | None = None  # None: unlimited prefill
        self.n_ready = 1
        self.concurrency_override: dict[str, float] = {}  # set by the controller
        # Whether the engines take more work of a class now (the owner's valve); None: always.
        self.engines_open: Callable[[str], bool] | None = None

    def __len__(self) -> int:
        return sum(map(len, self.queues.values()))

    def max_concurrency(self, request_class: str) -> float | None:
        v = self.concurrency_override.get(request_class)
        return v if v is not None else self.classes[request_class].max_concurrency

    def concurrency_cap(self, request_class: str) -> int | None:
        per = self.max_concurrency(request_class)
        return None if per is None else max(1, math.floor(per * max(1, self.n_ready) + 1e-9))

    def why_not(self, request_class: str, w: float, now: float, others_waiting: bool) -> str:
        """"" when a request of this class and weight may start now, else what holds it back."""
        if self.engines_open is not None and not self.engines_open(request_class):
            return "engines"
        u = self.usage
        cap = self.concurrency_cap(request_class)
        if cap is not None and u.count_by_class.get(request_class, 0) >= cap:
            return f"cap:{request_class}"
        policy = self.classes[request_class]
        if others_waiting and policy.max_share < 1.0:
            taken = {n: d.value(now) for n, d in self.taken.items()}
            total = sum(taken.values())
            if total > 0 and taken[request_class] / total > policy.max_share:
                return f"share:{request_class}"
        b = self.budget
        if b is None or u.count == 0 or b.bucket_for(request_class, w, now) is not None:
            return ""
        return "budget"

    def share_fraction(self, request_class: str) -> float:
        """`request_class`'s part of the budget while it and the other classes with waiters compete."""
        mine = self.classes[request_class].share
        total = mine + sum(p.share for n, p in self.classes.items() if n != request_class and self.queues[n])
        return mine / total

    def _tenant_usage(self, request_class: str) -> Callable[[str], float]:
        by = self.usage.by_class_tenant
        return lambda t: by.get((request_class, t), 0.0) / self._tenant_share(t, request_class)

    def _candidates(self, now: float) -> list[Entry]:
        cands: list[tuple[float, int, Entry]] = []
        for name, q in self.queues.items():
            e = q.peek(self._tenant_usage(name)) if q else None
            if e is not None:
                p = self.classes[name]
                cands.append((self.taken[name].value(now) / p.share, p.rank, e))
        cands.sort(key=lambda c: (c[0], c[1]))
        return [e for _, _, e in cands]

    def _only(self) -> Entry | None:
        """The waiting request when exactly one waits in all the classes (what `_candidates` would
        list alone), else None. Through `heads`, as `peek`, so removed entries leave the heaps alike."""
        one: ClassQueue | None = None
        for q in self.queues.values():
            n = len(q)
            if n:
                if n > 1 or one is not None:
                    return None
                one = q
        if one is None:
            return None
        heads = list(one.heads())  # every tenant's heap, as peek walks them (dropping removed tops)
        return heads[0] if heads else None

    def next(self, now: float) -> Entry | None:
        """The waiting request that may start now, or None.

        A class held back by its own cap or share lets the next one go; one held back by the
        budget or the engines does not, except for classes with protected capacity:
        otherwise a stream of small requests would take every refill and starve a long
        prompt forever.
        """
        only = self._only()
        if only is not None:  # one request waits: the candidates are that one, nobody else waits
            return only if not self.why_not(only.request_class, only.weight, now, False) else None
        cands = self._candidates(now)
        blocked = False
        for e in cands:
            if blocked and self.classes[e.request_class].protected <= 0:
                continue
            why = self.why_not(e.request_class, e.weight, now, len(cands) > 1)
            if not why:
                return e
            blocked = blocked or why in ("budget", "engines")
        return None

    def blocked(self, now: float) -> set[str]:
        """Why the waiting heads cannot start: "engines", "budget", "cap:<class>", "share:<class>"."""
        cands = self._candidates(now)
        return {why for e in cands if (why := self.why_not(e.request_class, e.weight, now, len(cands) > 1))}

    def start(self, e: Entry, now: float) -> None:
        """`e` starts (from a queue or at once): count it in flight, charge the budget."""
        self.usage.add(e.request_class, e.tenant, e.weight)
        self.taken[e.request_class].add(e.weight, now)
        if self.budget is not None:
            self.budget.charge(e.request_class, e.weight, now)

    def finish(self, e: Entry) -> None:
        self.usage.remove(e.request_class, e.tenant, e.weight)

    def budget_wait_s(self, now: float) -> float | None:
        """When the budget could next let a waiting head start (None: it is not what holds them)."""
        b = self.budget
        if b is None:
            return None
        waits = [b.wait_s(e.request_class, e.weight, now) for e in self._candidates(now)]
        best = min((w for w in waits if w > 0), default=math.inf)
        return None if best == math.inf else best

    def pop(self, e: Entry) -> None:
        self.queues[e.request_class].pop(e)

    def remove(self, request_id: str, request_class: str) -> Entry | None:
        q = self.queues.get(request_class)
        return q.remove(request_id) if q is not None else None
