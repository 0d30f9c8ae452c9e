"""Combine and reshape workloads. Every function returns a new Workload."""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Mapping
from dataclasses import replace

import xxhash

from fleetcore.slo import class_by_length
from workloads.trace import TraceRequest, Workload


def merge(*workloads: Workload, name: str | None = None) -> Workload:
    """Time-ordered union; ties keep argument order. Block ids are not remapped:
    generators and `load_trace(id_offset=...)` keep namespaces apart."""
    if not workloads:
        return Workload(name or "empty", [])
    reqs = list(heapq.merge(*(w.requests for w in workloads), key=lambda r: r.timestamp_ms))
    return Workload(name or "+".join(w.name for w in workloads), reqs, workloads[0].block_tokens,
                    {"parts": [w.name for w in workloads]})


class _Picker:
    """Weighted choice from a uniform draw in [0, 1)."""

    def __init__(self, weights: Mapping[str, float], what: str) -> None:
        items = [(k, float(v)) for k, v in weights.items() if v > 0]
        if not items or any(v < 0 for v in weights.values()):
            raise ValueError(f"{what} weights must be non-negative with a positive sum")
        total = sum(v for _, v in items)
        self.names = [k for k, _ in items]
        self.cum = list(itertools.accumulate(v / total for _, v in items))

    def pick(self, u: float) -> str:
        return self.names[min(bisect.bisect_right(self.cum, u), len(self.names) - 1)]


def _uniform(field: str, key: str, seed: int) -> float:
    return xxhash.xxh64_intdigest(f"{field}\0{key}".encode(), seed=seed & 0xFFFFFFFFFFFFFFFF) / 2.0 ** 64


def assign(workload: Workload, tenants: Mapping[str, float] | None = None,
           classes: Mapping[str, float] | None = None,
           regions: Mapping[str, float] | None = None, seed: int = 0) -> Workload:
    """Fill missing tenant / class / region by weight; fields already set are kept.

    The draw is keyed by the request's session (else its index), so every turn of a
    chat or agent session lands on one tenant and one region, as a real user would.
    Without `classes`, a missing class comes from `class_by_length(input_length)`.
    """
    pt = _Picker(tenants, "tenant") if tenants else None
    pc = _Picker(classes, "class") if classes else None
    pr = _Picker(regions, "region") if regions else None
    out: list[TraceRequest] = []
    for i, r in enumerate(workload.requests):
        key = r.session if r.session is not None else f"#{i}"
        tenant, cls, region = r.tenant, r.request_class, r.region
        if tenant is None and pt:
            tenant = pt.pick(_uniform("tenant", key, seed))
        if cls is None:
            cls = pc.pick(_uniform("class", key, seed)) if pc else class_by_length(r.input_length)
        if region is None and pr:
            region = pr.pick(_uniform("region", key, seed))
        out.append(replace(r, tenant=tenant, request_class=cls, region=region))
    meta = dict(workload.metadata)
    meta["assign"] = {"tenants": dict(tenants or {}), "classes": dict(classes or {}),
                      "regions": dict(regions or {}), "seed": seed}
    return Workload(workload.name, out, workload.block_tokens, meta)


def scale_rate(workload: Workload, x: float) -> Workload:
    """x times the arrival rate (timestamps / x); lengths and ids unchanged."""
    if not x > 0:
        raise ValueError("rate scale must be positive")
    reqs = [replace(r, timestamp_ms=r.timestamp_ms / x) for r in workload.requests]
    return Workload(workload.name, reqs, workload.block_tokens,
                    {**workload.metadata, "rate_scale": workload.metadata.get("rate_scale", 1.0) * x})


def window(workload: Workload, start_s: float, duration_s: float, rebase: bool = True) -> Workload:
    """Requests with start_s <= arrival < start_s + duration_s; with `rebase`, times
    are shifted so the window starts at 0 (gaps before the first request are kept)."""
    lo, hi = start_s * 1000.0, (start_s + duration_s) * 1000.0
    ts = [r.timestamp_ms for r in workload.requests]
    sel = workload.requests[bisect.bisect_left(ts, lo):bisect.bisect_left(ts, hi)]
    if rebase:
        sel = [replace(r, timestamp_ms=r.timestamp_ms - lo) for r in sel]
    return Workload(workload.name, sel, workload.block_tokens,
                    {**workload.metadata, "window_s": [start_s, duration_s]})


def head(workload: Workload, n: int) -> Workload:
    """The first n requests in time order."""
    return Workload(workload.name, workload.requests[:max(0, n)], workload.block_tokens,
                    {**workload.metadata, "head": n})
