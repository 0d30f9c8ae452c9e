"""Online correction of each instance's prefill and decode speed from observed timings.

Each completed request yields an observed/predicted ratio for its TTFT (prefill
and the queue ahead of it) and for its time per output token (decode step cost).
A robust, bounded update in log space turns those ratios into per-instance speed
factors: one outlier moves a factor by at most `max_step` (x1.15 by default), a
persistent bias converges geometrically, and a degraded instance (thermal
throttling, a noisy neighbour, a bad GPU) is priced slower within a few dozen
requests. This is a one-parameter-per-term regression fitted by stochastic
steps, chosen over batch least squares because it is O(1) per observation and
tracks drift without a window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class SpeedFactor:
    """Multiplier on a prior's time estimate (2.0 = the instance is twice as slow)."""

    value: float = 1.0
    rate: float = 0.03  # learning rate in log space: noise averages out over ~30 samples
    max_step: float = 0.05  # |log change| per observation (about x1.05)
    lo: float = 0.25  # a prior more than 4x off is a wrong prior, not something to learn (callers may widen it)
    hi: float = 4.0
    samples: int = 0

    def update(self, observed_s: float, predicted_s: float) -> None:
        if observed_s <= 0 or predicted_s <= 0 or not math.isfinite(observed_s / predicted_s):
            return
        step = max(-self.max_step, min(self.max_step, self.rate * math.log(observed_s / predicted_s)))
        self.value = max(self.lo, min(self.hi, self.value * math.exp(step)))
        self.samples += 1
