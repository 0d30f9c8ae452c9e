"""The compiled scoring (tokenpilot/score_kernel.py) against the numpy code it replaced, bit for bit.

`_reference_score` is `TokenPilot._score` as it was at edb9501 (numpy vectors; with the numpy
`step_s`, `drain_rate`, `forward_ttft` and `reconcile` of then), kept here as the oracle. Both
score the same router state on random pools (backlogs, duty, streams, outstanding prefills, clock
gaps, speed factors, snapshots, cached prefixes, prompts of 0 and 1 tokens), with KV pressure,
with a fitted learned residual and `learned_cost`, and with NaN / inf / zero inputs; every term
and the state each leaves behind must be equal (the same floats, NaN where NaN, the sign of zeros
included). The decision replays (tests/test_score_once.py) check the same on whole decisions.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from fleetcore.types import InstanceSnapshot, RequestProfile
from tokenpilot import score_kernel as sk
from tokenpilot.latency_model import N_FEATURES, Fit
from tokenpilot.priors import prior_from_physics
from tokenpilot.router import TokenPilot, TokenPilotConfig, _Slots


# -- the oracle: edb9501's numpy code --------------------------------------------------------

def _np_reconcile(clock, untracked, outstanding, head, out=None):  # type: ignore[no-untyped-def]
    return np.minimum(np.maximum(clock, outstanding - head), outstanding + untracked, out=out)


def _np_step_s(tokens, context, token_s, kv_s, overhead_s, budget):  # type: ignore[no-untyped-def]
    return np.maximum(overhead_s + context * kv_s, tokens * (token_s + overhead_s / budget))


def _np_drain_rate(decoding, context, budget, token_s, kv_s, overhead_s, step_add_s=0.0):  # type: ignore[no-untyped-def]
    chunk = np.maximum(budget - decoding, 1.0)
    return chunk / (_np_step_s(budget, context, token_s, kv_s, overhead_s, budget) + step_add_s)


def _np_forward_ttft(ahead_tokens, uncached, cached, decoding, context, budget, token_s, attn_s, kv_s,  # type: ignore[no-untyped-def]
                     overhead_s):
    chunk = np.maximum(budget - decoding, 1.0)
    work = ahead_tokens + uncached
    steps = np.maximum(np.ceil(work / chunk), 1.0)
    full = _np_step_s(budget, context, token_s, kv_s, overhead_s, budget)
    last = _np_step_s(work - (steps - 1.0) * chunk + decoding, context, token_s, kv_s, overhead_s, budget)
    now_tokens = np.minimum(ahead_tokens + decoding, budget)
    busy = np.where(now_tokens > 0, _np_step_s(now_tokens, context, token_s, kv_s, overhead_s, budget), 0.0)
    own_attention = attn_s * uncached * (cached + uncached / 2)
    return 0.5 * busy + (steps - 1.0) * full + last + own_attention


def _np_step_count(ahead_tokens, uncached, decoding, budget):  # type: ignore[no-untyped-def]
    chunk = np.maximum(budget - decoding, 1.0)
    steps = np.maximum(np.ceil((ahead_tokens + uncached) / chunk), 1.0)
    return steps + np.where(np.minimum(ahead_tokens + decoding, budget) > 0, 0.5, 0.0)


def _weighted(weight, x):  # type: ignore[no-untyped-def]
    return x if weight == 1.0 else weight * x


def _np_kv_cost(tp, profile, kv_usage, capacity, prefill):  # type: ignore[no-untyped-def]
    cfg = tp.config
    demand = profile.prompt_tokens + tp._mean_output
    if kv_usage.max() + demand / (profile.block_size * capacity.min()) <= cfg.kv_soft_mark:
        return None
    need = demand / (profile.block_size * capacity)
    new_usage = kv_usage + need
    if not new_usage.max() > cfg.kv_soft_mark:
        return None
    return tp._pressure(new_usage, prefill)


def _reference_score(tp, m, profile, pool, k, matched_blocks, now):  # type: ignore[no-untyped-def]
    """edb9501's `TokenPilot._score`, on the state matrix `m` (a copy of the router's)."""
    cfg = tp.config
    s = _Slots
    n = len(pool)
    g = m.take(k, axis=1)
    running = np.fromiter([c.num_running for c in pool], dtype=float, count=n)
    waiting = np.fromiter([c.num_waiting for c in pool], dtype=float, count=n)
    kv_usage = np.fromiter([c.kv_usage for c in pool], dtype=float, count=n)
    prompt = profile.prompt_tokens
    cached = np.minimum(matched_blocks * profile.block_size, max(prompt - 1, 0))
    uncached = prompt - cached
    token_s, kv_s, overhead, budget = g[s.TOKEN_EFF], g[s.KV_EFF], g[s.OVERHEAD_S], g[s.BUDGET]
    ours = g[s.STREAMS]
    streams = np.maximum(ours, running)
    mean_ctx = np.where(ours, g[s.CONTEXT_PER_STREAM], prompt)
    context = streams * mean_ctx
    compute = uncached * token_s + g[s.ATTN_EFF] * uncached * (cached + uncached / 2)
    context_kv = context * kv_s
    step_s = context_kv + overhead
    prefill = compute + uncached / budget * step_s + overhead
    elapsed = np.maximum(0.0, now - g[s.DECAYED_AT])
    drained = g[s.BACKLOG:s.BACKLOG_UNTRACKED + 1]
    np.maximum(0.0, np.subtract(drained, elapsed, out=drained), out=drained)
    untracked = g[s.BACKLOG_UNTRACKED]
    backlog = _np_reconcile(g[s.BACKLOG], untracked, g[s.OUT_S], g[s.HEAD_S], out=g[s.BACKLOG])
    per_token = compute / (uncached if prompt >= 1 else np.maximum(uncached, 1)) + step_s / budget
    waiting_hint = waiting * mean_ctx * 0.5 * per_token
    queue = np.maximum(backlog, waiting_hint)
    ttft = queue + prefill
    window = tp._duty_window()
    duty = g[s.DUTY]
    np.multiply(duty, np.exp(elapsed / -window), out=duty)
    decoding = np.maximum(streams - g[s.OUT_N], 0.0)
    # (since i19-unify: the one token backlog is drained, and the forward TTFT timed, at the step
    # costs `refresh` derives, FWD_*: the fitted ones where a step fit is in, the very floats of
    # TOKEN_EFF / ATTN_EFF / OVERHEAD_S where not, as edb9501 read them)
    f_token, f_attn, f_overhead = g[s.FWD_TOKEN_EFF], g[s.FWD_ATTN_EFF], g[s.FWD_OVERHEAD]
    # (since i19-vllm: every step longer by the step fit's additive cost, 0 until one is in)
    step_add = g[sk.FWD_STEP_S]
    drained_tok = elapsed * _np_drain_rate(decoding, context, budget, f_token, kv_s, f_overhead, step_add)
    untracked_tok = np.maximum(0.0, g[s.UNTRACKED_TOK] - drained_tok)
    backlog_tok = _np_reconcile(np.maximum(0.0, g[s.BACKLOG_TOK] - drained_tok), untracked_tok, g[s.OUT_TOK],
                                g[s.HEAD_TOK] + np.maximum(budget - decoding, 1.0))
    ahead = np.maximum(backlog_tok, waiting * mean_ctx * 0.5)
    forward = _np_forward_ttft(ahead, uncached, cached, decoding, context, budget, f_token, f_attn, kv_s,
                               f_overhead)
    forward = np.where(step_add > 0.0, forward + step_add * _np_step_count(ahead, uncached, decoding, budget), forward)
    np.maximum(g[s.DECAYED_AT], now, out=g[s.DECAYED_AT])
    m[s.BACKLOG:s.DECAYED_AT + 1, k] = g[s.BACKLOG:s.DECAYED_AT + 1]
    m[s.BACKLOG_TOK, k] = backlog_tok
    m[s.UNTRACKED_TOK, k] = untracked_tok
    duty_after = np.minimum(cfg.max_duty, duty + compute / window)
    decode_step = g[s.OVERHEAD_DF] + context_kv
    tpot_now = g[s.TPOT_FACTOR] * decode_step / (1 - np.minimum(duty, cfg.max_duty))
    remaining = tp._remaining_tokens()
    slack = (cfg.tpot_slo_s - tpot_now) * remaining
    interference = _weighted(cfg.interference_weight, streams) * np.maximum(0.0, compute - np.maximum(slack, 0.0))
    kv_cost = _np_kv_cost(tp, profile, kv_usage, g[s.CAPACITY_BLOCKS], prefill)
    locality = _weighted(cfg.locality_weight, cached) * token_s
    own_step = g[s.TPOT_FACTOR] * (decode_step + prompt * kv_s) / (1 - duty_after)
    positive = np.maximum(forward, 1e-9)
    features = np.array((queue, prefill, uncached / 1e3, streams, context / 1e6, kv_usage, waiting,
                         budget / 1e3, forward, ahead / 1e3, decoding, np.log(positive), 0.01 / positive))
    lat = tp.latency
    prior_ttft, prior_tpot = ttft, own_step
    ttft_pred = lat.correct(lat.ttft, forward, features)
    if lat.ttft is not None:  # (since i19-unify: the step-fitted forward TTFT where a fit is in)
        ttft_pred = np.where(~np.isnan(g[s.FWD_TOKEN_F]), forward, ttft_pred)
    tpot_pred = lat.correct(lat.tpot, own_step, features)
    if cfg.learned_cost:
        ttft, own_step = ttft_pred, tpot_pred
    out = 2 * remaining
    decode = out * (cfg.decode_weight * own_step
                    + _weighted(cfg.decode_slo_weight, np.maximum(0.0, own_step - cfg.tpot_slo_s)))
    cost = ttft + interference
    if kv_cost is not None:
        cost = cost + kv_cost
    else:
        kv_cost = np.zeros(n)
    cost = cost + decode - locality
    return (cost, ttft_pred, queue, prefill, interference, kv_cost, cached, decode, compute, tpot_pred,
            prior_ttft, prior_tpot, forward, ahead, features)


# -- the comparison ------------------------------------------------------------------------

def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal floats, NaN where NaN, and the same sign of zero."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        return False
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b)) and np.array_equal(a[~nan], b[~nan])
                and np.array_equal(np.signbit(a[~nan]), np.signbit(b[~nan])))


def _router(rng: random.Random, n: int, config: TokenPilotConfig) -> tuple[TokenPilot, list[InstanceSnapshot]]:
    priors = [prior_from_physics("llama-3.1-8b", "H100"), prior_from_physics("llama-3.1-70b", "H200", 2),
              prior_from_physics("llama-3.1-8b", "H100", max_batched_tokens=512),
              prior_from_physics("llama-3.1-8b", "H100", max_batched_tokens=1000)]  # (not a power of 2)
    tp = TokenPilot({f"i{j}": rng.choice(priors) for j in range(n)}, config=config)
    s, m = tp._s, tp._s.m
    for j in range(n):  # a state such as traffic leaves: some idle, some loaded, some learned
        busy = rng.random() < 0.7
        m[s.PREFILL_FACTOR, j], m[s.DECODE_FACTOR, j] = rng.uniform(0.5, 2.0), rng.uniform(0.5, 2.0)
        m[s.TPOT_FACTOR, j] = rng.uniform(0.5, 2.0)
        m[s.BACKLOG, j] = rng.uniform(0, 3) if busy else 0.0
        m[s.BACKLOG_UNTRACKED, j] = rng.uniform(0, 1) if busy else 0.0
        m[s.DUTY, j] = rng.uniform(0, 0.95)
        m[s.DECAYED_AT, j] = rng.uniform(90, 100)
        m[s.STREAMS, j] = rng.randrange(0, 50) if busy else 0
        m[s.CONTEXT, j] = m[s.STREAMS, j] * rng.uniform(100, 8000)
        m[s.OUT_S, j] = rng.uniform(0, 2) if busy else 0.0
        m[s.HEAD_S, j] = m[s.OUT_S, j] * rng.random()
        m[s.BACKLOG_TOK, j], m[s.UNTRACKED_TOK, j] = rng.uniform(0, 3e4), rng.uniform(0, 5e3)
        m[s.OUT_TOK, j] = rng.uniform(0, 2e4) if busy else 0.0
        m[s.HEAD_TOK, j] = m[s.OUT_TOK, j] * rng.random()
        m[s.OUT_N, j] = rng.randrange(0, 10)
        s.refresh(j)
    tp._mean_compute, tp._mean_output = rng.uniform(0.01, 2.0), rng.uniform(20, 900)
    pool = [InstanceSnapshot(f"i{j}", "s", "m", "v", f"http://i{j}", num_running=rng.randrange(0, 60),
                             num_waiting=rng.choice((0, 0, rng.randrange(0, 30))), kv_usage=rng.uniform(0, 0.8))
            for j in range(n)]
    return tp, pool


def _compare(tp: TokenPilot, pool: list[InstanceSnapshot], profile: RequestProfile, matched: np.ndarray,
             now: float) -> None:
    ids = tuple(c.instance_id for c in pool)
    k = tp._pool_slots(ids)
    m_ref = tp._s.m.copy()
    with np.errstate(all="ignore"):  # (the edge cases divide by zero, as numpy may)
        want = _reference_score(tp, m_ref, profile, pool, k, matched.copy(), now)
    got = tp._score(profile, pool, k, matched.copy(), now)
    assert len(got) >= len(want)
    for i, (w, g) in enumerate(zip(want, got)):
        assert _same(w, g), (i, w, g)
    assert got[14].flags.c_contiguous  # (the learned model's matrix product sees the layout it saw)
    assert _same(m_ref, tp._s.m)


def _fit(rng: np.random.Generator) -> Fit:
    return Fit(rng.normal(size=N_FEATURES), rng.uniform(0.5, 2, size=N_FEATURES), 0.05 * rng.normal(size=N_FEATURES),
               0.1, 1000)


@pytest.mark.parametrize("learned", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_compiled_scoring_equals_the_numpy_code_it_replaced(seed: int, learned: bool) -> None:
    rng = random.Random(seed)
    cfg = TokenPilotConfig(learned_cost=learned, interference_weight=rng.choice((1.0, 0.7)),
                           locality_weight=rng.choice((1.0, 1.5)), decode_slo_weight=rng.choice((1.0, 2.0)))
    tp, pool = _router(rng, rng.choice((1, 7, 64)), cfg)
    slots = tp._s
    for j in range(len(slots.ids)):  # the forward TTFT's step fit in on some instances (i19-pred)
        if rng.random() < 0.5:
            slots.m[slots.FWD_OVERHEAD_F, j], slots.m[slots.FWD_TOKEN_F, j] = rng.uniform(1 / 16, 4), rng.uniform(1 / 16, 4)
            slots.m[sk.FWD_STEP_S, j] = rng.choice((0.0, rng.uniform(0, 0.03)))  # (i19-vllm's per-step cost)
            slots.refresh(j)
    if learned:
        nrng = np.random.default_rng(seed)
        tp.latency.ttft, tp.latency.tpot = _fit(nrng), _fit(nrng)
    now = 100.0
    for r in range(40):
        prompt = rng.choice((0, 1, 2, 17, rng.randrange(1, 40_000)))
        profile = RequestProfile(f"r{r}", "m", prompt, stream=rng.random() < 0.5)
        blocks = -(-prompt // 16)
        matched = np.array([float(rng.choice((0, 0, blocks, rng.randrange(0, blocks + 2)))) for _ in pool])
        if r % 5 == 4:  # some under KV pressure, beyond full too
            pool = [InstanceSnapshot(c.instance_id, "s", "m", "v", c.url, num_running=c.num_running,
                                     num_waiting=c.num_waiting, kv_usage=rng.uniform(0.8, 1.1)) for c in pool]
        _compare(tp, rng.sample(pool, len(pool)), profile, matched, now)  # (a shuffled pool too)
        now += rng.choice((0.0, 0.001, rng.uniform(0, 5)))


def test_compiled_scoring_follows_numpy_on_nan_inf_and_zero_inputs() -> None:
    rng = random.Random(7)
    tp, pool = _router(rng, 8, TokenPilotConfig())
    s, m = tp._s, tp._s.m
    m[s.BUDGET, 0] = 0.0  # divisions by zero: inf / NaN as numpy's, no exception
    m[s.DUTY, 1] = np.nan
    m[s.BACKLOG, 2] = np.inf
    m[s.STREAMS, 3], m[s.CONTEXT, 3] = 0.0, 0.0
    m[s.DECAYED_AT, 4] = 1e9  # a clock behind the state: nothing drains
    s.refresh(0), s.refresh(3)
    pool[5] = InstanceSnapshot("i5", "s", "m", "v", "http://i5", kv_usage=float("nan"))
    pool[6] = InstanceSnapshot("i6", "s", "m", "v", "http://i6", num_running=0, num_waiting=0, kv_usage=0.0)
    for prompt in (0, 1, 500):
        _compare(tp, pool, RequestProfile(f"p{prompt}", "m", prompt), np.zeros(len(pool)), 120.0)
    # a pool naming one instance twice scores both from the same state
    _compare(tp, [pool[1], pool[2], pool[1]], RequestProfile("dup", "m", 300), np.zeros(3), 130.0)
