"""Metric arithmetic on hand-made request records: percentiles, goodput, SLO attainment, splits."""

from __future__ import annotations

import math

import pytest

from fleetcore.slo import DEFAULT_SLOS, ClassSLO
from fleetsim.metrics import RequestRecord, percentiles, run_span, slo_met, summarize, summarize_all, ttft_values_ms
from fleetsim.report import RESULT_KEYS, build_report, format_table, result_row


def rec(rid: str, status: str = "completed", *, cls: str | None = "interactive", tenant: str = "t1",
        arrival: float = 0.0, end: float | None = None, out: int = 100, prompt: int = 1000, cached: int = 0,
        ttft: float | None = 0.5, tpot: float | None = 0.02, e2e: float | None = None,
        queue: float | None = 0.1, deadline: float | None = None) -> RequestRecord:
    if status != "completed":
        tpot = e2e = None
        if status == "rejected":
            ttft = queue = None
            out = 0
    elif e2e is None:
        e2e = (ttft or 0.0) + (tpot or 0.0) * (out - 1)
    return RequestRecord(rid, arrival, prompt, status, tenant=tenant, request_class=cls, output_tokens=out,
                         cached_tokens=cached, ttft_s=ttft, tpot_s=tpot, e2e_s=e2e, queue_s=queue,
                         end_s=end if end is not None else arrival + (e2e or 0.0), deadline_s=deadline)


def test_percentiles_interpolate_linearly_and_empty_is_none() -> None:
    p = percentiles([1.0, 2.0, 3.0, 4.0], (50, 90), scale=1000.0, with_mean=True)
    assert p == {"p50": 2500.0, "p90": pytest.approx(3700.0), "mean": 2500.0}
    assert percentiles([], (50, 95)) == {"p50": None, "p95": None}
    assert percentiles([], (50,), with_mean=True) == {"p50": None, "mean": None}
    one = percentiles([0.25], (50, 99), 1e3)
    assert one == {"p50": 250.0, "p99": 250.0}


def test_slo_met_per_class() -> None:
    assert slo_met(rec("a", ttft=0.9, tpot=0.049), DEFAULT_SLOS)
    assert not slo_met(rec("b", ttft=1.1), DEFAULT_SLOS)  # interactive TTFT > 1 s
    assert not slo_met(rec("c", tpot=0.051), DEFAULT_SLOS)  # interactive TPOT > 50 ms
    assert slo_met(rec("d", cls="long_context", ttft=7.9, tpot=0.079), DEFAULT_SLOS)
    assert not slo_met(rec("e", cls="long_context", ttft=8.1), DEFAULT_SLOS)
    assert slo_met(rec("f", cls="batch", ttft=100.0, tpot=1.0, e2e=599.0), DEFAULT_SLOS)  # batch: only the deadline
    assert not slo_met(rec("g", cls="batch", e2e=601.0), DEFAULT_SLOS)
    assert not slo_met(rec("h", status="cancelled"), DEFAULT_SLOS)
    assert not slo_met(rec("i", status="rejected"), DEFAULT_SLOS)
    # A request's own deadline binds on top of its class SLO.
    assert not slo_met(rec("j", ttft=0.5, tpot=0.01, out=11, deadline=0.5), DEFAULT_SLOS)
    # No class given: by length (>= 8192 tokens is long_context, TTFT <= 8 s).
    assert slo_met(rec("k", cls=None, prompt=9000, ttft=5.0), DEFAULT_SLOS)
    assert not slo_met(rec("l", cls=None, prompt=8000, ttft=5.0), DEFAULT_SLOS)
    # Configurable SLOs; an unknown class has no bound.
    assert slo_met(rec("m", ttft=1.5), {"interactive": ClassSLO(ttft_s=2.0)})
    assert slo_met(rec("n", cls="custom", ttft=99.0), DEFAULT_SLOS)


def hand_made() -> list[RequestRecord]:
    """10 s run. Met: a (100 tok), d (200 tok), f (50 tok); missed: b, c, g, cancelled e, rejected x."""
    return [
        rec("a", arrival=0.0, out=100, ttft=0.5, tpot=0.02, prompt=1000, cached=500),
        rec("b", arrival=1.0, out=100, ttft=1.5, tpot=0.02),  # TTFT miss
        rec("c", arrival=2.0, out=100, ttft=0.5, tpot=0.06),  # TPOT miss
        rec("d", cls="long_context", arrival=0.0, out=200, ttft=6.0, tpot=0.01, prompt=10_000, cached=8000),
        rec("e", status="cancelled", arrival=3.0, end=5.0, out=20, ttft=0.4),  # got 20 tokens, then gave up
        rec("f", cls="batch", tenant="t2", arrival=0.0, out=50, ttft=3.0, tpot=0.1, e2e=7.9),
        rec("g", cls="batch", tenant="t2", arrival=0.0, out=70, ttft=3.0, tpot=0.1, e2e=9.0, deadline=8.0),
        rec("x", status="rejected", arrival=4.0, end=4.0),
        rec("z", arrival=6.0, end=10.0, out=30, ttft=2.0, tpot=0.02, e2e=4.0, tenant="t2"),  # TTFT miss, sets span
    ]


def test_goodput_counts_only_completed_requests_within_slo() -> None:
    records = hand_made()
    assert run_span(records) == 10.0
    s = summarize(records, 10.0, DEFAULT_SLOS)
    assert s["requests"] == 9 and s["completed"] == 7 and s["rejected"] == 1 and s["cancelled"] == 1
    assert s["goodput_tok_s"] == pytest.approx((100 + 200 + 50) / 10.0)
    # Raw throughput: everything clients received, the cancelled request's 20 tokens included.
    assert s["throughput_tok_s"] == pytest.approx((100 * 3 + 200 + 20 + 50 + 70 + 30) / 10.0)
    # Attainment over arrivals: rejected and cancelled are misses.
    assert s["slo_attainment"] == pytest.approx(3 / 9)
    # Cache hits over requests that reached prefill (the rejected one did not).
    prompt = 1000 * 7 + 10_000  # a,b,c,e,f,g,z at 1000 + d
    assert s["cache_hit_rate"] == pytest.approx((500 + 8000) / prompt)
    # Latency percentiles only over completed requests: the cancelled one's 0.4 s TTFT is not in.
    assert s["ttft_ms"]["p50"] == pytest.approx(2000.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(1e3 * (0.5 + 1.5 + 0.5 + 6.0 + 3.0 + 3.0 + 2.0) / 7)


def test_rejected_only_run_has_zero_attainment_and_null_latencies() -> None:
    records = [rec("r1", status="rejected"), rec("r2", status="rejected", arrival=1.0, end=1.0)]
    s = summarize_all(records, DEFAULT_SLOS)
    assert s["slo_attainment"] == 0.0 and s["goodput_tok_s"] == 0.0 and s["completed"] == 0
    assert s["ttft_ms"]["p50"] is None and s["tpot_ms"]["p95"] is None and s["cache_hit_rate"] is None
    empty = summarize_all([], DEFAULT_SLOS)
    assert empty["requests"] == 0 and empty["slo_attainment"] is None


def test_by_class_and_by_tenant_split_and_add_up() -> None:
    records = hand_made()
    s = summarize_all(records, DEFAULT_SLOS)
    assert set(s["by_class"]) == {"interactive", "long_context", "batch"}
    inter, long_, batch = s["by_class"]["interactive"], s["by_class"]["long_context"], s["by_class"]["batch"]
    assert inter["requests"] == 6 and inter["rejected"] == 1 and inter["cancelled"] == 1
    assert inter["goodput_tok_s"] == pytest.approx(100 / 10.0)
    assert inter["slo_attainment"] == pytest.approx(1 / 6)
    assert long_["slo_attainment"] == 1.0 and long_["goodput_tok_s"] == pytest.approx(20.0)
    assert batch["slo_attainment"] == pytest.approx(0.5)  # g missed its own 8 s deadline
    # Same span for every group, so per-class goodput and throughput add up to the total.
    assert sum(g["goodput_tok_s"] for g in s["by_class"].values()) == pytest.approx(s["goodput_tok_s"])
    assert sum(g["throughput_tok_s"] for g in s["by_tenant"].values()) == pytest.approx(s["throughput_tok_s"])
    assert set(s["by_tenant"]) == {"t1", "t2"} and s["by_tenant"]["t2"]["requests"] == 3


def test_report_row_has_documented_keys_and_table_renders() -> None:
    s = summarize_all(hand_made(), DEFAULT_SLOS)
    row = result_row("p1", s, wall_s=1.23456)
    assert list(row)[:len(RESULT_KEYS)] == list(RESULT_KEYS)
    assert row["wall_s"] == 1.235
    assert set(row["ttft_ms"]) == {"p50", "p90", "p95", "p99", "mean"} and set(row["tpot_ms"]) == {"p50", "p95"}
    for group in row["by_class"].values():
        assert {"ttft_ms", "goodput_tok_s", "slo_attainment", "rejected"} <= set(group)
    rep = build_report({"name": "w"}, {"instances": 1}, [row, result_row("p2", s, 2.0)])
    assert set(rep) == {"workload", "fleet", "results"}
    table = format_table(rep["results"])
    lines = table.splitlines()
    assert lines[0].startswith("policy") and "good/1st" in lines[0]
    assert lines[2].split()[0] == "p1" and "1.00x" in lines[3]
    assert "interactive" in table and "long_context" in table


def test_ttft_values_sorted_completed_only() -> None:
    v = ttft_values_ms(hand_made())
    assert len(v) == 7 and all(v[i] <= v[i + 1] for i in range(len(v) - 1))
    assert math.isclose(v[0], 500.0)
