"""Online correction of each instance's prefill and decode speed from observed timings.

Each completed request yields an observed/predicted ratio for its TTFT (prefill
and the queue ahead of it) and for its time per output token (decode step cost).
A robust, bounded update in log space turns those ratios into per-instance speed
factors: one outlier moves a factor by at most `max_step` (x1.05 by default), a
persistent bias converges geometrically, and a degraded instance (thermal
throttling, a noisy neighbour, a bad GPU) is priced slower within a few dozen
requests. The per-update clamp is what holds an outlier, not the factor's bounds:
those only say how far off a prior may be and still be learned (`SpeedFactor`).
This is a one-parameter-per-term regression fitted by stochastic steps, chosen
over batch least squares because it is O(1) per observation and tracks drift
without a window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class SpeedFactor:
    """Multiplier on a prior's time estimate (2.0 = the instance is twice as slow).

    Bounds [1/16, 256] (i19-cap; [1/4, 4] from 7cc29c8, "a prior more than 4x off is a wrong prior,
    not something to learn", the prefill factor's floor 1/16 since 8fc0c8e). An instance on hardware
    the roofline has no figures for starts from the generic `EnginePrior`, which can be 10x or more
    off (vLLM on CPU), and with both factors at 4 the routing cost priced such an engine's queue and
    prefill 2.5x fast, and its decode step ~4x fast next to the other instances of its pool
    (bench/ROUTING.md, "i19-cap"). 256 is the `StepFit`'s 64 (an engine 64x slower than its prior)
    times 4: these factors also carry the cost model's shape, which the step fit does not (the decode
    factor the duty's stretch of a time per token, 1.5-2.1x under load in the simulator; the prefill
    factor the step fixed cost its term holds at the prior's, ~1.4x), and with 64 an engine 32x slow
    under load already pinned the decode factor. What keeps one wild outcome from swinging routing is
    `max_step`: an outcome moves the factor by at most x1.05 whatever its ratio, so 4 is left only by
    ~28 outcomes in a row that all say so, 256 reached by ~110, and left again by as many that do not."""

    value: float = 1.0
    rate: float = 0.03  # learning rate in log space: noise averages out over ~30 samples
    max_step: float = 0.05  # |log change| per observation (about x1.05): what holds an outlier
    lo: float = 1 / 16  # an engine 16x faster than its prior (4x, with the shape's margin)
    hi: float = 256.0  # ... or 256x slower (64x)
    samples: int = 0

    def update(self, observed_s: float, predicted_s: float) -> None:
        if observed_s <= 0 or predicted_s <= 0 or not math.isfinite(observed_s / predicted_s):
            return
        step = max(-self.max_step, min(self.max_step, self.rate * math.log(observed_s / predicted_s)))
        self.value = max(self.lo, min(self.hi, self.value * math.exp(step)))
        self.samples += 1


@dataclass(slots=True)
class StepFit:
    """One instance's engine step, fixed cost and per-token cost learned apart, from observed TTFTs.

    A `SpeedFactor` multiplies a whole prediction, so it cannot mend a wrong intercept: with the
    prior's step fixed cost 4x too high (a sim worker run 4x faster than real time) it drove the
    prefill factor to its bound and still left short prompts 2-2.7x over and long ones 0.6x under
    (bench/ROUTING.md, "i19-live"). Here the scheduler-forward TTFT is split, at the decision, into
    its steps' fixed cost `a` and per-token cost `b` at factor 1 and the rest `c`
    (`tokenpilot.forward.forward_parts`), and the two factors are fitted by weighted least squares,
    observed = overhead_f * a + token_f * b + c, each outcome weighted by 1 / predicted² (the
    relative error is what is judged; weighting by 1 / observed² instead biased the fit low
    under noise, the shortest observations weighing most) and by 1 / its own relative error at
    that prediction (floored at `robust_floor`: a least-absolute-deviation fit, approximately; plain
    least squares let the simulator's few 20-40x outcomes, mostly-cached prompts whose prefix the
    engine no longer held, drive the fixed-cost factor to its bound), older outcomes fading by `decay` each (no clock: the
    window is ~1 / (1 - decay) outcomes). A ridge term of `prior_weight` mean outcomes pulls both
    factors toward the caller's fallback, so one kind of prompt (every one a single step) leaves
    the unidentified factor where it was; below `min_samples` outcomes there is no fit at all
    (`fit` returns None: the caller keeps its prior). Both within [`lo`, `hi`].

    A third term, fitted with them (`fit`): a cost paid once per engine step on top of the
    roofline's max (`steps`: `forward_parts`' `d`), in seconds, within [0, `add_hi`], its ridge
    toward 0. The max's fixed cost is amortised over a compute-bound step's tokens, so it cannot
    stand for what a real engine spends per step whatever the batch (vLLM on CPU: scheduling,
    sampling, ~20 ms a step): without it the fit left prompts of 300-1,500 tokens 0.8x at the
    short end and 1.1x at the long one there, with the fixed-cost factor at its bound.

    `hi` is 64, not 4: an instance on hardware the roofline has no figures for starts from the
    generic `EnginePrior`, which can be an order of magnitude off (vLLM on CPU: ~10x slower on
    a slower VM, where both factors sat at 4 and every TTFT was reported 0.4x, bench/ROUTING.md
    "i19-vllm"); the robust weighting, not the bound, is what keeps outliers from dragging the
    fit. Pure: O(1) per outcome, no I/O."""

    decay: float = 0.995
    min_samples: int = 32
    prior_weight: float = 1.0
    robust_floor: float = 0.1
    lo: float = 1 / 16
    hi: float = 64.0
    add_hi: float = 1.0  # seconds a step: the additive per-step cost's bound
    saa: float = 0.0
    sab: float = 0.0
    sbb: float = 0.0
    say: float = 0.0
    sby: float = 0.0
    sad: float = 0.0
    sbd: float = 0.0
    sdd: float = 0.0
    sdy: float = 0.0
    weight: float = 0.0  # outcomes in the window (decayed count)
    samples: int = 0

    def update(self, a: float, b: float, c: float, observed_s: float, predicted_s: float,
               steps: float = 0.0) -> None:
        """One outcome: the forward TTFT's split at its decision (`steps`: its `d`, 0 where the caller
        has no per-step term), what it got, and what was predicted."""
        if not (a >= 0 and b >= 0 and steps >= 0 and observed_s > 0 and predicted_s > 0
                and math.isfinite(a + b + c + steps + observed_s + predicted_s)):
            return
        # Relative squared error, and a least-absolute-deviation reweighting (by the outcome's error
        # at its own prediction, floored at `robust_floor`): an outcome far off the prediction (a
        # prefix the engine had evicted, a burst) moves the fit as much as a median fit would let it.
        w = 1.0 / (max(predicted_s, 1e-3) ** 2 * max(abs(observed_s / predicted_s - 1.0), self.robust_floor))
        y = observed_s - c
        d = self.decay
        self.saa = d * self.saa + w * a * a
        self.sab = d * self.sab + w * a * b
        self.sbb = d * self.sbb + w * b * b
        self.say = d * self.say + w * a * y
        self.sby = d * self.sby + w * b * y
        self.sad = d * self.sad + w * a * steps
        self.sbd = d * self.sbd + w * b * steps
        self.sdd = d * self.sdd + w * steps * steps
        self.sdy = d * self.sdy + w * steps * y
        self.weight = d * self.weight + 1.0
        self.samples += 1

    def _step_add(self, la: float, lb: float, overhead_f: float, token_f: float) -> float:
        """The additive per-step cost of the three-term ridge fit (0 where the data hold no steps or
        the system is singular), within [0, `add_hi`]; the factors are then fitted given it."""
        if not self.sdd > 0:
            return 0.0
        # Cramer's rule for the third unknown of the symmetric 3 x 3 normal equations (O(1), no numpy)
        a11, a12, a13 = self.saa + la, self.sab, self.sad
        a22, a23, a33 = self.sbb + lb, self.sbd, self.sdd + self.prior_weight * self.sdd / self.weight
        v1, v2, v3 = self.say + la * overhead_f, self.sby + lb * token_f, self.sdy
        det = a11 * (a22 * a33 - a23 * a23) - a12 * (a12 * a33 - a23 * a13) + a13 * (a12 * a23 - a22 * a13)
        if not det > 0:
            return 0.0
        z = (a11 * (a22 * v3 - v2 * a23) - a12 * (a12 * v3 - v2 * a13) + v1 * (a12 * a23 - a22 * a13)) / det
        return min(max(z, 0.0), self.add_hi) if math.isfinite(z) else 0.0

    def fit(self, overhead_f: float, token_f: float) -> tuple[float, float, float] | None:
        """(fixed-cost factor, per-token factor, additive seconds per step) fitted, the factors pulled
        toward the fallback (`overhead_f`, `token_f`) and the per-step cost toward 0; None while data
        is thin."""
        if self.samples < self.min_samples or not self.weight > 0:
            return None
        la = self.prior_weight * self.saa / self.weight
        lb = self.prior_weight * self.sbb / self.weight
        z = self._step_add(la, lb, overhead_f, token_f)
        paa, pbb = self.saa + la, self.sbb + lb
        pa, pb = self.say - z * self.sad + la * overhead_f, self.sby - z * self.sbd + lb * token_f
        det = paa * pbb - self.sab * self.sab
        if not (det > 0 and paa > 0 and pbb > 0):
            return None
        x = (pa * pbb - pb * self.sab) / det
        t = (paa * pb - self.sab * pa) / det
        lo, hi = self.lo, self.hi
        # One out of bounds: hold it at the bound and fit the other given it.
        if not lo <= x <= hi:
            x = min(max(x, lo), hi)
            t = (pb - self.sab * x) / pbb
        elif not lo <= t <= hi:
            t = min(max(t, lo), hi)
            x = min(max((pa - self.sab * t) / paa, lo), hi)
        return x, min(max(t, lo), hi), z
