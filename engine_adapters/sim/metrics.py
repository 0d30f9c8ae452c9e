"""Prometheus metrics of a simulated worker, under vLLM's names.

Gateways and peer routers scrape real vLLM engines for these exact names, so a
simulated worker must look the same on /metrics. Each worker owns a private
CollectorRegistry (several workers may live in one test process).

Latency histograms are in engine (physical) seconds, not wall seconds: with a
time_scale of 0.02 the wall clock runs 50x faster, but a TTFT of 0.2 s means
what it would mean on the real GPU.
"""

from __future__ import annotations

from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the worker)

# vLLM's buckets, with finer low buckets for inter-token latency: a decode step
# of an 8B model on an H100 takes ~6-10 ms, below vLLM's first 10 ms bucket.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.002, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                   30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class EngineCounters(Protocol):
    """What the metrics read from the engine at scrape time."""

    num_running: int
    num_waiting: int
    kv_usage: float
    prompt_tokens_total: int
    generation_tokens_total: int
    num_preemptions: int
    prefix_queries_tokens: int
    prefix_hits_tokens: int


class DriverCounters(Protocol):
    """What the metrics read from the driver at scrape time (`DriverStats`)."""

    steps: int
    late_s: float
    late_max_s: float


class SimMetrics:
    """The vLLM metric set; implements the driver's DriverObserver hooks."""

    def __init__(self, model_name: str, block_size: int, num_gpu_blocks: int,
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        r = self.registry
        lbl = ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch.", lbl, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", lbl, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = 100%).", lbl, registry=r)
        # prometheus_client appends `_total` to counter names itself.
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", lbl, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed.", lbl, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", lbl,
                                      registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", lbl, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative preemptions.", lbl, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests.", lbl + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (engine s).", lbl,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency (engine s).", lbl,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency (engine s).", lbl,
                             buckets=REQUEST_BUCKETS, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time in the waiting queue (engine s).", lbl,
                               buckets=REQUEST_BUCKETS, registry=r)
        # Not vLLM's: how far the worker's loop fell behind the engine's schedule (`DriverStats`), in
        # wall seconds: what a shared host adds to every step, which no model of the engine predicts.
        self.steps = Counter("tokenfleet_sim:steps", "Engine steps run.", lbl, registry=r)
        self.late = Counter("tokenfleet_sim:step_late_seconds", "Wall seconds steps were delivered after "
                            "their engine time (the loop woke late).", lbl, registry=r)
        self.late_max = Gauge("tokenfleet_sim:step_late_max_seconds", "The latest step delivery (wall s).", lbl,
                              registry=r)
        cache_info = Gauge("vllm:cache_config_info", "Information of the KV cache config.",
                           ["block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype"], registry=r)
        cache_info.labels(block_size=str(block_size), num_gpu_blocks=str(num_gpu_blocks),
                          enable_prefix_caching="True", cache_dtype="auto").set(1)
        # Engine totals already folded into the counters (counters only go up by deltas).
        self._seen: dict[str, float] = {}
        self._m = model_name
        # Create every labelled child now so a fresh worker exports zeros, as vLLM does
        # (a scraper computing rates needs the series before the first request).
        for metric in (self.running, self.waiting, self.kv_usage, self.prompt_tokens, self.generation_tokens,
                       self.prefix_queries, self.prefix_hits, self.preemptions, self.ttft, self.itl,
                       self.e2e, self.queue, self.steps, self.late, self.late_max):
            metric.labels(model_name)
        for reason in ("stop", "length", "abort"):
            self.success.labels(model_name, reason)

    # -- driver hooks -----------------------------------------------------------

    def on_first_token(self, queue_time: float, ttft: float) -> None:
        self.queue.labels(self._m).observe(queue_time)
        self.ttft.labels(self._m).observe(ttft)

    def on_token(self, inter_token_latency: float) -> None:
        self.itl.labels(self._m).observe(inter_token_latency)

    def on_finished(self, e2e_latency: float, finish_reason: str) -> None:
        self.e2e.labels(self._m).observe(max(0.0, e2e_latency))
        self.success.labels(self._m, finish_reason).inc()

    # -- scrape -----------------------------------------------------------------

    def refresh(self, engine: EngineCounters) -> None:
        """Copy the engine's gauges and fold its cumulative totals into the counters."""
        m = self._m
        self.running.labels(m).set(engine.num_running)
        self.waiting.labels(m).set(engine.num_waiting)
        self.kv_usage.labels(m).set(engine.kv_usage)
        self._fold("prompt", self.prompt_tokens, engine.prompt_tokens_total)
        self._fold("gen", self.generation_tokens, engine.generation_tokens_total)
        self._fold("pq", self.prefix_queries, engine.prefix_queries_tokens)
        self._fold("ph", self.prefix_hits, engine.prefix_hits_tokens)
        self._fold("pre", self.preemptions, engine.num_preemptions)

    def refresh_driver(self, stats: DriverCounters) -> None:
        """Fold the driver's step counts and lateness (`DriverStats`) in."""
        self._fold("steps", self.steps, stats.steps)
        self._fold("late", self.late, stats.late_s)
        self.late_max.labels(self._m).set(stats.late_max_s)

    def _fold(self, key: str, counter: Counter, total: float) -> None:
        delta = total - self._seen.get(key, 0.0)
        if delta > 0:
            counter.labels(self._m).inc(delta)
            self._seen[key] = total

    def render(self, engine: EngineCounters) -> bytes:
        """The /metrics body (Prometheus text format)."""
        self.refresh(engine)
        return generate_latest(self.registry)
