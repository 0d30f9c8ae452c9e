"""The scheduler-forward TTFT (tokenpilot/forward.py): its step time against the engine's roofline,
its arithmetic of queued chunks, and, in the simulator, predictions closer to what requests got than
the cost model's own queue + prefill seconds; a request held by admission teaches no slow GPU."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fleetcore import hardware
from fleetcore.fleet_config import load_fleet_file
from fleetcore.roofline import StepTimer
from fleetcore.types import InstanceSnapshot, RequestOutcome, RequestProfile
from tests.bench_scripts import load_bench
from tokenpilot import score_kernel as sk
from tokenpilot.forward import forward_ttft, step_s
from tokenpilot.learning import StepFit
from tokenpilot.priors import prior_from_physics
from tokenpilot.router import TokenPilot, TokenPilotConfig

REPO = Path(__file__).resolve().parents[1]


def _factors(fit: StepFit, overhead_f: float, token_f: float) -> tuple[float, float] | None:
    """The fitted (fixed-cost, per-token) factors: `StepFit.fit`'s first two, None while data is thin."""
    got = fit.fit(overhead_f, token_f)
    return None if got is None else (got[0], got[1])


@pytest.mark.parametrize("spec,gpu,tp,budget", [("llama-3.1-8b", "H100", 1, 2048), ("llama-3.1-70b", "H200", 2, 8192)])
def test_step_time_follows_the_roofline_on_mixed_batches(spec: str, gpu: str, tp: int, budget: int) -> None:
    prior = prior_from_physics(spec, gpu, tp, max_batched_tokens=budget)
    timer = StepTimer(hardware.model(spec), hardware.gpu(gpu), tp)
    worst = 0.0
    for decodes, ctx_each in ((0, 0), (16, 2000), (64, 2000), (128, 4000)):
        for prefill in (0, 64, budget // 8, budget // 2, budget - decodes):
            if prefill + decodes == 0 or prefill < 0:
                continue
            real = timer.step_time([(prefill, 0)] if prefill else [], [ctx_each] * decodes)
            ours = step_s(prefill + decodes, decodes * ctx_each, prior.prefill_token_s, prior.kv_read_s_per_token,
                          prior.step_overhead_s, budget)
            worst = max(worst, abs(ours - real) / real)
    # (the cost model's sum of compute and memory ran 20-50% high on such steps)
    assert worst < 0.12, worst


def test_queued_chunks_add_full_steps() -> None:
    token_s, overhead, budget = 1e-5, 5e-3, 2048.0
    full = step_s(budget, 0.0, token_s, 0.0, overhead, budget)

    def ttft(ahead: float, uncached: float, decoding: float = 0.0) -> float:
        return forward_ttft(ahead, uncached, 0.0, decoding, 0.0, budget, token_s, 0.0, 0.0, overhead)

    assert ttft(0, 2048) == pytest.approx(full)  # idle: its own full chunk, nothing under way
    assert ttft(0, 100) == pytest.approx(step_s(100.0, 0.0, token_s, 0.0, overhead, budget))
    # Three chunks queued ahead: half the step under way, then the rest of them, then its own.
    assert ttft(3 * 2048, 2048) == pytest.approx(0.5 * full + 3 * full + full)
    # Decoding streams take a token each of every step: the same prompt needs a second step for
    # its last 48 tokens (with the 48 decodes), after half the decode step under way.
    small = step_s(96.0, 0.0, token_s, 0.0, overhead, budget)
    assert ttft(0, 2048, decoding=48) == pytest.approx(0.5 * step_s(48.0, 0.0, token_s, 0.0, overhead, budget)
                                                       + full + small)


def test_in_the_simulator_it_predicts_better_than_the_cost_models_seconds() -> None:
    from fleetsim.simulator import FleetSimulator, HashCache, fleet_instances, prepare, spec_prior
    from workloads import head, load_trace, scale_rate

    fleet = load_fleet_file(REPO / "bench" / "fleet_slomax.yaml")  # 4 x 8B on H100, 2,048-token chunks
    wl = scale_rate(head(load_trace(REPO / "traces" / "AzureLLMInferenceTrace_conv.csv"), 1500), 12.0)
    rows: list[tuple[float, float, float]] = []
    pred: dict[str, tuple[float, float]] = {}

    class Recorder(TokenPilot):
        def route(self, profile, candidates, now):  # type: ignore[no-untyped-def]
            d = super().route(profile, candidates, now)
            c = next(c for c in d.candidates if c.name == d.instance_id)
            pred[profile.request_id] = (c.detail["prior_ttft_s"], c.detail["forward_ttft_s"])
            return d

        def observe(self, outcome: RequestOutcome) -> None:
            p = pred.pop(outcome.request_id, None)
            if p is not None and outcome.ok and outcome.ttft_s:
                # (the engine's time, which both predict: less the 2 ms round trip to the site, which
                # the router no longer learns as engine speed since i19-unify)
                rows.append((*p, outcome.ttft_s - outcome.network_s))
            super().observe(outcome)

    router = Recorder(seed=0)
    for spec in fleet_instances(fleet):
        router.register_instance(spec.instance_id, spec_prior(spec))
    FleetSimulator(fleet, router).run(prepare(wl.requests, fleet, hash_cache=HashCache()))
    r = np.array(rows)
    assert len(r) > 1000
    queued = r[:, 2] > 1.5 * np.median(r[:, 2])  # where the queue matters
    assert queued.sum() > 100

    def err(j: int, m: np.ndarray) -> float:
        return float(np.median(np.abs(r[m, j] - r[m, 2]) / r[m, 2]))

    everyone = np.ones(len(r), dtype=bool)
    # (measured at i19-unify, against the engine's time: 8% vs 13% for all, 4% vs 8% where the queue matters;
    # 11% vs 17%, 12% vs 15% before, against the TTFT with the round trip in it)
    assert err(1, everyone) < 0.75 * err(0, everyone), (err(1, everyone), err(0, everyone))
    assert err(1, queued) < 0.85 * err(0, queued), (err(1, queued), err(0, queued))
    assert err(1, everyone) < 0.2


def test_time_held_before_dispatch_is_not_taken_for_a_slow_gpu() -> None:
    prior = prior_from_physics("llama-3.1-8b", "H100")
    tp = TokenPilot({"a": prior}, config=TokenPilotConfig(explore=0.0))
    a = InstanceSnapshot(instance_id="a", site="s", model="m", version="v", url="http://a")
    t = 1000.0
    for i in range(200):  # each held 5 s by admission, then served exactly as predicted
        p = RequestProfile(request_id=f"r{i}", model="m", prompt_tokens=1000, stream=True, arrival=t - 5.0,
                           block_hashes=tuple(range(i * 100, i * 100 + 62)))
        d = tp.route(p, [a], t)
        assert d.predicted_ttft_s is not None
        predicted = d.candidates[0].detail["prior_ttft_s"]
        tp.on_first_token(p.request_id, t + predicted)
        tp.observe(RequestOutcome(p.request_id, "a", "s", ok=True, prompt_tokens=1000, output_tokens=1,
                                  ttft_s=5.0 + predicted))
        t += 10.0
    assert tp.explain("a")["prefill_speed_factor"] == pytest.approx(1.0, abs=0.02)


def test_tokens_ahead_follow_dispatches_and_first_tokens() -> None:
    prior = prior_from_physics("llama-3.1-8b", "H100", max_batched_tokens=2048)
    tp = TokenPilot({"a": prior}, config=TokenPilotConfig(explore=0.0))
    a = InstanceSnapshot(instance_id="a", site="s", model="m", version="v", url="http://a")

    def send(i: int, now: float) -> float:
        p = RequestProfile(request_id=f"r{i}", model="m", prompt_tokens=4096, stream=True,
                           block_hashes=tuple(range(i * 1000, i * 1000 + 256)))
        d = tp.route(p, [a], now)
        return float(d.candidates[0].detail["ahead_tokens"])

    assert send(0, 0.0) == 0.0
    assert send(1, 0.0) == pytest.approx(4096)  # r0 is ahead, none of it done at the same instant
    assert send(2, 0.0) == pytest.approx(8192)
    # r0 and r1 through (their first tokens): only r2 is ahead, less what the clock says is done,
    # but no less than r2 minus one chunk (a step may already have carried part of it)
    tp.on_first_token("r0", 0.1)
    tp.on_first_token("r1", 0.2)
    ahead = send(3, 0.2)
    assert 4096 - 2048 - 1e-6 <= ahead <= 4096 + 1e-6
    # much later, with no first token seen, the clock drains what is left of r2 but not r3's
    # share below the bound: r2 and r3 are outstanding, so at least r3 - a chunk remains
    assert send(4, 60.0) >= 4096 - 2048 - 1e-6


# -- the forward TTFT's own step costs (i19-pred): fixed cost and per-token cost learned apart ----------

def test_forward_parts_add_up_to_the_forward_ttft() -> None:
    from tokenpilot.forward import forward_parts

    rng = np.random.default_rng(3)
    for _ in range(3000):
        ahead = float(rng.choice([0.0, rng.uniform(0, 30000)]))
        uncached, cached = rng.uniform(1, 9000), float(rng.choice([0.0, rng.uniform(0, 5000)]))
        decoding = float(rng.choice([0, rng.integers(0, 100)]))
        context, budget = decoding * rng.uniform(0, 4000), float(rng.choice([2048.0, 8192.0]))
        token_s, attn_s, kv_s, overhead = rng.uniform(1e-7, 1e-5), rng.uniform(0, 1e-10), rng.uniform(0, 1e-7), \
            rng.uniform(1e-3, 0.03)
        token_f, overhead_f = rng.uniform(1 / 16, 4), rng.uniform(1 / 16, 4)
        a, b, c, d = forward_parts(ahead, uncached, cached, decoding, context, budget, token_s, attn_s, kv_s,
                                   overhead, token_f, overhead_f)
        want = forward_ttft(ahead, uncached, cached, decoding, context, budget, token_s * token_f, attn_s * token_f,
                            kv_s, overhead * overhead_f)
        assert overhead_f * a + token_f * b + c == pytest.approx(want, rel=1e-12)
        assert a > 0 and b >= 0 and c >= 0
        # d: the steps waited through (half the one under way, then every chunk to its own last)
        assert d == np.ceil((ahead + uncached) / max(budget - decoding, 1.0)) + (0.5 if ahead + decoding > 0 else 0.0)


def test_step_fit_recovers_both_factors_and_holds_the_unidentified_one() -> None:

    rng = np.random.default_rng(0)
    fit = StepFit()
    assert _factors(fit, 1.0, 0.5) is None  # no data: no fit
    for i in range(200):
        a, b, c = rng.uniform(0.02, 0.06), rng.uniform(0.0, 0.2), rng.uniform(0.0, 0.002)
        fit.update(a, b, c, 0.25 * a + 0.4 * b + c, a + 0.5 * b + c)
        if i + 1 < fit.min_samples:
            assert _factors(fit, 1.0, 0.5) is None  # thin data: the caller keeps its prior
    x, t = _factors(fit, 1.0, 0.5)
    assert x == pytest.approx(0.25, rel=0.08) and t == pytest.approx(0.4, rel=0.08)
    # Every outcome one and the same kind (a, b in one proportion): the data says only their sum;
    # the ridge keeps the pair near the fallback along the unidentified direction, within bounds.
    same = StepFit()
    for _ in range(100):
        same.update(0.03, 0.01, 0.0, 0.25 * 0.03 + 0.4 * 0.01, 0.035)
    x, t = _factors(same, 1.0, 0.5)
    assert 0.03 * x + 0.01 * t == pytest.approx(0.25 * 0.03 + 0.4 * 0.01, rel=0.15)
    assert same.lo <= x <= same.hi and same.lo <= t <= same.hi
    # A prior 100x off is held at the bounds, not fitted past them.
    far = StepFit()
    for _ in range(100):
        a, b = rng.uniform(0.02, 0.06), rng.uniform(0.0, 0.2)
        far.update(a, b, 0.0, 0.001 * (a + b), a + b)
    assert _factors(far, 1.0, 1.0) == (far.lo, far.lo)


def _wrong_fixed_cost_router(outcomes: int, network_s: float = 0.0) -> tuple[TokenPilot, list[float], Any]:
    """One 70B-on-2xH200 instance whose engine steps cost a quarter of the prior's fixed cost and
    a third of its per-token cost (the shape of bench/fleet_noisy_live.yaml's 4x-fast sim workers,
    whose short prompts the prior over-predicted 2-2.7x): `outcomes` requests one at a time, each
    observed at its true TTFT (plus `network_s`, a round trip to the site, reported as such). Returns the
    router, each prediction's relative error, and the prior."""
    prior = prior_from_physics("llama-3.1-70b", "H200", 2)
    tp = TokenPilot({"a": prior})
    snap = [InstanceSnapshot("a", "s", "m", "v", "http://a")]
    rng = np.random.default_rng(1)
    errors = []
    for i in range(outcomes):
        n = int(rng.integers(20, 4000))
        profile = RequestProfile(f"r{i}", "m", n, stream=True)
        d = tp.route(profile, snap, float(i))
        true = forward_ttft(0.0, n, 0.0, 0.0, 0.0, prior.max_batched_tokens, prior.prefill_token_s / 3,
                            prior.attn_s_per_token_ctx / 3, 0.0, prior.step_overhead_s / 4)
        errors.append(abs(d.predicted_ttft_s - true) / true)
        tp.on_first_token(profile.request_id, i + true)
        tp.observe(RequestOutcome(profile.request_id, "a", "s", True, prompt_tokens=n, output_tokens=8,
                                  ttft_s=true + network_s, mean_tpot_s=0.005, network_s=network_s))
    return tp, errors, prior


def test_a_wrong_step_fixed_cost_is_learned_by_the_forward_ttft() -> None:
    tp, errors, _ = _wrong_fixed_cost_router(400)
    # Before the fit: the prior's fixed cost, ~2-4x over on short prompts, under on long ones.
    assert np.median(errors[:30]) > 0.5
    # Once fitted (at 32 outcomes): both step costs near the truth, and the prediction with them.
    assert np.median(errors[-200:]) < 0.05 and np.percentile(errors[-200:], 90) < 0.08
    overhead_f, token_f = tp.forward_factors("a")
    assert token_f is not None
    assert overhead_f == pytest.approx(0.25, abs=0.08) and token_f == pytest.approx(1 / 3, abs=0.08)


def test_a_remote_sites_round_trip_is_not_learned_as_engine_time() -> None:
    """An outcome's TTFT carries the round trip to its site (`RequestOutcome.network_s`, 62-75 ms to
    the 3-site fleet's remote sites); the router learns engine speeds from the rest. Before i19-unify
    the step fit took it for step fixed cost (its factor at the bound 4 on nearly every remote
    instance), and the site chooser then counted the round trip twice and spilled too little."""
    near, _, _ = _wrong_fixed_cost_router(200)
    far, _, _ = _wrong_fixed_cost_router(200, network_s=0.07)
    # (the same up to the rounding of (ttft + 0.07) - 0.07)
    assert far.forward_factors("a") == pytest.approx(near.forward_factors("a"), rel=1e-9)
    assert far.explain("a")["prefill_speed_factor"] == pytest.approx(near.explain("a")["prefill_speed_factor"],
                                                                      rel=1e-9)
    assert near.forward_factors("a")[0] < 0.5  # (the engine's fixed cost, a quarter of the prior's)


def test_thin_data_keeps_the_prior_and_the_step_fit_moves_the_ttft_not_the_instance_cost() -> None:
    import copy

    from tokenpilot import score_kernel as sk

    tp, _, prior = _wrong_fixed_cost_router(31)  # one outcome short of a fit
    assert tp.forward_factors("a") == (1.0, None)
    m, k = tp._s.m, 0
    assert m[sk.FWD_TOKEN_EFF, k] == m[sk.TOKEN_EFF, k] and m[sk.FWD_OVERHEAD, k] == prior.step_overhead_s
    snap = [InstanceSnapshot("a", "s", "m", "v", "http://a")]
    profile = RequestProfile("probe", "m", 300, stream=True)
    want = forward_ttft(0.0, 300.0, 0.0, 0.0, 0.0, prior.max_batched_tokens,
                        prior.prefill_token_s * m[sk.PREFILL_FACTOR, k],
                        prior.attn_s_per_token_ctx * m[sk.PREFILL_FACTOR, k], 0.0, prior.step_overhead_s)
    assert copy.deepcopy(tp).route(profile, snap, 1e6).predicted_ttft_s == want  # the prior's, exactly
    fitted, _, _ = _wrong_fixed_cost_router(200)
    ids = ("a",)
    again = copy.deepcopy(fitted)
    before = fitted._score(profile, snap, fitted._pool_slots(ids), np.zeros(1), 1e6)
    again._s.m[sk.FWD_OVERHEAD_F, 0], again._s.m[sk.FWD_TOKEN_F, 0] = 1.0, np.nan
    again._s.refresh(0)
    after = again._score(profile, snap, again._pool_slots(ids), np.zeros(1), 1e6)
    # The instance cost and the physics' terms it is made of are the same floats with and without
    # the fit (the in-pool ranking is the cost model's, bench/ROUTING.md "i19-unify")...
    for i in range(1, 12):
        if i not in (1, 9):  # (1: the decision's TTFT; 9: the learned TPOT, unfitted here either way)
            assert np.array_equal(before[i], after[i]), i
    assert np.array_equal(before[0], after[0])
    # ... while the one TTFT, the forward one, follows the fit: the engine's true TTFT with it, the
    # prior's step costs' without, and the decision's TTFT (`terms[1]`) is that very float.
    true = forward_ttft(0.0, 300.0, 0.0, 0.0, 0.0, prior.max_batched_tokens, prior.prefill_token_s / 3,
                        prior.attn_s_per_token_ctx / 3, 0.0, prior.step_overhead_s / 4)
    assert before[12][0] == pytest.approx(true, rel=0.03) and before[1][0] == before[12][0]
    assert after[12][0] > 1.5 * true and after[1][0] == after[12][0]
    assert copy.deepcopy(fitted).route(profile, snap, 1e6).predicted_ttft_s == pytest.approx(true, rel=0.03)


def test_the_decision_reports_the_ttft_its_site_was_chosen_by() -> None:
    """One TTFT (i19-unify): what `route` reports (the header, the first-byte deadline) is the float
    `predict` gave the site chooser for that pool and the P/D decision weighs (`price`), with the
    learned residual fitted or not and the step fit in or not. Until i19-unify the report read a
    second forward TTFT over a second token backlog, at the fitted step costs, while the site chooser
    read the learned model over the prior's: the two differed on every fitted instance."""
    import copy

    from tokenpilot.latency_model import N_FEATURES, Fit

    fitted, _, prior = _wrong_fixed_cost_router(200)  # a step fit in on "a"
    fitted.register_instance("b", prior)  # none on "b"
    snaps = [InstanceSnapshot(i, "s", "m", "v", f"http://{i}", num_running=n) for i, n in (("a", 3), ("b", 0))]
    rng = np.random.default_rng(3)
    residual = Fit(np.zeros(N_FEATURES), np.ones(N_FEATURES), 0.05 * rng.normal(size=N_FEATURES), 0.3, 1000)
    seen = set()
    for learned in (None, residual):
        for pool in (snaps, snaps[:1], snaps[1:]):
            for prompt in (40, 300, 3000):
                tp = copy.deepcopy(fitted)
                tp.latency.ttft = learned
                profile = RequestProfile(f"p{prompt}", "m", prompt, stream=True)
                ttft, _ = tp.predict(profile, pool, 1e6)
                priced = copy.deepcopy(tp).price(profile, pool, 1e6)
                d = tp.route(profile, pool, 1e6)
                assert d.predicted_ttft_s == ttft == float(priced.ttft[priced.index(d.instance_id)])
                chosen = [c for c in d.candidates if c.name == d.instance_id][0]
                assert chosen.detail["predicted_ttft_s"] == ttft
                if d.instance_id == "a":  # fitted: the forward TTFT itself, whatever the residual says
                    assert ttft == chosen.detail["forward_ttft_s"]
                else:
                    assert (ttft == chosen.detail["forward_ttft_s"]) == (learned is None)
                seen.add(d.instance_id)
    assert seen == {"a", "b"}  # (both kinds of instance were chosen: the test reads both paths)


def test_step_fit_is_not_dragged_by_outliers() -> None:
    """One outcome in ten 20x its prediction (a prefix the engine had evicted, a burst): in the
    simulator's conversation trace such outcomes, on mostly-cached prompts whose prediction is
    nearly all one step's fixed cost, drove a plain least-squares fit's fixed-cost factor to its
    bound (4x) and the forward TTFT's median error from 8% to 25%. The robust weighting holds it."""

    rng = np.random.default_rng(5)
    robust, plain = StepFit(), StepFit(robust_floor=1e9)  # (a floor that high: plain least squares)
    for _ in range(400):
        a, b, c = rng.uniform(0.01, 0.03), rng.uniform(0.0, 0.3), 0.0
        true = 0.5 * a + 0.8 * b
        observed = true * (20.0 if rng.random() < 0.1 else rng.uniform(0.9, 1.1))
        for fit in (robust, plain):  # each predicted with its fit so far, as the router does
            x, t = _factors(fit, 1.0, 1.0) or (1.0, 1.0)
            fit.update(a, b, c, observed, x * a + t * b + c)
    x, t = _factors(robust, 1.0, 1.0)
    assert x == pytest.approx(0.5, rel=0.15) and t == pytest.approx(0.8, rel=0.1)
    x, t = _factors(plain, 1.0, 1.0)
    assert x > 1.0 or t > 1.2  # what it was


# -- an engine far slower than its prior, and a cost per step (i19-vllm: real vLLM on CPU) -----------

@functools.cache
def _slow_engine_errors(k: float, rate_scale: float) -> tuple[np.ndarray, TokenPilot]:
    """One 8B-on-H100 instance in the simulator (2,048-token chunks), whose router's prior is `k`
    times too fast in every cost (an engine on hardware the roofline does not know: the generic
    prior was ~10x fast for vLLM on CPU), fed the Azure conversation trace at `rate_scale` (requests
    queue). Returns the predicted / observed TTFT (from dispatch) of the second half, and the router,
    whose `cost_ratios` hold the second half's routing cost against what the requests got: its TTFT
    (queue + prefill seconds) / the observed TTFT, its time per output token / the observed one. (One
    run per argument pair, shared by the tests: they only read it.)"""
    from fleetcore.fleet_config import parse_fleet
    from fleetsim.simulator import FleetSimulator, HashCache, fleet_instances, prepare, spec_prior
    from workloads import head, load_trace, scale_rate

    fleet = parse_fleet({
        "sites": [{"name": "s", "region": "r", "jurisdiction": "x"}],
        "models": [{"name": "m", "engine": {"spec": "llama-3.1-8b", "max_model_len": 32768,
                                            "max_num_batched_tokens": 2048}}],
        "deployments": [{"site": "s", "model": "m", "instances": 1, "gpu": "H100", "adapter": "sim"}],
        "tenants": [{"name": "t", "api_keys": ["k"]}]})
    got: dict[str, float] = {}
    ratios: list[float] = []
    costs: list[tuple[float, float]] = []

    class Recorder(TokenPilot):
        def route(self, profile, candidates, now):  # type: ignore[no-untyped-def]
            d = super().route(profile, candidates, now)
            got[profile.request_id] = d.predicted_ttft_s
            return d

        def observe(self, outcome: RequestOutcome) -> None:
            p = got.pop(outcome.request_id, None)
            if p is not None and outcome.ok and outcome.ttft_s:
                ratios.append(p / outcome.ttft_s)  # (nothing held: FCFS admission)
                rec = self._inflight[outcome.request_id]
                costs.append((rec.predicted_ttft_s / outcome.ttft_s,
                              rec.predicted_tpot_s / outcome.mean_tpot_s
                              if outcome.mean_tpot_s and outcome.output_tokens > 1 else float("nan")))
            super().observe(outcome)

    router = Recorder(config=TokenPilotConfig(explore=0.0))
    too_fast = load_bench("speed_bounds").too_fast
    for spec in fleet_instances(fleet):
        router.register_instance(spec.instance_id, too_fast(spec_prior(spec), k))
    wl = scale_rate(head(load_trace(REPO / "traces" / "AzureLLMInferenceTrace_conv.csv"), 1200), rate_scale)
    FleetSimulator(fleet, router).run(prepare(wl.requests, fleet, hash_cache=HashCache()))
    assert len(ratios) == 1200
    router.cost_ratios = np.array(costs[600:])  # type: ignore[attr-defined]
    return np.array(ratios[600:]), router


def test_an_engine_ten_times_slower_than_its_prior_is_learned_while_busy() -> None:
    """Over real vLLM on CPU (the generic prior, ~10x fast on a slow VM) every TTFT was reported at
    ~0.4x, the same at every prompt length: both step factors sat at their bound 4. Here, with the
    engine busy (median TTFT ~1.5 s, most requests queued behind others), main's code reports
    0.34x (66% / 72% median / P90 error); the fit must get the engine's own costs."""
    ratio, router = _slow_engine_errors(10.0, 6.0)
    err = np.abs(ratio - 1.0)
    # (measured: 7% / 22%, median ratio 0.95; main's code 66% / 72%)
    assert np.median(err) < 0.15 and np.percentile(err, 90) < 0.35, (np.median(err), np.percentile(err, 90))
    assert 0.85 < np.median(ratio) < 1.15
    overhead_f, token_f = router.forward_factors(router._s.ids[0])
    # (past i19-vllm's main's bound of 4. The fixed-cost factor was 15.7 while the prefill factor sat
    # at its bound 4; the two step factors are not identified apart on these prompts and the ridge
    # pulls the per-token one toward the prefill factor, which since i19-cap learns the engine (15.9
    # here, x10 the 1.57 of a router with the right prior, whose fit is 0.39 / 1.21): 2.1 / 12.4,
    # the prediction as good, 7.5% / 23%)
    assert token_f is not None and 7.0 < token_f < 14.0 and overhead_f > 1.0


def test_the_routing_cost_learns_an_engine_ten_times_slower_as_ten_times_one_at_its_prior() -> None:
    """The in-pool ranking reads the prior's seconds times the instance's prefill and decode speed
    factors (its queue and prefill, its own-decode and interference terms). Until i19-cap those were
    bounded to 4: on the engine 10x slower than its prior both sat at 4, and the cost's TTFT ran 2.5x
    under what requests got (observed / cost 2.46, where a router with the right prior has 0.51 on
    the same run). With the bound 64 the router learns the 10x engine as the right-prior router
    learns the engine, times 10: 15.9 / 1.57 and 21.4 / 2.14 (10.1x, 10.0x), and its cost then
    stands to what requests got as that router's does."""
    _, slow = _slow_engine_errors(10.0, 6.0)
    _, right = _slow_engine_errors(1.0, 6.0)
    a, b = slow.explain(slow._s.ids[0]), right.explain(right._s.ids[0])
    assert a["prefill_speed_factor"] / b["prefill_speed_factor"] == pytest.approx(10.0, rel=0.15)
    assert a["decode_speed_factor"] / b["decode_speed_factor"] == pytest.approx(10.0, rel=0.15)
    ttft_slow, ttft_right = (np.median(1.0 / r.cost_ratios[:, 0]) for r in (slow, right))  # observed / cost
    assert ttft_slow == pytest.approx(ttft_right, rel=0.15), (ttft_slow, ttft_right)
    tpot_slow, tpot_right = (np.nanmedian(1.0 / r.cost_ratios[:, 1]) for r in (slow, right))
    assert tpot_slow == pytest.approx(tpot_right, rel=0.15), (tpot_slow, tpot_right)


def test_a_cost_per_engine_step_is_learned() -> None:
    """vLLM on CPU spends ~17 ms a step whatever the batch (scheduling, sampling), on top of the
    roofline's max, where the max's fixed cost is amortised over a compute-bound step's tokens: with
    the two factors alone, prompts of 300-1,500 tokens were reported 0.8x at the short end and 1.1x
    at the long one. An engine with the prior's costs x 3 plus 20 ms a step, requests one at a
    time: the short ones must not be under-predicted and the long ones not over."""
    from fleetcore.policies import EnginePrior

    prior = EnginePrior(block_size=32, max_batched_tokens=2048)
    tp = TokenPilot({"a": prior})
    snap = [InstanceSnapshot("a", "s", "m", "v", "http://a")]
    rng = np.random.default_rng(2)
    rows = []
    for i in range(400):
        n = int(rng.integers(300, 1500))
        profile = RequestProfile(f"r{i}", "m", n, stream=True)
        d = tp.route(profile, snap, 10.0 * i)
        true = forward_ttft(0.0, n, 0.0, 0.0, 0.0, 2048.0, 3 * prior.prefill_token_s, 3 * prior.attn_s_per_token_ctx,
                            0.0, 3 * prior.step_overhead_s) + 0.020
        rows.append((n, d.predicted_ttft_s / true))
        tp.on_first_token(profile.request_id, 10.0 * i + true)
        tp.observe(RequestOutcome(profile.request_id, "a", "s", True, prompt_tokens=n, output_tokens=1, ttft_s=true))
    r = np.array(rows[200:])
    short, long = r[r[:, 0] < 600, 1], r[r[:, 0] > 1200, 1]
    # (main's code: 0.90 and 1.06 here; this one 1.00 and 1.00)
    assert np.median(short) == pytest.approx(1.0, abs=0.05) and np.median(long) == pytest.approx(1.0, abs=0.05)
    assert tp._s.m[sk.FWD_STEP_S, 0] == pytest.approx(0.020, rel=0.2)
