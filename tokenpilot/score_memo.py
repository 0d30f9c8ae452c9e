"""Score once per request: the site chooser's scoring of a pool, reused by `route` on that pool.

FleetMind compares sites with `TokenPilot.predict` (it scores each allowed site's pool), then
`fleetmind.place` asks `TokenPilot.route` for an instance in the chosen site's pool, which
used to score that pool a second time. The memo keeps each pool's score terms for the one
request being placed and hands them to `route`.

Why reuse gives exactly the scores a second scoring would: scoring stores the clock-drained
backlog and duty with `decayed_at = now`, so a second scoring at the same `now` drains by
`max(0, now - now) = 0` (backlog - 0.0 and duty * exp(-0.0) are bit-for-bit the values
stored) and reads the very same rows, snapshots and index matches. That holds only while
nothing else changes, so an entry is used only for the same profile object, the same `now`
and the same snapshot objects (frozen dataclasses: same identity, same fields), and the
router clears the memo whenever its state moves (a route committed, an outcome observed,
an instance registered or forgotten, index updates). Scoring a pool also drains that pool's
rows, so keeping one pool drops entries of any pool that shares an instance with it.
Bounded: one request's pools at a time (a new profile starts afresh), at most `MAX_POOLS`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

from fleetcore.types import InstanceSnapshot, RequestProfile

T = TypeVar("T")

MAX_POOLS = 64  # sites scored for one request; more are simply not kept


class ScoreMemo(Generic[T]):
    def __init__(self) -> None:
        self._profile: RequestProfile | None = None
        self._now = 0.0
        # pool ids -> (the snapshots scored, their terms)
        self._pools: dict[tuple[str, ...], tuple[Sequence[InstanceSnapshot], T]] = {}

    def get(self, profile: RequestProfile, ids: tuple[str, ...], pool: Sequence[InstanceSnapshot],
            now: float) -> T | None:
        """The terms kept for exactly this request, pool and clock reading, else None."""
        if profile is not self._profile or now != self._now:
            return None
        hit = self._pools.get(ids)
        if hit is None:
            return None
        if hit[0] is not pool and (len(hit[0]) != len(pool) or any(a is not b for a, b in zip(hit[0], pool))):
            return None  # (the same tuple: the same snapshots, without comparing them one by one)
        return hit[1]

    def put(self, profile: RequestProfile, ids: tuple[str, ...], pool: Sequence[InstanceSnapshot],
            now: float, terms: T) -> None:
        if profile is not self._profile or now != self._now:
            self._pools.clear()
            self._profile, self._now = profile, now
        elif self._pools:
            # this scoring drained these instances' rows: a kept pool holding one of them is stale
            mine = set(ids)
            for other in [k for k in self._pools if not mine.isdisjoint(k)]:
                del self._pools[other]
        if len(self._pools) < MAX_POOLS:
            self._pools[ids] = (tuple(pool), terms)

    def clear(self) -> None:
        """The router's state moved: nothing kept is valid any more."""
        self._pools.clear()
        self._profile = None
