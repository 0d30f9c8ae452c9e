"""`gateway.metrics.LabelledHistogram` against prometheus_client's `Histogram`: the same /metrics
text, byte for byte, after the same observations (random, NaN, infinities, negatives, values on
the bounds), with `_created` series and without, through `GatewayMetrics.render` and the
per-class histograms of telemetry (public view with the tenant summed away, and the admin one)."""

from __future__ import annotations

import math
import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client import metrics as prometheus_metrics

from fleetcore.types import RequestOutcome
from gateway import metrics as gm
from gateway import telemetry
from gateway.metrics import GatewayMetrics, LabelledHistogram
from gateway.telemetry import QUEUE_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS, ClassHistograms


def _value(rng: random.Random, bounds: tuple[float, ...]) -> float:
    kind = rng.randrange(8)
    if kind == 0:
        return rng.choice(bounds)  # on a bound: that bucket (<=), not the next
    if kind == 1:
        return math.nextafter(rng.choice(bounds), math.inf)
    if kind == 2:
        return rng.choice([math.nan, math.inf, -math.inf, 0.0, -0.0, -1.5, 1e300])
    return rng.random() * rng.choice([0.01, 1, 10, 1000])


@pytest.fixture(params=[True, False], ids=["created", "no-created"])
def created(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setattr(prometheus_metrics, "_use_created", request.param)
    monkeypatch.setattr("time.time", lambda: 1_733_200_000.25)  # (both sides stamp children with it)
    return request.param


@pytest.mark.parametrize("seed", range(3))
def test_same_exposition_as_prometheus_histogram(seed: int, created: bool) -> None:
    rng = random.Random(seed)
    buckets = sorted(rng.sample([0.001, 0.01, 0.05, 0.1, 0.25, 1, 2.5, 10, 60, 600], rng.randrange(1, 8)))
    if rng.random() < 0.3:
        buckets = [-1.0] + buckets  # a negative first bound: no _sum series, as Histogram writes it
    ours_reg, ref_reg = CollectorRegistry(), CollectorRegistry()
    ours = LabelledHistogram("x_seconds", "help text", ["model", "site"], buckets=buckets, registry=ours_reg)
    ref = Histogram("x_seconds", "help text", ["model", "site"], buckets=buckets, registry=ref_reg)
    bounds = tuple(float(b) for b in buckets) + (math.inf,)
    assert generate_latest(ours_reg) == generate_latest(ref_reg)  # (no series yet)
    for _ in range(400):
        key = (rng.choice(["m1", "m2", "m\"3\n"]), rng.choice(["a", "b", 7]))
        v = _value(rng, bounds)
        ours.labels(*key).observe(v)
        ref.labels(*key).observe(v)
    text = generate_latest(ours_reg)
    assert text == generate_latest(ref_reg)
    assert (b"_created" in text) == created and b"_bucket" in text


def test_gateway_and_class_histograms_render_as_before(monkeypatch: pytest.MonkeyPatch, created: bool) -> None:
    """GatewayMetrics and ClassHistograms built on prometheus_client's Histogram (what they were)
    and on LabelledHistogram, fed the same outcomes: render() and render(per_tenant=True) equal."""
    ours_m = GatewayMetrics()
    ours_c = ClassHistograms(ours_m.registry)
    with monkeypatch.context() as m:
        m.setattr(gm, "LabelledHistogram", Histogram)
        m.setattr(telemetry, "LabelledHistogram", Histogram)
        ref_m = GatewayMetrics()
        ref_c = ClassHistograms(ref_m.registry)
    assert isinstance(ref_m.ttft, Histogram) and isinstance(ref_c.tpot, Histogram)
    assert isinstance(ours_m.e2e, LabelledHistogram) and isinstance(ours_c.queue_wait, LabelledHistogram)
    rng = random.Random(11)
    all_bounds = tuple(TTFT_BUCKETS) + tuple(TPOT_BUCKETS) + tuple(QUEUE_BUCKETS) + tuple(gm._E2E_BUCKETS)
    for i in range(600):
        model, site = rng.choice(["m1", "m2"]), rng.choice(["use1", "euw1"])
        out = RequestOutcome(f"r{i}", "i1", site, rng.random() < 0.9, rng.randrange(1, 200),
                             ttft_s=rng.choice([None, _value(rng, all_bounds)]),
                             e2e_s=rng.choice([None, _value(rng, all_bounds)]),
                             output_tokens=rng.randrange(0, 9), cached_tokens=rng.choice([0, 0, 16]))
        key = (model, rng.choice(["interactive", "batch"]), rng.choice(["t1", "t2", "t3"]))
        figures = [rng.choice([None, _value(rng, all_bounds)]) for _ in range(3)]
        for metrics, classes in ((ours_m, ours_c), (ref_m, ref_c)):
            metrics.record_outcome(model, out)
            classes.observe(key, *figures)
    for per_tenant in (False, True):
        assert ours_m.render(per_tenant) == ref_m.render(per_tenant)
    assert b"gen_ai_server_time_per_output_token_seconds_bucket" in ours_m.render(False)


def test_labels_checks_the_label_count() -> None:
    h = LabelledHistogram("y_seconds", "h", ["a", "b"], buckets=[1], registry=CollectorRegistry())
    with pytest.raises(ValueError):
        h.labels("only one")
    with pytest.raises(ValueError):
        LabelledHistogram("z_seconds", "h", ["a"], buckets=[2, 1], registry=CollectorRegistry())
    reg = CollectorRegistry()
    LabelledHistogram("w_seconds", "h", ["a"], buckets=[1], registry=reg)
    with pytest.raises(ValueError):  # the registry sees its names: a duplicate is refused
        LabelledHistogram("w_seconds", "h", ["a"], buckets=[1], registry=reg)


def test_the_cuts_cost_benchmark_runs() -> None:
    from tests.bench_scripts import load_bench

    line = load_bench("cuts_cost").measure(quick=True)
    for part in ("tokenize bench", "tokenize place_cost", "tokenize new pieces", "tokenize docs once", "histograms",
                 "render"):
        assert part in line


def test_a_removed_instances_series_are_forgotten() -> None:
    """Instance ids the planner creates are never reused: the series of one it stopped must go,
    or /metrics grows by its label sets with every add/remove cycle."""
    m = GatewayMetrics()
    for iid in ("s/m/0", "s/m/1"):
        m.answered("m", "s", iid, "200")
        m.answered("m", "s", iid, "502")
        m.set_inflight(iid, 1)
        m.upstream_errors.labels(iid, "connect").inc()
        m.upstream_errors.labels(iid, "stall").inc()
    m.forget_instance("s/m/0")
    text = m.render().decode()
    assert 'instance="s/m/0"' not in text
    assert text.count('instance="s/m/1"') >= 5
    m.answered("m", "s", "s/m/0", "200")  # a late answer still counts (a series again, not an error)
