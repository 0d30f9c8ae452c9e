"""TTFT by running the engine's scheduler forward over the prefill tokens known to be ahead.

Why not the cost model's own TTFT (queue seconds + this prefill's seconds): its queue is a
sum of per-request prefill estimates, and each of those carries a whole step's fixed cost
and the decode streams' KV reads, as if every prompt had its own steps. A chunked-prefill
engine (vLLM V1) packs the prompts ahead into shared steps of `max_num_batched_tokens`, so
that sum ran ~4x above the queue the simulated engine actually had (bench/ROUTING.md,
"Prediction error"). Here the queue is kept in *tokens* (uncached prompt tokens routed to
the instance and not through), and time comes from how the engine schedules them:

    every step: the decoding streams take one token each, prefill chunks the rest of the budget
    steps    = ceil((tokens ahead + ours) / (budget - decoding streams))
    TTFT     = the rest of the step under way + (steps - 1) full steps + the last, partial, step
               + our own attention over the context (quadratic in long prompts)

Step time is the roofline's shape over the prior's figures (`step_s`), with the instance's
own step costs: its fixed cost and its per-token cost each times a factor fitted from observed
TTFTs, and a cost added to every step fitted with them (`tokenpilot.learning.StepFit`, on
`forward_parts`' split of each prediction; the prefill speed factor and the prior's fixed cost
until 32 outcomes are in). One multiplicative factor
could not mend a wrong fixed cost: live over sim workers 4x faster than the roofline it left
every prompt under ~1,100 tokens predicted at ~30 ms (bench/ROUTING.md, "i19-pred"). The future (prompts
arriving after this one) is left out: in FCFS order they queue behind it and only lengthen
its last step, which the learned residual (`tokenpilot.latency_model`) can pick up. Measured,
not assumed (bench/ROUTING.md, "i19-arrive"): at the live benchmark's 40/s load, and past it with
the queue in the engines (FCFS), reported / observed stays 0.94-1.04 in every prompt-length fifth,
in the simulator and live after dispatch; what grew with the prompt live was the admission hold
before the dispatch, which the response's TTFT now holds (`RouteDecision.ttft_from_arrival_s`).
Pure: one candidate's floats in, seconds (or tokens per second) out; compiled (numba, see
`tokenpilot.jit`), so the router's scoring loop (`tokenpilot.score_kernel`) calls these very
functions, and Python code can call them too.
"""

from __future__ import annotations

import numpy as np
from numba import float64, njit
from numba.types import UniTuple

from tokenpilot.jit import INLINE, JIT, fmax, fmin


@njit(float64(float64, float64, float64, float64, float64, float64), **INLINE)
def step_s(tokens: float, context: float, token_s: float, kv_s: float, overhead_s: float, budget: float) -> float:
    """One engine step computing `tokens` new tokens while reading `context` tokens of KV: the
    roofline's max of memory (weights and fixed cost, the decode KV) and compute (per token, as in
    a full batch), which meets the prior at both of its anchors (a 1-token step, a full chunk).
    The sum of the two, as the cost model has it, ran 20-50% high on mixed steps (8B on H100)."""
    return fmax(overhead_s + context * kv_s, tokens * (token_s + overhead_s / budget))


@njit(float64(float64, float64, float64, float64, float64, float64, float64), **INLINE)
def drain_rate(decoding: float, context: float, budget: float, token_s: float, kv_s: float, overhead_s: float,
               step_add_s: float) -> float:
    """Prefill tokens per second an instance gets through while its queue is non-empty, each step
    `step_add_s` longer than the roofline's (the step fit's additive cost per step,
    `tokenpilot.learning.StepFit`; 0 until one is in, which leaves the roofline's very float)."""
    chunk = fmax(budget - decoding, 1.0)
    return chunk / (step_s(budget, context, token_s, kv_s, overhead_s, budget) + step_add_s)


@njit(float64(float64, float64, float64, float64), **INLINE)
def step_count(ahead_tokens: float, uncached: float, decoding: float, budget: float) -> float:
    """The engine steps `forward_ttft` waits through: half of the one under way (if any), then
    every chunk to its own last one. What an additive cost per step adds up over."""
    chunk = fmax(budget - decoding, 1.0)
    steps = fmax(np.ceil((ahead_tokens + uncached) / chunk), 1.0)
    return steps + (0.5 if fmin(ahead_tokens + decoding, budget) > 0 else 0.0)


@njit(float64(float64, float64, float64, float64, float64, float64, float64, float64, float64, float64), **INLINE)
def forward_ttft(ahead_tokens: float, uncached: float, cached: float, decoding: float, context: float,
                 budget: float, token_s: float, attn_s: float, kv_s: float, overhead_s: float) -> float:
    """Seconds from dispatch to first token on one candidate.

    ahead_tokens: prefill tokens queued there before this request; decoding: streams past
    their prefill; context: KV tokens the decoding streams read every step."""
    chunk = fmax(budget - decoding, 1.0)
    work = ahead_tokens + uncached
    steps = fmax(np.ceil(work / chunk), 1.0)
    full = step_s(budget, context, token_s, kv_s, overhead_s, budget)
    last = step_s(work - (steps - 1.0) * chunk + decoding, context, token_s, kv_s, overhead_s, budget)
    # The step under way when the request lands: half of one on average, of what is ahead (the
    # queue, the streams), nothing on an idle instance.
    now_tokens = fmin(ahead_tokens + decoding, budget)
    busy = step_s(now_tokens, context, token_s, kv_s, overhead_s, budget) if now_tokens > 0 else 0.0
    own_attention = attn_s * uncached * (cached + uncached / 2)
    return 0.5 * busy + (steps - 1.0) * full + last + own_attention


@njit(UniTuple(float64, 3)(float64, float64, float64, float64, float64, float64, float64, float64), **INLINE)
def _step_parts(tokens: float, context: float, token_s: float, kv_s: float, overhead_s: float, budget: float,
                token_f: float, overhead_f: float) -> tuple[float, float, float]:
    """`step_s` at token cost `token_s * token_f` and fixed cost `overhead_s * overhead_f`, split
    into (the fixed-cost part per unit of `overhead_f`, the per-token part per unit of `token_f`,
    the rest): the branch of the max taken at the scaled values."""
    ov, tok = overhead_s * overhead_f, token_s * token_f
    if ov + context * kv_s >= tokens * (tok + ov / budget):
        return overhead_s, 0.0, context * kv_s
    return tokens * overhead_s / budget, tokens * token_s, 0.0


@njit(UniTuple(float64, 4)(float64, float64, float64, float64, float64, float64, float64, float64, float64,
                           float64, float64, float64), **JIT)
def forward_parts(ahead_tokens: float, uncached: float, cached: float, decoding: float, context: float,
                  budget: float, token_s: float, attn_s: float, kv_s: float, overhead_s: float,
                  token_f: float, overhead_f: float) -> tuple[float, float, float]:
    """`forward_ttft` at per-token costs `token_s`, `attn_s` times `token_f` and step fixed cost
    `overhead_s` times `overhead_f`, as (a, b, c) with TTFT = overhead_f * a + token_f * b + c:
    `a`, the steps' fixed cost at factor 1; `b`, their per-token compute and own attention at
    factor 1; `c`, the decode streams' KV reads (the decode factor's, already in `kv_s`). Linear
    in the two factors for a given split of each step's max, which is what lets
    `tokenpilot.learning.StepFit` fit them by least squares from observed TTFTs. And `d`, the
    steps it waits through (`step_count`): what a cost paid once per step on top of the roofline's
    max (an engine's scheduling and sampling on the CPU, ~20 ms a step for vLLM on CPU) adds up
    over, which the max's fixed cost cannot stand for on steps that are compute-bound (it is
    amortised over the chunk's tokens there, so prompts of 300-1,500 tokens on vLLM on CPU were
    predicted 0.8x at the short end and 1.1x at the long one)."""
    chunk = fmax(budget - decoding, 1.0)
    work = ahead_tokens + uncached
    steps = fmax(np.ceil(work / chunk), 1.0)
    fa, fb, fc = _step_parts(budget, context, token_s, kv_s, overhead_s, budget, token_f, overhead_f)
    la, lb, lc = _step_parts(work - (steps - 1.0) * chunk + decoding, context, token_s, kv_s, overhead_s, budget,
                             token_f, overhead_f)
    now_tokens = fmin(ahead_tokens + decoding, budget)
    ba, bb, bc = 0.0, 0.0, 0.0
    if now_tokens > 0:
        ba, bb, bc = _step_parts(now_tokens, context, token_s, kv_s, overhead_s, budget, token_f, overhead_f)
    own_attention = attn_s * uncached * (cached + uncached / 2)
    n = steps - 1.0
    return (0.5 * ba + n * fa + la, 0.5 * bb + n * fb + lb + own_attention, 0.5 * bc + n * fc + lc,
            step_count(ahead_tokens, uncached, decoding, budget))
