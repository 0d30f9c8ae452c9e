"""Prometheus metrics of the gateway, in a registry of its own.

One registry per app (not the process-global default) so that several gateways
in one process (tests, benchmarks) do not collide on metric names.

Tenants must not see each other, and /metrics is scraped without a key: `render()` (the
public view) sums every counter over its `tenant` label and leaves out per-tenant gauges
(an attainment ratio has no sum); `render(per_tenant=True)` is the full registry, for
the admin (`/metrics` with an admin key).
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from fleetcore.types import RequestOutcome

# TTFT of interactive requests sits well under a second; long-context prefill can take tens.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20, 60)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600)


def child_of(cache: dict[Any, Any], metric: Any, key: tuple[str, ...]) -> Any:
    """`metric.labels(*key)`, looked up once per label set in `cache`: `.labels()` validates and
    locks on every call. Made when first asked, as `.labels()` makes it (a series appears on
    /metrics no earlier); bounded as the registry is, one child per label set ever seen."""
    child = cache.get(key)
    if child is None:
        child = cache[key] = metric.labels(*key)
    return child


class HistogramChild:
    """One label set's histogram: a count per bucket (not cumulative) and the sum."""

    __slots__ = ("_bounds", "counts", "sum", "created")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        # The first bucket whose bound is >= amount, as prometheus_client's loop finds it; NaN
        # is <= no bound, so it lands in no bucket there (bisect would put it in the first).
        if amount == amount:
            self.counts[bisect_left(self._bounds, amount)] += 1
        self.sum += amount


class LabelledHistogram(Collector):
    """A labelled Prometheus histogram whose `observe` is one bisect and two additions, where
    prometheus_client's `Histogram.observe` takes two locks and walks the bounds in Python
    (0.61 against 0.07 us, timeit, ad-hoc; five observations per request). The same /metrics
    text as that Histogram with the same name, help, labels, buckets and observations
    (`tests/test_metrics_histograms.py`): series in the order their label sets first came,
    `le` written as it writes it, `_created` unless `disable_created_metrics()` (read at scrape).

    Observed and collected on the event loop (relay, telemetry and the async /metrics route),
    so no lock: a scrape never sees half an observation."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 buckets: Iterable[float], registry: CollectorRegistry) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds):
            raise ValueError("Buckets not in sorted order")
        if bounds and bounds[-1] != math.inf:
            bounds.append(math.inf)
        if len(bounds) < 2:
            raise ValueError("Must have at least two buckets")
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._bounds = tuple(bounds)
        self._le = tuple(floatToGoString(b) for b in bounds)
        self._children: dict[tuple[str, ...], HistogramChild] = {}
        registry.register(self)

    def labels(self, *values: Any) -> HistogramChild:
        """The child of one label set, made when first asked (as `Histogram.labels`: str() of each value)."""
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            if len(key) != len(self.labelnames):
                raise ValueError("Incorrect label count")
            child = self._children[key] = HistogramChild(self._bounds)
        return child

    def describe(self) -> Iterable[Metric]:
        return [Metric(self.name, self.documentation, "histogram")]

    def collect(self) -> Iterable[Metric]:
        family = Metric(self.name, self.documentation, "histogram")
        created = prometheus_metrics._use_created  # (process-wide, as the Histogram reads it)
        with_sum = self._bounds[0] >= 0
        name = self.name
        for key, child in list(self._children.items()):
            series = dict(zip(self.labelnames, key))
            acc = 0.0
            for le, n in zip(self._le, child.counts):
                acc += n
                family.add_sample(name + "_bucket", {**series, "le": le}, acc)
            family.add_sample(name + "_count", dict(series), acc)
            if with_sum:
                family.add_sample(name + "_sum", dict(series), child.sum)
            if created:
                family.add_sample(name + "_created", dict(series), child.created)
        return [family]


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tokenfleet_requests", "Requests answered, by outcome status",
                                ["model", "site", "instance", "status"], registry=r)
        self.ttft = LabelledHistogram("tokenfleet_ttft_seconds", "Time to first token (gateway arrival to first token)",
                                      ["model", "site"], buckets=_TTFT_BUCKETS, registry=r)
        self.e2e = LabelledHistogram("tokenfleet_e2e_seconds", "Gateway arrival to last byte",
                                     ["model", "site"], buckets=_E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("tokenfleet_prompt_tokens", "Prompt tokens of routed requests",
                                     ["model", "site"], registry=r)
        self.router_refits = Counter(
            "tokenfleet_router_refits", "Fits of the router's learned latency model, by result: installed, "
            "kept_prior (no better than the prior on the newest outcomes), failed", ["result"], registry=r)
        self.output_tokens = Counter("tokenfleet_output_tokens", "Output tokens relayed",
                                     ["model", "site"], registry=r)
        self.cached_tokens = Counter("tokenfleet_cached_prompt_tokens",
                                     "Prompt tokens the engine reported as served from its prefix cache",
                                     ["model", "site"], registry=r)
        self.retries = Counter("tokenfleet_retries", "Requests retried on another instance",
                               ["model"], registry=r)
        self.upstream_errors = Counter("tokenfleet_upstream_errors", "Upstream failures by kind",
                                       ["instance", "kind"], registry=r)
        self.fallbacks = Counter("tokenfleet_fallbacks", "Requests served by a fallback model, by why the "
                                 "requested one could not serve", ["model", "fallback", "reason"], registry=r)
        self.inflight = Gauge("tokenfleet_inflight", "Requests the gateway has in flight per instance",
                              ["instance"], registry=r)
        # Labelled children, looked up once: `.labels()` validates and locks on every call, and
        # these run several times per request. Bounded as the registry itself is: one child per
        # label set ever seen (fleet size x statuses).
        self._answered: dict[tuple[str, str, str, str], Any] = {}
        self._per_site: dict[tuple[str, str], _SiteChildren] = {}
        self._inflight: dict[tuple[str], Any] = {}
        self.overload_refused = Counter("tokenfleet_overload_refused", "/v1 requests refused with 503 "
                                        "gateway_overloaded, by the bound they hit", ["bound"], registry=r)
        # The KV event feed per instance (`gateway.kv_feed`): a feed that stopped is invisible in
        # routing (the index falls back to approximate), so it is visible here.
        self.kv_batches = Counter("tokenfleet_kv_event_batches", "Engine KV event batches applied to the "
                                  "router's cache index", ["instance"], registry=r)
        self.kv_interruptions = Counter("tokenfleet_kv_feed_interruptions", "Engine KV event feeds that "
                                        "stopped, by reason: ended (closed by the engine), error (broken or "
                                        "unreadable)", ["instance", "reason"], registry=r)
        self._kv_batches: dict[tuple[str], Any] = {}

    def watch_backlog(self, pending: Callable[[], float], inflight: Callable[[], float]) -> None:
        """Gauges of the overload bounds' counts (`gateway.overload`)."""
        Gauge("tokenfleet_requests_pending", "/v1 requests accepted whose response has not started",
              registry=self.registry).set_function(pending)
        Gauge("tokenfleet_requests_in_progress", "/v1 requests in progress, streams included",
              registry=self.registry).set_function(inflight)

    def watch_kv_drops(self, drops: Callable[[], Mapping[tuple[str, str], int]]) -> None:
        """`tokenfleet_kv_events_dropped_total{instance, reason}`, read from the engine adapters at
        each scrape (`EngineAdapter.kv_event_drops`): events their subscribers dropped before any
        feed read them (a full buffer, an unreadable message, an unknown topic)."""
        self.registry.register(_KVDrops(drops))

    def refused_overload(self, bound: str) -> None:
        self.overload_refused.labels(bound).inc()
        self.answered("", "", "", "503")

    def render(self, per_tenant: bool = False) -> bytes:
        return generate_latest(self.registry if per_tenant else _WithoutTenants(self.registry))

    def answered(self, model: str, site: str, instance: str, status: str) -> None:
        child_of(self._answered, self.requests, (model, site, instance, status)).inc()

    def record_outcome(self, model: str, outcome: RequestOutcome) -> None:
        key = (model, outcome.site)
        children = self._per_site.get(key)
        if children is None:
            children = self._per_site[key] = _SiteChildren(
                self.ttft.labels(*key), self.e2e.labels(*key), self.prompt_tokens.labels(*key),
                self.output_tokens.labels(*key), self.cached_tokens.labels(*key))
        if outcome.ttft_s is not None:
            children.ttft.observe(outcome.ttft_s)
        if outcome.e2e_s is not None and outcome.ok:
            children.e2e.observe(outcome.e2e_s)
        # (adding 0 leaves a counter as it is: no call, no lock, for the usual 0 cached tokens)
        if outcome.prompt_tokens:
            children.prompt_tokens.inc(outcome.prompt_tokens)
        if outcome.output_tokens:
            children.output_tokens.inc(outcome.output_tokens)
        if outcome.cached_tokens:
            children.cached_tokens.inc(outcome.cached_tokens)

    def set_inflight(self, instance: str, value: int) -> None:
        child_of(self._inflight, self.inflight, (instance,)).set(value)

    def kv_batch(self, instance: str) -> None:
        child_of(self._kv_batches, self.kv_batches, (instance,)).inc()

    def kv_interrupted(self, instance: str, reason: str) -> None:
        self.kv_interruptions.labels(instance, reason).inc()

    def forget_instance(self, instance: str) -> None:
        """An instance the planner stopped: its series go. Instance ids are never reused
        (`engine_adapters.managed`), so each add/remove cycle left its label sets in the registry
        and on /metrics for the gateway's life; the fleet's size bounds them only with this."""
        for key in [k for k in self._answered if k[2] == instance]:
            del self._answered[key]
            self.requests.remove(*key)
        if self._inflight.pop((instance,), None) is not None:
            self.inflight.remove(instance)
        _remove_instance_series(self.upstream_errors, instance, "kind")
        if self._kv_batches.pop((instance,), None) is not None:
            self.kv_batches.remove(instance)
        _remove_instance_series(self.kv_interruptions, instance, "reason")


def _remove_instance_series(counter: Counter, instance: str, other: str) -> None:
    """Remove every series of an ["instance", `other`]-labelled counter that is `instance`'s."""
    for value in {s.labels[other] for m in counter.collect() for s in m.samples if s.labels.get("instance") == instance}:
        counter.remove(instance, value)


class _KVDrops(Collector):
    def __init__(self, drops: Callable[[], Mapping[tuple[str, str], int]]) -> None:
        self._drops = drops

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily("tokenfleet_kv_events_dropped", "Engine KV events dropped before the "
                                     "router's index saw them, by reason: buffer_full (nobody read the "
                                     "instance's feed in time), malformed, unknown_topic",
                                     labels=["instance", "reason"])
        for (instance, reason), n in sorted(self._drops().items()):
            family.add_metric([instance, reason], n)
        yield family


@dataclass(frozen=True, slots=True)
class _SiteChildren:
    ttft: Any
    e2e: Any
    prompt_tokens: Any
    output_tokens: Any
    cached_tokens: Any


TENANT_LABEL = "tenant"


class _WithoutTenants:
    """A registry view with the tenant label aggregated away (what generate_latest needs: collect())."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            if not any(TENANT_LABEL in s.labels for s in family.samples):
                yield family
            elif family.type in ("counter", "histogram"):
                yield _summed(family)
            # per-tenant gauges are ratios or levels of one tenant: no sum, left out



def _summed(family: Metric) -> Metric:
    totals: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for s in family.samples:
        if s.name.endswith("_created"):
            continue  # a creation time does not add up
        labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != TENANT_LABEL))
        totals[(s.name, labels)] = totals.get((s.name, labels), 0.0) + s.value
    out = Metric(family.name, family.documentation, family.type, family.unit)
    for (name, labels), value in totals.items():
        out.add_sample(name, dict(labels), value)
    return out
