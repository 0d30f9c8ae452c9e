"""The prefill an instance still has to do before a new request's: dispatches reconciled with first tokens.

TokenPilot adds each routed request's predicted prefill (seconds) to its instance's
backlog and drains the backlog with the clock, as if the engine worked it off at the
predicted speed. Alone, that estimate diverges both ways, and nothing brought it back:

* an engine slower than predicted (decode streams sharing its steps, a prefix that was
  evicted, a preemption) still holds prompts whose prefill the clock says is done, so
  the router sees an empty queue where tens of thousands of tokens wait (the misroute of
  bench/SLOMAX.md: chats sent behind ~35k-90k queued prompt tokens while another
  instance idled);
* an engine faster than predicted looks busy after it has gone idle, so it loses
  requests it should win.

A streamed request's first token says its prefill is through, so the router keeps the
predicted prefill of every streamed request sent and not yet through (`Outstanding`),
and the clock estimate is held between two bounds (`reconcile`):

    lower = outstanding - oldest outstanding   every request behind the one in progress is still to do
    upper = outstanding + untracked backlog     no more than what was sent and is not through

Requests answered in one piece have no observable first token: they stay in the clock
estimate only (`untracked`, drained by the same clock), like SLOMax's valve leaves them out.
Pure bookkeeping: times and events come from the caller.
"""

from __future__ import annotations

from numba import float64, njit

from tokenpilot.jit import INLINE, fmax, fmin


@njit(float64(float64, float64, float64, float64), **INLINE)
def reconcile(clock: float, untracked: float, outstanding: float, head: float) -> float:
    """One instance's clock-drained backlog, held within what the first tokens allow (compiled:
    the router's scoring loop calls it per candidate, `tokenpilot.score_kernel`)."""
    return fmin(fmax(clock, outstanding - head), outstanding + untracked)


class Outstanding:
    """Per instance slot: predicted prefill seconds of the requests sent and not through, oldest first.

    Bounded by the requests in flight: each leaves at its first token or, failing that,
    when it ends (`RequestOutcome`)."""

    def __init__(self) -> None:
        self._slots: list[dict[str, float]] = []

    def _of(self, k: int) -> dict[str, float]:
        while len(self._slots) <= k:
            self._slots.append({})
        return self._slots[k]

    def add(self, k: int, request_id: str, prefill_s: float) -> tuple[float, float]:
        """Record it; returns the slot's (outstanding total, oldest one's) seconds."""
        d = self._of(k)
        d.pop(request_id, None)
        d[request_id] = prefill_s
        return self.totals(k)

    def remove(self, k: int, request_id: str) -> tuple[float, float] | None:
        """Its prefill is through (or it ended): None if it was not outstanding there."""
        d = self._of(k)
        if d.pop(request_id, None) is None:
            return None
        return self.totals(k)

    def totals(self, k: int) -> tuple[float, float]:
        d = self._of(k)
        if not d:
            return 0.0, 0.0
        # Summed afresh (a few dozen entries at most): no drift from adding and subtracting.
        return float(sum(d.values())), next(iter(d.values()))

    def count(self, k: int) -> int:
        return len(self._of(k))
