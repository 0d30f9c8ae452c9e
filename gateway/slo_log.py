"""Why it missed: the last finished requests, bounded, for the missed-SLO listing and per-class percentiles.

Two rings: every finished request (latency percentiles per class over a recent window) and
only the misses (so a flood of requests that met their SLO does not push the interesting
ones out). Both are fixed-size deques: memory is bounded whatever the traffic. Times are
the gateway's own monotonic clock; the report turns them into wall-clock time.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

PERCENTILES = (50, 90, 95, 99)


class Finished(NamedTuple):
    """One finished request (every request writes one). A NamedTuple, not a frozen dataclass:
    that one's __init__ sets its 15 fields one `object.__setattr__` at a time (~18 k
    instructions a request; bench/README.md, "Issue 14: per layer")."""

    at: float  # gateway clock when it ended
    request_id: str
    tenant: str
    request_class: str
    model: str
    status: str
    outcome: str
    site: str | None
    instance: str | None
    ttft_s: float | None
    tpot_s: float | None
    queue_wait_s: float | None
    e2e_s: float
    met: bool
    reason: str | None  # why it missed (None when it met its SLO)


class SLOLog:
    def __init__(self, misses: int = 1024, recent: int = 4096) -> None:
        self._misses: deque[Finished] = deque(maxlen=misses)
        self._recent: deque[Finished] = deque(maxlen=recent)

    @property
    def capacity(self) -> int:
        return self._misses.maxlen or 0

    def add(self, f: Finished) -> None:
        self._recent.append(f)
        if not f.met:
            self._misses.append(f)

    @staticmethod
    def _select(entries: Iterable[Finished], since: float | None, tenant: str | None,
                request_class: str | None) -> list[Finished]:
        return [f for f in entries if (since is None or f.at >= since) and (tenant is None or f.tenant == tenant)
                and (request_class is None or f.request_class == request_class)]

    def misses(self, *, since: float | None = None, tenant: str | None = None, request_class: str | None = None,
               limit: int = 100) -> list[Finished]:
        """Newest first, at most `limit`."""
        return self._select(reversed(self._misses), since, tenant, request_class)[:max(0, limit)]

    def latency(self, *, since: float | None = None, tenant: str | None = None,
                request_class: str | None = None) -> dict[str, dict[str, Any]]:
        """Per class: requests kept, met, and p50/p90/p95/p99 of TTFT, TPOT, queue wait and duration
        over the requests that completed (failures have no latency worth ranking)."""
        by_class: dict[str, list[Finished]] = {}
        for f in self._select(self._recent, since, tenant, request_class):
            by_class.setdefault(f.request_class, []).append(f)
        out: dict[str, dict[str, Any]] = {}
        for cls, fs in sorted(by_class.items()):
            done = [f for f in fs if f.outcome == "ok"]
            out[cls] = {"requests": len(fs), "completed": len(done), "met_slo": sum(f.met for f in fs),
                        "ttft_s": percentiles([f.ttft_s for f in done]),
                        "tpot_s": percentiles([f.tpot_s for f in done]),
                        "queue_wait_s": percentiles([f.queue_wait_s for f in fs]),
                        "e2e_s": percentiles([f.e2e_s for f in done])}
        return out


def percentiles(values: Sequence[float | None], ps: Sequence[int] = PERCENTILES) -> dict[str, float | None]:
    """Nearest-rank percentiles of the values that are known (None: no value)."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return {f"p{p}": None for p in ps}
    return {f"p{p}": round(xs[max(0, math.ceil(p / 100 * len(xs)) - 1)], 6) for p in ps}


def as_row(f: Finished, wall_offset: float) -> dict[str, Any]:
    row = f._asdict()
    row["class"] = row.pop("request_class")
    row["at"] = f.at + wall_offset  # unix seconds
    for k in ("ttft_s", "tpot_s", "queue_wait_s", "e2e_s"):
        if row[k] is not None:
            row[k] = round(row[k], 6)
    return row
