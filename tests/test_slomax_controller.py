"""The feedback controller on a step change in load: it settles, without oscillating, in bounded steps."""

from __future__ import annotations

from itertools import pairwise

from slomax.controller import Controller, Knob, Signals

KNEE = 7000.0  # prefill tokens/s per instance at which the plant's p95 TPOT reaches its SLO


def tpot_ratio(taken: float, knee: float = KNEE) -> float:
    """The plant: p95 TPOT / SLO grows with the prefill the engines take (linear, 0.3 at idle)."""
    return 0.3 + 0.7 * taken / knee


def interval(ctl: Controller, demand: float, knee: float = KNEE) -> tuple[float, float | None]:
    """One 5 s control interval of a pool of one instance offered `demand` prefill tokens/s."""
    rate = ctl.rate.value if ctl.rate is not None else None
    taken = demand if rate is None else min(demand, rate)
    s = Signals(tpot_ratios=[(tpot_ratio(taken, knee), 100)] * 50, prefill_taken=taken * 5.0, interval_s=5.0,
                budget_pressure=int(rate is not None and demand > rate))
    ctl.update(s, 0.0)
    return taken, None if ctl.rate is None else ctl.rate.value


def test_prefill_budget_settles_after_a_step_in_load_and_holds_still() -> None:
    ctl = Controller(Knob(2.0, 0.25, 64.0))
    # Light load: in the SLO, nothing to protect — the budget stays unlimited (no wind-up).
    for _ in range(20):
        assert interval(ctl, 4000.0) == (4000.0, None)
    # Step to 2x the knee: TPOT blows through the SLO and the controller takes over.
    values = [interval(ctl, 2 * KNEE)[1] for _ in range(60)]
    rate = ctl.rate
    assert rate is not None
    # Every move is bounded ...
    moves = [b / a - 1 for a, b in pairwise(values) if a is not None and b is not None and a != b]
    assert all(abs(m) <= 0.25 + 1e-9 for m in moves)
    # ... it ends inside the band (p95 between 0.8 and 1.0 of the SLO) ...
    final = values[-1]
    assert final is not None and 0.8 <= tpot_ratio(final) <= 1.0
    # ... and holds still there: no oscillation, and it got there with few reversals.
    assert len(set(values[-30:])) == 1
    assert rate.reversals <= 3
    # Load falls back below the knee: within the SLO, no pressure, the budget does not creep.
    for _ in range(20):
        taken, v = interval(ctl, 4000.0)
        assert taken == 4000.0 and v == final
    # The load turns heavier (longer contexts: each prefill token now hurts twice as much):
    # followed down, settling again ...
    values = [interval(ctl, 2 * KNEE, KNEE / 2)[1] for _ in range(60)]
    assert values[-1] is not None and 0.8 <= tpot_ratio(values[-1], KNEE / 2) <= 1.0
    assert len(set(values[-20:])) == 1
    # ... and lighter again (with demand pressing on the budget): followed up, settling again.
    values = [interval(ctl, 2 * KNEE)[1] for _ in range(60)]
    assert values[-1] is not None and 0.8 <= tpot_ratio(values[-1]) <= 1.0 and len(set(values[-20:])) == 1
    assert rate.reversals <= 4


def test_engine_valve_target_tightens_when_engines_queue_and_reopens_under_pressure() -> None:
    ctl = Controller(Knob(2.0, 0.25, 64.0), engine_wait_s=0.25)
    target = ctl.engine_wait

    def engine_interval(queueing: float, pressure: int) -> float:
        # engine TTFT / SLO: the prefill itself (0.2) plus what queueing beyond the target adds
        ratio = 0.2 + queueing * target.value
        ctl.update(Signals(engine_ttft_ratios=[ratio] * 20, valve_pressure=pressure), 0.0)
        return target.value

    start = target.value
    # Queueing grows with the target (x2 per second of it): p90 0.7 > 0.6 → tighten, bounded.
    seen = [engine_interval(2.0, 0) for _ in range(40)]
    assert seen[0] < start and all(b <= a for a, b in pairwise(seen))
    assert 0.2 + 2.0 * seen[-1] <= 0.6 + 0.05  # settled where the engines' share fits the band
    # Engines fast again, and the valve holds work back: it opens again, step by bounded step.
    low = seen[-1]
    up = [engine_interval(0.1, 5) for _ in range(10)]
    assert up[-1] > low and all(b / a - 1 <= 0.25 + 1e-9 for a, b in pairwise(up))
    # No pressure: nothing to gain by opening further, it holds.
    assert engine_interval(0.1, 0) == up[-1]


def test_knob_steps_are_bounded_halve_on_reversal_and_respect_limits() -> None:
    k = Knob(10.0, 1.0, 12.0, step=0.2)
    assert k.nudge(+1) == 12.0  # clamped at hi
    k.nudge(-1)
    assert k.step == 0.1 and k.reversals == 1  # reversal halves the step
    for _ in range(50):
        k.nudge(-1)
    assert k.value == 1.0 and k.step <= 0.25  # clamped at lo; growth capped
    assert k.nudge(0) == 1.0


def test_a_knob_that_does_not_help_stops_squeezing() -> None:
    """An SLO the hardware cannot meet at any load (TPOT 1.5x SLO whatever the budget): after a
    few steps down that bought nothing, the budget stops falling instead of refusing all work."""
    ctl = Controller(Knob(2.0, 0.25, 64.0))
    values = []
    for _ in range(100):
        ctl.update(Signals(tpot_ratios=[(1.5, 100)] * 50, prefill_taken=5.0 * 5000, interval_s=5.0), 0.0)
        values.append(ctl.rate.value if ctl.rate is not None else None)
    assert ctl.rate is not None and values[-3] == 5000.0  # back where the futile steps began
    assert min(v for v in values if v is not None) > 0.4 * 5000  # five bounded steps at most
    # It tries again now and then, less and less often while that stays futile.
    probes = [i for i, (a, b) in enumerate(pairwise(values)) if a == 5000.0 and b is not None and b < a]
    assert probes == [16, 45, 98]  # held 12 intervals, then 24, then 48: the holds double
