"""Request classes and their SLOs: what "met its SLO" means, for goodput everywhere.

Defaults (override per tenant or per run):

| class        | TTFT     | mean TPOT | deadline (end to end) |
|--------------|----------|-----------|-----------------------|
| interactive  | <= 1 s   | <= 50 ms  | —                     |
| long_context | <= 8 s   | <= 80 ms  | —                     |
| batch        | —        | —         | <= 10 min             |

A request that names no class is `long_context` from 8,192 prompt tokens up,
else `interactive`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

INTERACTIVE = "interactive"
LONG_CONTEXT = "long_context"
BATCH = "batch"
LONG_CONTEXT_MIN_TOKENS = 8192


@dataclass(frozen=True, slots=True)
class ClassSLO:
    ttft_s: float | None = None
    tpot_s: float | None = None
    deadline_s: float | None = None

    def met(self, ttft_s: float | None, mean_tpot_s: float | None, e2e_s: float | None) -> bool:
        """True when a *completed* request met every bound this class sets."""
        if self.ttft_s is not None and (ttft_s is None or ttft_s > self.ttft_s):
            return False
        if self.tpot_s is not None and mean_tpot_s is not None and mean_tpot_s > self.tpot_s:
            return False
        if self.deadline_s is not None and (e2e_s is None or e2e_s > self.deadline_s):
            return False
        return True

    def overridden(self, ttft_s: float | None, tpot_s: float | None, deadline_s: float | None) -> ClassSLO:
        """These bounds with the given ones in their place (None keeps this one's): how a fleet
        file's class, or a tenant's, tunes an SLO it inherits."""
        return ClassSLO(ttft_s if ttft_s is not None else self.ttft_s,
                        tpot_s if tpot_s is not None else self.tpot_s,
                        deadline_s if deadline_s is not None else self.deadline_s)


DEFAULT_SLOS: Mapping[str, ClassSLO] = {
    INTERACTIVE: ClassSLO(ttft_s=1.0, tpot_s=0.050),
    LONG_CONTEXT: ClassSLO(ttft_s=8.0, tpot_s=0.080),
    BATCH: ClassSLO(deadline_s=600.0),
}


def class_by_length(prompt_tokens: int) -> str:
    return LONG_CONTEXT if prompt_tokens >= LONG_CONTEXT_MIN_TOKENS else INTERACTIVE
