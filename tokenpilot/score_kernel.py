"""TokenPilot's per-candidate scoring arithmetic, compiled (numba): one loop over the candidates.

Why compiled. Written with numpy, a decision was ~100 vector operations on 64-element
vectors, each paying 0.3-1 us of fixed cost (dispatch, a temporary) whatever the length:
~90 us of a ~140 us decision (bench/README.md, "Decision cost"). The same expressions as
scalar code in one compiled loop cost a few microseconds.

Why the results are bit-for-bit numpy's: every expression keeps the operation order it had
as numpy code (`TokenPilot._score`'s history), and `tokenpilot.jit` says why compiled scalar
code then rounds as numpy did. `exp` and `log` are the exception: numpy's vectorised ones
(AVX-512 here) may round the last bit differently from the C library's, so they stay numpy
calls between the compiled steps (`prep` -> `np.exp` -> `score` -> `np.log`, and `finish` again where KV pressure or the learned
ranking changes the cost).
The decision replay (`tests/test_score_once.py`, `bench/decision_replay.py`) checks it.

Layout. The router's per-instance state is one matrix `m` (row = field, column = slot, see
the row numbers below: `tokenpilot.router._Slots` takes them from here); a decision's
results are the rows of one matrix `o` (the `O_*` rows), whose last `N_FEATURES` rows are
the learned latency model's features, C-contiguous like the `np.array` of rows they were.
"""

from __future__ import annotations

import numpy as np
from numba import float64, intp, njit, void
from numba.types import UniTuple

from tokenpilot.backlog import reconcile
from tokenpilot.forward import drain_rate, forward_ttft, step_count
from tokenpilot.jit import INLINE, JIT
from tokenpilot.jit import fmax as _max
from tokenpilot.jit import fmin as _min

# -- rows of the router's state matrix (`_Slots.m`) ------------------------------------------
# State. Backlog, untracked backlog and duty decay on the same clock, so one "decayed at"
# serves them all. OUT_S / HEAD_S: predicted prefill of the streamed requests sent there whose
# first token has not been seen (all of them / the oldest one).
(TOKEN_S, ATTN_S, KV_S, OVERHEAD_S, CAPACITY_BLOCKS, BUDGET, PREFILL_FACTOR, DECODE_FACTOR,
 BACKLOG, BACKLOG_UNTRACKED, DUTY, DECAYED_AT, CONTEXT, STREAMS, OUT_S, HEAD_S, TPOT_FACTOR) = range(17)
# Derived by `_Slots.refresh` (they change only when an instance's speeds or streams do).
TOKEN_EFF, ATTN_EFF, KV_EFF, OVERHEAD_DF, CONTEXT_PER_STREAM = range(17, 22)
# The same backlog in uncached prompt tokens, for the scheduler-forward TTFT (`tokenpilot.forward`):
# clock-drained (at the engine's prefill rate), untracked part, outstanding total / oldest / count.
BACKLOG_TOK, UNTRACKED_TOK, OUT_TOK, HEAD_TOK, OUT_N = range(22, 27)
# The instance's engine step costs as the scheduler-forward TTFT and the token backlog's drain read
# them (`tokenpilot.learning.StepFit`): its per-token factor on TOKEN_S / ATTN_S (NaN: none fitted,
# the prefill factor's) and its fixed-cost factor on OVERHEAD_S (1: none fitted), and the costs they
# give (derived by `refresh`; the very floats of TOKEN_EFF / ATTN_EFF / OVERHEAD_S until a fit is in).
# One token backlog, one forward TTFT: what the decision reports is what the site chooser and the
# P/D decision rank by (until i19-unify a second backlog and forward TTFT, at the fitted costs,
# were kept for the report alone, and the two numbers differed).
FWD_TOKEN_F, FWD_OVERHEAD_F, FWD_TOKEN_EFF, FWD_ATTN_EFF, FWD_OVERHEAD = range(27, 32)
# ... and its additive cost per engine step (s; 0: none fitted), on top of the roofline's max
# (`StepFit.fit`: what an engine spends per step whatever the batch, vLLM on CPU ~20 ms; i19-vllm).
FWD_STEP_S = 32
STATE_ROWS = 33

# -- rows of a decision's results (`o`) ---------------------------------------------------------
(O_COST, O_TTFT, O_QUEUE, O_PREFILL, O_INTERFERENCE, O_KV, O_CACHED, O_DECODE, O_COMPUTE, O_OWN_STEP,
 O_FORWARD, O_AHEAD, O_LOCALITY, O_CAPACITY, O_ELAPSED, O_DECAY) = range(16)
# Scratch: the drained state, held until every candidate is read, then stored into `m`.
_S_BACKLOG, _S_UNTRACKED, _S_DUTY, _S_BACKLOG_TOK, _S_UNTRACKED_TOK = range(16, 21)
O_FITTED = 21  # 1 where the candidate's step costs are fitted (O_FORWARD is then the decision's TTFT), else 0
O_FEATURES = 22  # queue, prefill, uncached/1e3, streams, context/1e6, kv_usage, waiting, budget/1e3,
N_FEATURES = 13  # forward, ahead/1e3, decoding, log(max(forward, 1e-9)), 0.01/max(forward, 1e-9)
F_KV_USAGE, F_LOG = O_FEATURES + 5, O_FEATURES + 11
OUT_ROWS = O_FEATURES + N_FEATURES

# -- a decision's scalars (`p`) -----------------------------------------------------------------
(P_PROMPT, P_BLOCK_SIZE, P_NOW, P_WINDOW, P_REMAINING, P_TPOT_SLO, P_MAX_DUTY, P_INTERFERENCE_W,
 P_LOCALITY_W, P_DECODE_W, P_DECODE_SLO_W, P_KV_MAX, P_CAPACITY_MIN) = range(13)
PARAMS = 13  # (P_KV_MAX, P_CAPACITY_MIN: written by `score`, for `TokenPilot._kv_cost`)

@njit(UniTuple(float64, 2)(float64[:, ::1], intp, float64), **INLINE)
def drain_s(m: np.ndarray, s: int, elapsed: float) -> tuple[float, float]:
    """Slot `s`'s prefill backlog in seconds `elapsed` later: (backlog, its untracked part), drained
    by the clock and held within what the first tokens seen so far allow (`tokenpilot.backlog`).
    The one drain of it: a decision (`score`) and a first token or an end (`settle`) both call it."""
    untracked = _max(0.0, m[BACKLOG_UNTRACKED, s] - elapsed)
    return reconcile(_max(0.0, m[BACKLOG, s] - elapsed), untracked, m[OUT_S, s], m[HEAD_S, s]), untracked


@njit(UniTuple(float64, 2)(float64[:, ::1], intp, float64, float64, float64), **INLINE)
def drain_tok(m: np.ndarray, s: int, elapsed: float, decoding: float, context: float) -> tuple[float, float]:
    """Slot `s`'s prefill backlog in uncached prompt tokens `elapsed` later: (backlog, untracked part),
    drained at the engine's prefill rate with `decoding` streams reading `context` tokens of KV, at the
    instance's step costs (the fitted ones where a `StepFit` is in, `FWD_*`), held within what the
    first tokens allow with one chunk of slack (a step carries more than the oldest prompt: up to a
    chunk of the next ones may be done too). The one token backlog, and its one drain (`score`, `settle`)."""
    budget = m[BUDGET, s]
    drained = elapsed * drain_rate(decoding, context, budget, m[FWD_TOKEN_EFF, s], m[KV_EFF, s], m[FWD_OVERHEAD, s],
                                   m[FWD_STEP_S, s])
    untracked = _max(0.0, m[UNTRACKED_TOK, s] - drained)
    return reconcile(_max(0.0, m[BACKLOG_TOK, s] - drained), untracked, m[OUT_TOK, s],
                     m[HEAD_TOK, s] + _max(budget - decoding, 1.0)), untracked


@njit(void(float64[:, ::1], intp[::1], float64[::1], float64[:, ::1]), **JIT)
def prep(m: np.ndarray, k: np.ndarray, p: np.ndarray, o: np.ndarray) -> None:
    """Time since each candidate's state was last drained, and the duty decay's exponent
    (`elapsed / -window`; numpy takes its exp)."""
    now, neg_window = p[P_NOW], -p[P_WINDOW]
    for j in range(k.shape[0]):
        elapsed = _max(0.0, now - m[DECAYED_AT, k[j]])
        o[O_ELAPSED, j] = elapsed
        o[O_DECAY, j] = elapsed / neg_window


@njit(void(float64[:, ::1], float64[::1], float64[::1], float64[::1], float64, float64[::1]), **JIT)
def finish(o: np.ndarray, ttft: np.ndarray, own_step: np.ndarray, kv_cost: np.ndarray, with_kv: float,
           p: np.ndarray) -> None:
    """The own-decode term and the cost, from the TTFT and time per token the cost ranks by
    (the physics', or the learned model's with `learned_cost`) and the KV pressure (`with_kv`
    0: none anywhere, and adding its zeros is left out, as it always was)."""
    out = 2 * p[P_REMAINING]
    slo, dw, dsw = p[P_TPOT_SLO], p[P_DECODE_W], p[P_DECODE_SLO_W]
    for j in range(o.shape[1]):
        own = own_step[j]
        over = _max(0.0, own - slo)
        decode = out * (dw * own + (over if dsw == 1.0 else dsw * over))
        cost = ttft[j] + o[O_INTERFERENCE, j]
        if with_kv != 0.0:
            cost = cost + kv_cost[j]
        o[O_DECODE, j] = decode
        o[O_COST, j] = cost + decode - o[O_LOCALITY, j]


@njit(void(float64[:, ::1], intp[::1], float64[::1], float64[::1], float64[::1], float64[::1], float64[::1],
           float64[:, ::1]), **JIT)
def score(m: np.ndarray, k: np.ndarray, running: np.ndarray, waiting: np.ndarray, kv_usage: np.ndarray,
          matched: np.ndarray, p: np.ndarray, o: np.ndarray) -> None:
    """Every term of `TokenPilot._score` per candidate, the cost and own decode as `finish` makes
    them without KV pressure (from the physics' TTFT and time per token), and the clock-drained
    state stored back into `m` after all candidates are read (a pool listing one instance twice
    scores both from the same state, as the numpy code's gathered copy did).

    running, waiting, kv_usage: the snapshots'; matched: prefix blocks cached there."""
    prompt, block_size, now, window = p[P_PROMPT], p[P_BLOCK_SIZE], p[P_NOW], p[P_WINDOW]
    remaining, slo, max_duty = p[P_REMAINING], p[P_TPOT_SLO], p[P_MAX_DUTY]
    iw, lw = p[P_INTERFERENCE_W], p[P_LOCALITY_W]
    cap_prompt = _max(prompt - 1.0, 0.0)  # (max(prompt - 1, 0) on ints: exact as floats)
    n = k.shape[0]
    kv_max, cap_min = -np.inf, np.inf
    for j in range(n):
        s = k[j]
        cached = _min(matched[j] * block_size, cap_prompt)
        uncached = prompt - cached
        token_s, kv_s, overhead, budget = m[TOKEN_EFF, s], m[KV_EFF, s], m[OVERHEAD_S, s], m[BUDGET, s]
        attn = m[ATTN_EFF, s]
        # Context decoding alongside the prefill: what we routed there, or what the engine
        # reports running when others share it (assume our mean context per stream).
        ours = m[STREAMS, s]
        streams = _max(ours, running[j])
        mean_ctx = m[CONTEXT_PER_STREAM, s] if ours != 0.0 else prompt  # (np.where: NaN counts as nonzero)
        context = streams * mean_ctx
        # Prefill = linear layers per token + attention over the context so far (quadratic in
        # long prompts) + every step's decode KV reads and fixed cost while it runs.
        own_attention = attn * uncached * (cached + uncached / 2)
        compute = uncached * token_s + own_attention
        context_kv = context * kv_s
        step_s = context_kv + overhead
        prefill = compute + uncached / budget * step_s + overhead
        # Prefill work routed here and not yet done (seconds): drained by the clock, held
        # within what the first tokens seen so far allow (`tokenpilot.backlog`).
        elapsed = o[O_ELAPSED, j]
        backlog, untracked = drain_s(m, s, elapsed)
        # (uncached >= 1 whenever the prompt has a token: cached stops one short of it)
        per_token = compute / (uncached if prompt >= 1.0 else _max(uncached, 1.0)) + step_s / budget
        waiting_ctx = waiting[j] * mean_ctx * 0.5
        waiting_hint = waiting_ctx * per_token  # engine queue we did not route ourselves
        queue = _max(backlog, waiting_hint)
        ttft = queue + prefill
        # Prefill duty: the share of the instance's time that prefills routed there have been
        # taking lately (EWMA). Every prefill step stalls all decoding streams, so a stream's
        # time per token is its decode step stretched by 1 / (1 - duty).
        duty = m[DUTY, s] * o[O_DECAY, j]  # (o[O_DECAY] holds exp(elapsed / -window) by now)
        # The scheduler-forward TTFT (`tokenpilot.forward`): the same backlog kept in tokens,
        # drained at the engine's prefill rate, and timed by how the engine batches it, at the
        # instance's step costs (fitted where a `StepFit` is in). It is the decision's TTFT: what it
        # reports, what the site chooser and the P/D decision rank by, and (where no step fit is
        # in) what the learned residual corrects; the cost ranks by the physics above unless `learned_cost`.
        decoding = _max(streams - m[OUT_N, s], 0.0)
        backlog_tok, untracked_tok = drain_tok(m, s, elapsed, decoding, context)
        ahead = _max(backlog_tok, waiting_ctx)
        forward = forward_ttft(ahead, uncached, cached, decoding, context, budget, m[FWD_TOKEN_EFF, s],
                               m[FWD_ATTN_EFF, s], kv_s, m[FWD_OVERHEAD, s])
        step_add = m[FWD_STEP_S, s]
        if step_add > 0.0:  # (0 until a step fit is in: the prior's very float)
            forward += step_add * step_count(ahead, uncached, decoding, budget)
        o[O_FITTED, j] = 0.0 if m[FWD_TOKEN_F, s] != m[FWD_TOKEN_F, s] else 1.0
        duty_after = _min(max_duty, duty + compute / window)
        decode_step = m[OVERHEAD_DF, s] + context_kv
        tpot_factor = m[TPOT_FACTOR, s]
        tpot_now = tpot_factor * decode_step / (1 - _min(duty, max_duty))
        # Each running stream absorbs this prefill's compute as gaps between its tokens over
        # its remaining output; only what pushes it past its TPOT budget costs goodput.
        slack = (slo - tpot_now) * remaining
        interference = (streams if iw == 1.0 else iw * streams) * _max(0.0, compute - _max(slack, 0.0))
        # Locality: reusing a prefix where it already lives also spares the fleet a second copy
        # of it, which keeps every instance's cache holding more distinct prefixes.
        locality = (cached if lw == 1.0 else lw * cached) * token_s
        # Its own decode: every step there reads all streams' KV, ours included. A crowded
        # instance stretches this request's time per token (and past the TPOT budget, costs
        # its SLO); without this term, requests whose prefill is cheap everywhere would
        # all tie on TTFT and pile onto one instance.
        own_step = tpot_factor * (decode_step + prompt * kv_s) / (1 - duty_after)
        positive = _max(forward, 1e-9)  # (> 0 with any prior that has a step cost; guarded all the same)
        capacity = m[CAPACITY_BLOCKS, s]
        kv_max = _max(kv_max, kv_usage[j])
        cap_min = _min(cap_min, capacity)
        o[O_TTFT, j], o[O_QUEUE, j], o[O_PREFILL, j], o[O_INTERFERENCE, j] = ttft, queue, prefill, interference
        o[O_CACHED, j], o[O_COMPUTE, j], o[O_OWN_STEP, j], o[O_FORWARD, j] = cached, compute, own_step, forward
        o[O_AHEAD, j], o[O_LOCALITY, j], o[O_CAPACITY, j], o[O_KV, j] = ahead, locality, capacity, 0.0
        f = O_FEATURES
        o[f, j], o[f + 1, j], o[f + 2, j], o[f + 3, j] = queue, prefill, uncached / 1e3, streams
        o[f + 4, j], o[f + 5, j], o[f + 6, j], o[f + 7, j] = context / 1e6, kv_usage[j], waiting[j], budget / 1e3
        o[f + 8, j], o[f + 9, j], o[f + 10, j] = forward, ahead / 1e3, decoding
        o[f + 11, j], o[f + 12, j] = positive, 0.01 / positive  # (row f + 11: numpy takes the log)
        o[_S_BACKLOG, j], o[_S_UNTRACKED, j], o[_S_DUTY, j] = backlog, untracked, duty
        o[_S_BACKLOG_TOK, j], o[_S_UNTRACKED_TOK, j] = backlog_tok, untracked_tok
    # Keep the clock-drained backlogs and duty: the next decision decays from here.
    for j in range(n):
        s = k[j]
        m[BACKLOG, s], m[BACKLOG_UNTRACKED, s], m[DUTY, s] = o[_S_BACKLOG, j], o[_S_UNTRACKED, j], o[_S_DUTY, j]
        m[DECAYED_AT, s] = _max(m[DECAYED_AT, s], now)
        m[BACKLOG_TOK, s], m[UNTRACKED_TOK, s] = o[_S_BACKLOG_TOK, j], o[_S_UNTRACKED_TOK, j]
    p[P_KV_MAX], p[P_CAPACITY_MIN] = kv_max, cap_min
    # The cost as it is unless KV pressure or the learned model's ranking change it (the
    # caller runs `finish` again then).
    finish(o, o[O_TTFT], o[O_OWN_STEP], o[O_KV], 0.0, p)


@njit(void(float64[:, ::1], intp), **JIT)
def refresh_context(m: np.ndarray, k: int) -> None:
    """Slot `k`'s context per stream, after its streams or context changed (`_Slots.refresh_context`)."""
    m[CONTEXT_PER_STREAM, k] = m[CONTEXT, k] / _max(m[STREAMS, k], 1.0)


@njit(void(float64[:, ::1], intp), **JIT)
def refresh(m: np.ndarray, k: int) -> None:
    """Slot `k`'s derived rows after its prior or learned speeds changed (`_Slots.refresh`)."""
    m[TOKEN_EFF, k] = m[TOKEN_S, k] * m[PREFILL_FACTOR, k]
    m[ATTN_EFF, k] = m[ATTN_S, k] * m[PREFILL_FACTOR, k]
    m[KV_EFF, k] = m[KV_S, k] * m[DECODE_FACTOR, k]
    m[OVERHEAD_DF, k] = m[OVERHEAD_S, k] * m[DECODE_FACTOR, k]
    token_f = m[FWD_TOKEN_F, k]
    if token_f != token_f:  # none fitted: the prefill factor's costs, the very floats
        m[FWD_TOKEN_EFF, k], m[FWD_ATTN_EFF, k] = m[TOKEN_EFF, k], m[ATTN_EFF, k]
    else:
        m[FWD_TOKEN_EFF, k], m[FWD_ATTN_EFF, k] = m[TOKEN_S, k] * token_f, m[ATTN_S, k] * token_f
    m[FWD_OVERHEAD, k] = m[OVERHEAD_S, k] * m[FWD_OVERHEAD_F, k]
    refresh_context(m, k)


@njit(void(float64[:, ::1], intp, float64, float64, float64, float64, float64, float64, float64, float64,
           float64), **JIT)
def book_prefill(m: np.ndarray, k: int, prefill_s: float, uncached: float, duty_added: float,
                 streamed: float, out_s: float, head_s: float, out_tok: float, head_tok: float, out_n: float) -> None:
    """A prefill that slot `k` will run: it joins the backlog (in seconds and in tokens), its compute
    the duty; a streamed one's outstanding totals (`tokenpilot.backlog.Outstanding`, kept by the
    caller) replace the slot's, the others' prefill drains by the clock alone (the untracked rows)."""
    m[BACKLOG, k] += prefill_s
    m[BACKLOG_TOK, k] += uncached
    if streamed != 0.0:
        m[OUT_S, k], m[HEAD_S, k], m[OUT_TOK, k], m[HEAD_TOK, k], m[OUT_N, k] = out_s, head_s, out_tok, head_tok, out_n
    else:
        m[BACKLOG_UNTRACKED, k] += prefill_s
        m[UNTRACKED_TOK, k] += uncached
    m[DUTY, k] += duty_added


@njit(void(float64[:, ::1], intp, float64, float64, float64, float64, float64, float64, float64, float64,
           float64, float64), **JIT)
def book(m: np.ndarray, k: int, prefill_s: float, uncached: float, duty_added: float, prompt: float,
         streamed: float, out_s: float, head_s: float, out_tok: float, head_tok: float, out_n: float) -> None:
    """A request routed to slot `k` (`TokenPilot._commit`): its prefill (`book_prefill`), and its
    prompt the context of one more stream."""
    book_prefill(m, k, prefill_s, uncached, duty_added, streamed, out_s, head_s, out_tok, head_tok, out_n)
    m[CONTEXT, k] += prompt
    m[STREAMS, k] += 1.0
    refresh_context(m, k)


@njit(float64(float64, float64), **INLINE)
def _pymax(a: float, b: float) -> float:
    """Python's `max(a, b)` of two floats: `b` only where `b > a` (so NaN loses as the second,
    wins as the first), which is not `np.maximum`'s rule (`fmax`)."""
    return b if b > a else a


@njit(void(float64[:, ::1], intp, float64, float64, float64), **JIT)
def settle(m: np.ndarray, k: int, now: float, elapsed: float, decay: float) -> None:
    """`TokenPilot._settle`'s arithmetic on slot `k` (it was Python on numpy scalars, ~12 us a call,
    twice per request): drain the backlog and duty by `elapsed` (the caller's `max(0.0, now -
    decayed_at)`; `decay`: numpy's exp of `elapsed / -window`, see the module doc), then reconcile
    the backlog with the outstanding prefill, in seconds and in tokens: the drains `score` runs
    (`drain_s`, `drain_tok`), so a backlog settles as a decision would see it. (Python's `max` where
    the code it replaced used it; the drains take numpy's rule, which differs only with NaN state:
    since i19-unify, when the two drains became one.)"""
    m[BACKLOG, k], m[BACKLOG_UNTRACKED, k] = drain_s(m, k, elapsed)
    m[DUTY, k] *= decay
    m[DECAYED_AT, k] = _pymax(m[DECAYED_AT, k], now)
    # (the drain rate from the slot's own streams: the engine's count is not at hand here)
    decoding = _pymax(m[STREAMS, k] - m[OUT_N, k], 0.0)
    m[BACKLOG_TOK, k], m[UNTRACKED_TOK, k] = drain_tok(m, k, elapsed, decoding, m[CONTEXT, k])
