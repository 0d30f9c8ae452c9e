"""Benchmark metrics from per-request records: latency percentiles, throughput, goodput, SLO.

Pure functions (numpy) over `RequestRecord`s, so the simulator and the live
benchmark (`bench live`) report through the same arithmetic.

Definitions (all times client-side, in seconds on the record, reported in ms):

* Latency statistics (TTFT, mean TPOT, end-to-end, queue) are over *completed*
  requests only; a request cancelled or rejected has no complete latency, and
  its failure shows up in `slo_attainment` instead.
* TPOT of a request is its mean time per output token after the first,
  ``(last - first) / (n - 1)``; requests with a single output token have none.
* Queue time: gateway admission wait plus engine wait (arrival at the engine to
  the start of the step that produced the first token).
* `throughput_tok_s`: every output token a client received (completed requests
  plus what cancelled ones got before giving up) over the run's span.
* `goodput_tok_s`: output tokens of *completed* requests that met their class
  SLO, over the same span.
* The span is the whole run's, first arrival to last request end, also for the
  per-class and per-tenant breakdowns, so their rates add up to the total.
* `slo_attainment` = met / arrived: rejected and cancelled requests are misses
  (a request the system turned away did not get its SLO).
* `cache_hit_rate` = prefix-cached prompt tokens / prompt tokens, over requests
  that reached prefill (got a first token), whatever became of them later.
* A request's own `deadline_s` (from the trace) bounds its end-to-end time in
  addition to its class SLO.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from fleetcore.slo import ClassSLO, class_by_length

Status = Literal["completed", "rejected", "cancelled", "failed"]  # failed: ended by an engine failure

PERCENTILES_TTFT = (50, 90, 95, 99)
PERCENTILES_TPOT = (50, 95)


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request, as the client saw it."""

    request_id: str
    arrival_s: float
    prompt_tokens: int
    status: Status
    tenant: str = "anonymous"
    model: str | None = None
    request_class: str | None = None  # None: classified by prompt length
    output_tokens: int = 0  # tokens the client received
    cached_tokens: int = 0
    ttft_s: float | None = None  # set once the first token arrived, even if cancelled later
    tpot_s: float | None = None
    e2e_s: float | None = None
    queue_s: float | None = None
    end_s: float | None = None  # when the request ended for the client (done, cancelled, rejected)
    deadline_s: float | None = None  # the request's own end-to-end bound, if any
    site: str | None = None
    instance: str | None = None
    reason: str | None = None  # why rejected / cancelled

    @property
    def klass(self) -> str:
        return self.request_class or class_by_length(self.prompt_tokens)


def slo_met(r: RequestRecord, slos: Mapping[str, ClassSLO]) -> bool:
    """A completed request within its class SLO (and its own deadline). Unknown class: no bound.
    `slos`: the fleet's SLO map (`AdmissionConfig.slos`), the one admission judged it by."""
    if r.status != "completed":
        return False
    slo = slos.get(r.klass)
    if slo is not None and not slo.met(r.ttft_s, r.tpot_s, r.e2e_s):
        return False
    if r.deadline_s is not None and (r.e2e_s is None or r.e2e_s > r.deadline_s):
        return False
    return True


def percentiles(values: Sequence[float] | np.ndarray, qs: Iterable[int], scale: float = 1.0,
                with_mean: bool = False) -> dict[str, float | None]:
    """{"p50": ..., ...} (numpy linear interpolation) times `scale`; None for an empty set."""
    a = np.asarray(values, dtype=float)
    keys = [f"p{q}" for q in qs]
    if a.size == 0:
        out: dict[str, float | None] = {k: None for k in keys}
        if with_mean:
            out["mean"] = None
        return out
    vals = np.percentile(a, list(qs)) * scale
    out = {k: float(v) for k, v in zip(keys, vals)}
    if with_mean:
        out["mean"] = float(a.mean() * scale)
    return out


def run_span(records: Sequence[RequestRecord]) -> float:
    """First arrival to the last request end (seconds); 0 for an empty run."""
    if not records:
        return 0.0
    start = min(r.arrival_s for r in records)
    end = max((r.end_s if r.end_s is not None else r.arrival_s) for r in records)
    return max(0.0, end - start)


def summarize(records: Sequence[RequestRecord], span_s: float,
              slos: Mapping[str, ClassSLO]) -> dict[str, Any]:
    """The flat metric block of one group of requests (the fields of a result row)."""
    n = len(records)
    done = [r for r in records if r.status == "completed"]
    rejected = sum(1 for r in records if r.status == "rejected")
    cancelled = sum(1 for r in records if r.status == "cancelled")
    met = [r for r in done if slo_met(r, slos)]
    prefilled = [r for r in records if r.ttft_s is not None]

    def col(attr: str) -> list[float]:
        return [v for v in (getattr(r, attr) for r in done) if v is not None]

    out_tokens = sum(r.output_tokens for r in records)
    good_tokens = sum(r.output_tokens for r in met)
    prompt = sum(r.prompt_tokens for r in prefilled)
    cached = sum(r.cached_tokens for r in prefilled)
    return {
        "requests": n,
        "completed": len(done),
        "rejected": rejected,
        "cancelled": cancelled,
        "ttft_ms": percentiles(col("ttft_s"), PERCENTILES_TTFT, 1e3, with_mean=True),
        "tpot_ms": percentiles(col("tpot_s"), PERCENTILES_TPOT, 1e3),
        "e2e_ms": percentiles(col("e2e_s"), PERCENTILES_TTFT, 1e3, with_mean=True),
        "queue_ms": percentiles(col("queue_s"), PERCENTILES_TTFT, 1e3, with_mean=True),
        "output_tokens": out_tokens,
        "throughput_tok_s": out_tokens / span_s if span_s > 0 else 0.0,
        "goodput_tok_s": good_tokens / span_s if span_s > 0 else 0.0,
        "slo_attainment": len(met) / n if n else None,
        "cache_hit_rate": cached / prompt if prompt else None,
    }


def _grouped(records: Sequence[RequestRecord], key: Callable[[RequestRecord], str],
             span_s: float, slos: Mapping[str, ClassSLO]) -> dict[str, dict[str, Any]]:
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault(key(r), []).append(r)
    return {k: summarize(v, span_s, slos) for k, v in sorted(groups.items())}


def summarize_all(records: Sequence[RequestRecord],
                  slos: Mapping[str, ClassSLO]) -> dict[str, Any]:
    """Overall metrics plus `by_class` and `by_tenant` blocks (same fields, same span)."""
    span = run_span(records)
    out = summarize(records, span, slos)
    out["span_s"] = span
    out["by_class"] = _grouped(records, lambda r: r.klass, span, slos)
    out["by_tenant"] = _grouped(records, lambda r: r.tenant, span, slos)
    return out


def ttft_values_ms(records: Sequence[RequestRecord]) -> np.ndarray:
    """Sorted TTFTs (ms) of completed requests: the data of a CDF plot."""
    return np.sort(np.array([r.ttft_s for r in records if r.status == "completed" and r.ttft_s is not None],
                            dtype=float) * 1e3)
