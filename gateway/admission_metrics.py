"""Prometheus figures of admission and goodput, read from the policy at scrape time.

One source of truth: the counters are the goodput ledger's cumulative totals per tenant
x class, the gauges the policy's live state, so /metrics and /v1/reports/goodput can
never disagree.

    tokenfleet_goodput_requests_total{tenant,class,result}   arrived admitted queued rejected completed
                                                             met_slo cancelled failed retried
    tokenfleet_admission_rejected_total{tenant,class,reason} budget_tokens budget_requests ...
    tokenfleet_goodput_output_tokens_total{tenant,class}     every output token streamed
    tokenfleet_goodput_tokens_total{tenant,class}            output tokens of requests that met their SLO
    tokenfleet_slo_attainment{tenant,class}                  met_slo / arrived, since start
    tokenfleet_admission_queued{model,class}                 waiting at the gateway
    tokenfleet_admission_in_flight{model,class}              admitted and not ended
    tokenfleet_admission_engine_wait_target_seconds{model}   the valve's target
    tokenfleet_admission_prefill_rate_per_instance{model}    the prefill budget (absent: unlimited)
    tokenfleet_admission_long_context_cap_per_instance{model}
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from slomax.ledger import COUNTERS

_RESULTS = [c for c in COUNTERS if not c.endswith("tokens")]


class AdmissionCollector(Collector):
    def __init__(self, policy: Any, clock: Callable[[], float]) -> None:
        self.policy = policy
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        totals = self.policy.ledger.totals
        req = CounterMetricFamily("tokenfleet_goodput_requests", "Requests by what became of them (goodput ledger)",
                                  labels=["tenant", "class", "result"])
        rej = CounterMetricFamily("tokenfleet_admission_rejected", "Requests admission turned away, by reason",
                                  labels=["tenant", "class", "reason"])
        out = CounterMetricFamily("tokenfleet_goodput_output_tokens", "Output tokens streamed",
                                  labels=["tenant", "class"])
        good = CounterMetricFamily("tokenfleet_goodput_tokens", "Output tokens of requests that met their SLO",
                                   labels=["tenant", "class"])
        att = GaugeMetricFamily("tokenfleet_slo_attainment", "Requests that met their SLO over requests arrived",
                                labels=["tenant", "class"])
        for (tenant, cls), cell in sorted(totals.items()):
            for r in _RESULTS:
                req.add_metric([tenant, cls, r], getattr(cell, r))
            for reason, n in sorted(cell.rejected_by.items()):
                rej.add_metric([tenant, cls, reason], n)
            out.add_metric([tenant, cls], cell.output_tokens)
            good.add_metric([tenant, cls], cell.goodput_tokens)
            if cell.attainment is not None:
                att.add_metric([tenant, cls], cell.attainment)
        yield from (req, rej, out, good, att)
        yield from self._live()

    def _live(self) -> Iterator[Metric]:
        snap = self.policy.snapshot(self.clock())
        queued = GaugeMetricFamily("tokenfleet_admission_queued", "Requests waiting at the gateway",
                                   labels=["model", "class"])
        inflight = GaugeMetricFamily("tokenfleet_admission_in_flight", "Admitted requests not yet ended",
                                     labels=["model", "class"])
        wait = GaugeMetricFamily("tokenfleet_admission_engine_wait_target_seconds",
                                 "How long an engine may take to start a new prefill (the valve's target)",
                                 labels=["model"])
        rate = GaugeMetricFamily("tokenfleet_admission_prefill_rate_per_instance",
                                 "Prefill budget, uncached prompt tokens/s per ready instance (absent: unlimited)",
                                 labels=["model"])
        cap = GaugeMetricFamily("tokenfleet_admission_long_context_cap_per_instance",
                                "Long-context requests in flight allowed per ready instance", labels=["model"])
        for model, p in sorted(snap.get("pools", {}).items()):
            for cls, c in sorted(p["classes"].items()):
                queued.add_metric([model, cls], c["queued"])
                inflight.add_metric([model, cls], c["in_flight"])
            wait.add_metric([model], p["engine_wait_target_s"])
            if p["prefill_rate_per_instance"] is not None:
                rate.add_metric([model], p["prefill_rate_per_instance"])
            cap.add_metric([model], p["long_context_cap_per_instance"])
        yield from (queued, inflight, wait, rate, cap)
