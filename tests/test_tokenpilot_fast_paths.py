"""TokenPilot's per-request bookkeeping made cheaper (branch i14-place), against the code it replaced.

Each oracle below is the function as it was at 6e5af05, kept verbatim: `_settle` (Python on numpy
scalars; now `score_kernel.settle`, compiled), `LearnedLatency._log_ratio` (np.clip of one float;
now Python's min/max) and `LearnedLatency.correct` / `Fit.residual` (np.clip, the bound's log and
the column views per call; now the clip ufunc, the log once, the views once). Both sides run on
the same random states, NaN, inf, zeros and negative values included; results must be the same
floats (NaN where NaN, the sign of zeros too). The decision replays (tests/test_score_once.py)
check whole decisions.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from tokenpilot.backlog import reconcile
from tokenpilot.forward import drain_rate
from tokenpilot import score_kernel as sk
from tokenpilot.latency_model import N_FEATURES, Fit, LearnedLatency
from tokenpilot.router import TokenPilot, TokenPilotConfig
from tests.test_tokenpilot_score_kernel import _np_drain_rate, _router, _same


# -- _settle ----------------------------------------------------------------------------------

def _fmax(a: float, b: float) -> float:
    return a if (a >= b or a != a) else b


def _reference_settle(tp: TokenPilot, m: np.ndarray, k: int, now: float) -> None:
    """`TokenPilot._settle` at 6e5af05, on the matrix `m`."""
    s = tp._s
    elapsed = max(0.0, now - m[s.DECAYED_AT, k])
    # (since i19-unify settle runs the scoring's drains, `score_kernel.drain_s` / `drain_tok`, with
    # `tokenpilot.jit.fmax`'s rule (NaN propagates; of equal values, zeros of either sign, the first)
    # where Python's max let 0.0 win over NaN, and the token backlog at the step costs `refresh`
    # derives, FWD_*, fitted where a step fit is in; a second token backlog for the reported TTFT is gone)
    m[s.BACKLOG_UNTRACKED, k] = _fmax(0.0, m[s.BACKLOG_UNTRACKED, k] - elapsed)
    m[s.BACKLOG, k] = _fmax(0.0, m[s.BACKLOG, k] - elapsed)
    m[s.DUTY, k] *= np.exp(elapsed / -tp._duty_window())
    m[s.DECAYED_AT, k] = max(m[s.DECAYED_AT, k], now)
    m[s.BACKLOG, k] = reconcile(m[s.BACKLOG, k], m[s.BACKLOG_UNTRACKED, k], m[s.OUT_S, k], m[s.HEAD_S, k])
    decoding = max(m[s.STREAMS, k] - m[s.OUT_N, k], 0.0)
    # (since i19-vllm: each step longer by the step fit's additive cost, FWD_STEP_S, 0 until one is in)
    drained = elapsed * float(drain_rate(decoding, m[s.CONTEXT, k], m[s.BUDGET, k], m[s.FWD_TOKEN_EFF, k],
                                         m[s.KV_EFF, k], m[s.FWD_OVERHEAD, k], m[sk.FWD_STEP_S, k]))
    m[s.UNTRACKED_TOK, k] = _fmax(0.0, m[s.UNTRACKED_TOK, k] - drained)
    m[s.BACKLOG_TOK, k] = reconcile(_fmax(0.0, m[s.BACKLOG_TOK, k] - drained), m[s.UNTRACKED_TOK, k],
                                    m[s.OUT_TOK, k], m[s.HEAD_TOK, k] + max(m[s.BUDGET, k] - decoding, 1.0))


_ODD = (0.0, -0.0, -1.0, float("nan"), float("inf"), float("-inf"), 1e-300, 1e300)


def _random_router(rng: random.Random, n: int, odd: float) -> TokenPilot:
    """A state such as traffic leaves (the scoring test's), with an odd value here and there."""
    tp, _ = _router(rng, n, TokenPilotConfig())
    s, m = tp._s, tp._s.m
    rows = (s.BACKLOG, s.BACKLOG_UNTRACKED, s.DUTY, s.DECAYED_AT, s.CONTEXT, s.STREAMS, s.OUT_S, s.HEAD_S,
            s.BACKLOG_TOK, s.UNTRACKED_TOK, s.OUT_TOK, s.HEAD_TOK, s.OUT_N, s.PREFILL_FACTOR, s.DECODE_FACTOR)
    for i, row in enumerate(rows):  # every row odd somewhere, and a few more at random
        m[row, (i + rng.randrange(n)) % n] = odd
    for j in range(n):
        if rng.random() < 0.3:
            m[rng.choice(rows), j] = odd
        if rng.random() < 0.5:  # a step fit in (i19-pred), with a cost per step (i19-vllm)
            m[s.FWD_OVERHEAD_F, j], m[s.FWD_TOKEN_F, j] = rng.uniform(1 / 16, 8), rng.uniform(1 / 16, 8)
            m[sk.FWD_STEP_S, j] = rng.choice((0.0, rng.uniform(0, 0.03)))
        s.refresh(j)
    return tp


@pytest.mark.parametrize("seed", range(16))
def test_compiled_settle_equals_the_python_it_replaced(seed: int) -> None:
    rng = random.Random(seed)
    tp = _random_router(rng, 16, _ODD[seed % len(_ODD)])
    with np.errstate(all="ignore"):
        for _ in range(200):
            k = rng.randrange(16)
            now = rng.choice((100.0, rng.uniform(80, 130), float(tp._s.m[tp._s.DECAYED_AT, k]),
                              rng.choice(_ODD)))
            want = tp._s.m.copy()
            _reference_settle(tp, want, k, now)
            tp._settle(k, now)
            assert _same(want, tp._s.m), (k, now)


# -- the learned latency model ----------------------------------------------------------------

def _reference_log_ratio(lat: LearnedLatency, observed: float | None, prior: float) -> float:
    if observed is None or not observed > 0 or not prior > 0:
        return float("nan")
    bound = np.log(lat.max_ratio)
    return float(np.clip(np.log(observed / prior), -bound, bound))


def _reference_correct(lat: LearnedLatency, fit: Fit | None, prior: np.ndarray, x: np.ndarray) -> np.ndarray:
    if fit is None:
        return prior
    bound = np.log(lat.max_ratio)
    residual = ((x - fit.mean[:, None]) / fit.scale[:, None]).T @ fit.coef + fit.intercept
    return prior * np.exp(np.clip(residual, -bound, bound))


def test_log_ratio_equals_np_clip_of_it() -> None:
    rng = random.Random(3)
    values = [None, *_ODD, 1e-9, 5e-4, 0.002, 1.0, 30.0]
    with np.errstate(all="ignore"):
        for ratio in (4.0, 1.5, 100.0):
            lat = LearnedLatency(max_ratio=ratio)
            for _ in range(3000):
                obs = rng.choice(values) if rng.random() < 0.3 else rng.uniform(0, 2) * rng.choice((1e-3, 1, 1e3))
                prior = rng.choice(values[1:]) if rng.random() < 0.3 else rng.uniform(0, 2) * rng.choice((1e-3, 1))
                got, want = lat._log_ratio(obs, prior), _reference_log_ratio(lat, obs, prior)
                assert type(got) is float and _same(got, want), (obs, prior, got, want)
        lat.max_ratio = 2.0  # changed after construction: the bound follows
        assert lat._log_ratio(1000.0, 1.0) == float(np.log(2.0))


@pytest.mark.parametrize("n", [1, 2, 7, 64])
def test_correct_equals_the_numpy_code_it_replaced(n: int) -> None:
    nrng = np.random.default_rng(n)
    lat = LearnedLatency()
    for trial in range(60):
        fit = Fit(nrng.normal(size=N_FEATURES), nrng.uniform(0.5, 2, size=N_FEATURES),
                  nrng.normal(size=N_FEATURES) * (0.05 if trial % 3 else 5.0), float(nrng.normal()), 1000)
        x = np.ascontiguousarray(nrng.normal(size=(N_FEATURES, n)) * nrng.choice((0.1, 10.0)))
        prior = nrng.uniform(0, 1, size=n)
        if trial % 4 == 3:
            x[nrng.integers(N_FEATURES), nrng.integers(n)] = nrng.choice(np.array(_ODD))
            prior[nrng.integers(n)] = nrng.choice(np.array(_ODD))
        if trial == 10:
            lat.max_ratio = 1.25
        with np.errstate(all="ignore"):
            assert _same(lat.correct(fit, prior, x), _reference_correct(lat, fit, prior, x))
    assert lat.correct(None, prior, x) is prior


# -- the score terms, made when read --------------------------------------------------------

def test_terms_read_one_by_one_are_the_tuple_of_terms() -> None:
    from tokenpilot.router import _terms_of
    from fleetcore.types import InstanceSnapshot, RequestProfile

    rng = random.Random(5)
    tp = _random_router(rng, 7, 1.0)
    pool = [InstanceSnapshot(f"i{j}", "s", "m", "v", f"http://i{j}", num_running=j, kv_usage=0.1 * j) for j in range(7)]
    nrng = np.random.default_rng(5)
    tp.latency.ttft = Fit(nrng.normal(size=N_FEATURES), nrng.uniform(0.5, 2, size=N_FEATURES),
                          0.05 * nrng.normal(size=N_FEATURES), 0.1, 1000)
    with np.errstate(all="ignore"):
        ids, k, terms = tp._terms(RequestProfile("r", "m", 700, stream=True), pool, 120.0)
    o = terms[-1]
    want = _terms_of(o, terms[1], terms[9])
    assert len(terms) == len(want) == 16
    for i in range(-16, 16):
        assert terms[i] is want[i] or (terms[i].base is o and _same(terms[i], want[i])
                                       and terms[i].shape == want[i].shape), i
    assert all(a is b or _same(a, b) for a, b in zip(terms, want))
    assert all(_same(a, b) for a, b in zip(terms[2:9], want[2:9])) and len(terms[:3]) == 3
    with pytest.raises(IndexError):
        terms[16]
    with pytest.raises(IndexError):
        terms[-17]


@pytest.mark.parametrize("seed", range(4))
def test_learned_tpot_made_when_read_is_the_one_of_the_decision(seed: int) -> None:
    """With a fitted TPOT residual and the physics' ranking, the learned TPOT (an explanation's
    `tpot_s`) is corrected only when read: the same floats as correcting at once, even after a
    refit or a new bound in between."""
    from fleetcore.types import InstanceSnapshot, RequestProfile

    rng = random.Random(seed)
    tp = _random_router(rng, rng.choice((1, 5, 64)), 1.0)
    n = len(tp._s.ids)
    pool = [InstanceSnapshot(f"i{j}", "s", "m", "v", f"http://i{j}", num_running=rng.randrange(30),
                             kv_usage=rng.uniform(0, 0.95)) for j in range(n)]
    nrng = np.random.default_rng(seed)

    def fit() -> Fit:
        return Fit(nrng.normal(size=N_FEATURES), nrng.uniform(0.5, 2, size=N_FEATURES),
                   nrng.normal(size=N_FEATURES) * nrng.choice((0.05, 5.0)), float(nrng.normal()), 1000)

    lat = tp.latency
    lat.ttft, lat.tpot = fit(), fit()
    with np.errstate(all="ignore"):
        for r in range(20):
            profile = RequestProfile(f"r{r}", "m", rng.randrange(1, 9000), stream=True)
            ids, k, terms = tp._terms(profile, pool, 200.0 + r)
            o = terms[-1]
            want = lat.correct(lat.tpot, o[sk.O_OWN_STEP], o[sk.O_FEATURES:])  # at once, as before
            if r % 3 == 0:  # a refit and a new bound before anyone reads it
                lat.tpot, lat.max_ratio = fit(), rng.choice((1.5, 4.0, 9.0))
            got = terms[9] if r % 2 else list(terms)[9]
            assert _same(got, want) and terms[9] is got
            decision = tp.route(profile, pool, 200.0 + r)
            if decision.candidates:  # the explanation reads the same (from the route's own scoring)
                for c in decision.candidates:  # (`route` reused this scoring: the memo)
                    assert c.detail["tpot_s"] == float(want[ids.index(c.name)])
            lat.max_ratio = 4.0
