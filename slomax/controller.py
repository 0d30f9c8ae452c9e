"""Goodput feedback: tune a pool's prefill budget and long-context cap from what admitted work got.

The goal is the most admitted work that still meets its SLO: every control interval the
pool hands in what it saw (`Signals`) — the TPOT of admitted requests relative to their
class SLO (p95 of tpot / SLO over classes that bound TPOT), the prefill rate the engines
really took, and whether waiting work was held back by the budget or by the long-context
cap. TPOT is the figure admission controls: prefill chunks share engine steps with every
running stream, so too much prefill per second stretches everyone's decode. (TTFT is the
engine valve's and the queue's business; their misses are not a capacity signal.)

* Prefill budget: unlimited until the first interval whose p95 exceeds the SLO; then it
  starts at the rate the engines were taking and steps down (its buckets empty: the engines
  are behind already, `SLOMax._size_budget`). Later: down while p95 > 1;
  up while p95 < `low` *and* the budget held work back (no pressure, no reason to grow:
  no wind-up in quiet hours); inside the band it holds still.
* Long-context cap: down when TPOT or the engines' share of TTFT suffers while long prompts
  took a large part of the prefill; up when long-context work waited on the cap and both
  were comfortable.
* Engine valve target (seconds an engine may take to start a new prefill): down while the
  p90 of engine-side TTFT / SLO is above `engine_high`; up while it is below `engine_low`
  and the valve held work back.

Each knob moves multiplicatively by a bounded step. A reversal halves the step (a knob
homes in on its operating point instead of oscillating around it); three moves the same
way grow it again (a real change in load is followed quickly); values stay in [lo, hi].
The dead band plus step halving is what makes it settle. A knob that five steps down
did not relieve goes back and holds (`Knob.lower`): when the SLO cannot be met at any load,
refusing more work only loses goodput.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Knob:
    value: float
    lo: float
    hi: float
    step: float = 0.10  # relative
    min_step: float = 0.01
    max_step: float = 0.25
    last_dir: int = 0
    streak: int = 0
    moves: int = 0
    reversals: int = 0
    floor: float = 0.0  # learned: going lower did not help (until `hold` runs out)
    hold: int = 0  # control intervals left before going below `floor` may be tried again
    backoff: int = 12  # the next hold, doubled each time a retry is futile too (at most 120)
    streak_signal: float | None = None  # the signal when the current run of steps down began
    streak_value: float | None = None  # the value then
    futile_after: int = 5  # steps down in a row that must have helped

    def nudge(self, direction: int) -> float:
        """Move one bounded step in `direction` (-1, 0, +1); returns the new value."""
        if direction == 0:
            return self.value
        if self.last_dir and direction != self.last_dir:
            self.step = max(self.min_step, self.step / 2)
            self.streak = 1
            self.reversals += 1
        else:
            self.streak += 1
            if self.streak >= 3:
                self.step = min(self.max_step, self.step * 1.5)
        self.last_dir = direction
        self.value = min(self.hi, max(self.lo, self.floor, self.value * (1 + self.step * direction)))
        self.moves += 1
        return self.value

    def lower(self, signal: float) -> float:
        """A step down to bring `signal` (higher is worse) down — unless `futile_after` steps down in
        a row bought less than a tenth of it: then this knob is not what hurts (an SLO the hardware
        cannot meet at any load, say), and squeezing on would only refuse work for nothing. It
        goes back to where those steps began and holds there for `backoff` intervals (doubling
        while retries stay futile) before it tries again."""
        if self.hold > 0:
            return self.value
        if self.last_dir < 0 and self.streak >= self.futile_after and self.streak_signal is not None \
                and signal > 0.9 * self.streak_signal and self.streak_value is not None:
            self.value = self.floor = self.streak_value
            self.hold, self.backoff = self.backoff, min(120, 2 * self.backoff)
            self.last_dir, self.streak, self.streak_signal, self.streak_value = 0, 0, None, None
            self.step = max(self.min_step, min(self.step, 0.10))
            return self.value
        if self.last_dir >= 0 or self.streak_signal is None:
            self.streak_signal, self.streak_value = signal, self.value
        return self.nudge(-1)

    def relax(self) -> None:
        """One control interval passed: a hold runs down; after it, lower values may be tried."""
        if self.hold > 0:
            self.hold -= 1
            if self.hold == 0:
                self.floor = 0.0

    def helped(self) -> None:
        """The signal came back inside its band: futile retries are forgotten."""
        self.backoff = 12


@dataclass(slots=True)
class Signals:
    """One pool's control interval."""

    # Admitted & completed requests with a TPOT bound: (tpot / class SLO, output tokens).
    tpot_ratios: list[tuple[float, int]] = field(default_factory=list)
    prefill_taken: float = 0.0  # uncached prompt tokens admitted in the interval, per ready instance
    interval_s: float = 0.0
    budget_pressure: int = 0  # polls on which the budget held waiting work back
    long_context_capped: int = 0  # polls on which long-context work waited on its cap
    long_context_taken: float = 0.0  # its part of prefill_taken
    # Dispatch to first token over the class TTFT SLO, for requests whose first token came.
    engine_ttft_ratios: list[float] = field(default_factory=list)
    valve_pressure: int = 0  # polls on which the engine valve held waiting work back

    def engine_p90(self) -> float | None:
        r = sorted(self.engine_ttft_ratios)
        return r[min(len(r) - 1, max(0, -(-9 * len(r) // 10) - 1))] if r else None

    def p95(self) -> float | None:
        """95th percentile of tpot / SLO over output *tokens*: a 3-token reply that caught one
        prefill chunk is a miss, but not evidence about the streams that carry the goodput."""
        r = sorted(self.tpot_ratios)
        total = sum(n for _, n in r)
        if not total:
            return None
        need, acc = 0.95 * total, 0
        for ratio, n in r:
            acc += n
            if acc >= need:
                return ratio
        return r[-1][0]


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    low: float = 0.80  # p95 tpot / SLO below this (with pressure): room to grow
    high: float = 1.00  # above this: too much prefill
    min_samples: int = 8  # fewer finished requests than this: no evidence, hold
    rate_lo: float = 50.0
    rate_hi: float = 1e7
    long_context_heavy: float = 0.3  # its part of the prefill taken that makes it a suspect
    engine_low: float = 0.35  # p90 of engine TTFT / SLO below this (with pressure): open the valve
    engine_high: float = 0.6  # above this: the engines queue too much, close it
    wait_lo: float = 0.01  # engine wait target bounds, seconds
    wait_hi: float = 10.0


class Controller:
    def __init__(self, long_context_cap: Knob, config: ControllerConfig | None = None,
                 rate: float | None = None, engine_wait_s: float = 0.25) -> None:
        self.config = config or ControllerConfig()
        c = self.config
        self.rate: Knob | None = None if rate is None else Knob(rate, c.rate_lo, c.rate_hi)
        # The valve's target: how long an engine may take to start a new prefill.
        self.engine_wait = Knob(engine_wait_s, min(c.wait_lo, engine_wait_s), max(c.wait_hi, engine_wait_s))
        self.long_context_cap = long_context_cap
        self.history: list[tuple[float, float | None, float, float | None]] = []  # now, rate, cap, p95

    def _valve(self, s: Signals) -> None:
        """The engine valve's target, from how much of their TTFT SLO the engines took (p90)."""
        c = self.config
        if len(s.engine_ttft_ratios) < c.min_samples:
            return
        p90 = s.engine_p90()
        assert p90 is not None
        if p90 > c.engine_high:
            self.engine_wait.lower(p90)
            return
        self.engine_wait.helped()
        if p90 < c.engine_low and s.valve_pressure > 0:
            self.engine_wait.nudge(+1)

    def _long_context(self, s: Signals, p95: float | None) -> None:
        """Long prompts in prefill stall the streams sharing their engine (TPOT) and hold back every
        request that lands behind them (engine-side TTFT): the cap comes down when either hurts while
        long prompts took a large part of the prefill, and goes up only when both are comfortable
        and long-context work waits on the cap."""
        c = self.config
        eng = s.engine_p90() if len(s.engine_ttft_ratios) >= c.min_samples else None
        hurt = (p95 is not None and p95 > c.high) or (eng is not None and eng > c.engine_high)
        heavy = s.prefill_taken > 0 and s.long_context_taken / s.prefill_taken > c.long_context_heavy
        if hurt and heavy:
            self.long_context_cap.lower(max(p95 or 0.0, eng or 0.0))
            return
        if not hurt:
            self.long_context_cap.helped()
        if (not hurt and s.long_context_capped > 0 and (p95 is None or p95 < c.low)
              and (eng is None or eng < c.engine_low)):
            self.long_context_cap.nudge(+1)

    def update(self, s: Signals, now: float) -> None:
        c = self.config
        p95 = s.p95() if len(s.tpot_ratios) >= c.min_samples else None
        if p95 is not None:
            taken = s.prefill_taken / s.interval_s if s.interval_s > 0 else 0.0
            if p95 > c.high:
                if self.rate is None:
                    # First sign of trouble: start from what the engines were really taking.
                    self.rate = Knob(max(c.rate_lo, taken), c.rate_lo, c.rate_hi)
                elif taken > 0:
                    # Step down from what was really taken, not from a limit nobody reached.
                    self.rate.value = max(c.rate_lo, self.rate.floor, min(self.rate.value, taken))
                self.rate.lower(p95)
            else:
                if self.rate is not None:
                    self.rate.helped()
                if p95 < c.low and self.rate is not None and s.budget_pressure > 0:
                    self.rate.nudge(+1)
        self._long_context(s, p95)
        self._valve(s)
        for knob in (self.rate, self.engine_wait, self.long_context_cap):
            if knob is not None:
                knob.relax()
        self.history.append((now, None if self.rate is None else self.rate.value, self.long_context_cap.value, p95))
        if len(self.history) > 2048:
            del self.history[:1024]
