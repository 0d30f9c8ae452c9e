"""TokenPilot's TPOT budget by class (`TokenPilotConfig.class_tpot_slo`, issue 19).

The stall a prefill causes the streams decoding on an instance is priced against their own
classes' TPOT SLOs (the mean over the streams routed there: the STREAM_SLO row), the request's
own decode against its class's; off, every stream has `tpot_slo_s` (decisions unchanged: the
replays of tests/test_score_once.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from fleetcore.policies import EnginePrior
from fleetcore.slo import DEFAULT_SLOS, LONG_CONTEXT, ClassSLO
from fleetcore.types import InstanceSnapshot, RequestOutcome, RequestProfile
from tokenpilot.router import TokenPilot, TokenPilotConfig, tpot_slos_of

# A decode step of ~45 ms: streams there run between the interactive budget (50 ms) and the
# long-context one (80 ms) once prefill duty stretches them.
PRIOR = EnginePrior(step_overhead_s=0.045)


def _snap(iid: str, running: int = 0) -> InstanceSnapshot:
    return InstanceSnapshot(iid, "s", "m", "v", f"http://{iid}", num_running=running)


def _router(config: TokenPilotConfig, a_class: str | None = LONG_CONTEXT) -> tuple[TokenPilot, list[str]]:
    """Four streams of `a_class` routed to `a`, four interactive ones to `b` (same prompts)."""
    tp = TokenPilot({"a": PRIOR, "b": PRIOR}, config=config)
    rids = []
    for i in range(8):
        on, cls = ("a", a_class) if i < 4 else ("b", None)  # (None: interactive by length)
        p = RequestProfile(f"r{i}", "m", prompt_tokens=2000, request_class=cls, stream=True)
        assert tp.route(p, (_snap(on),), now=0.01 * i).instance_id == on
        tp.on_first_token(p.request_id, now=0.01 * i + 0.001)
        rids.append(p.request_id)
    return tp, rids


def _priced(config: TokenPilotConfig, request_class: str | None = None,  # type: ignore[no-untyped-def]
            a_class: str | None = LONG_CONTEXT):
    tp, _ = _router(config, a_class)
    p = RequestProfile("new", "m", prompt_tokens=6000, request_class=request_class, stream=True)
    return tp, tp.price(p, (_snap("a"), _snap("b")), now=0.1)


def test_default_map_is_the_slo_classes_with_a_tpot_bound() -> None:
    assert tpot_slos_of(DEFAULT_SLOS) == (("interactive", 0.05), ("long_context", 0.08))
    assert tpot_slos_of({"x": ClassSLO(ttft_s=1.0), "y": ClassSLO(tpot_s=0.1)}) == (("y", 0.1),)


def test_streams_slo_sum_follows_routes_and_releases() -> None:
    tp, rids = _router(TokenPilotConfig(class_tpot_slo=True))
    m, s = tp._s.m, tp._s
    a, b = s.slot("a"), s.slot("b")
    # (each stream's budget less tpot_slo_s: interactive ones add exactly nothing)
    assert m[s.STREAM_SLO, a] == pytest.approx(4 * 0.03) and m[s.STREAM_SLO, b] == 0.0
    tp.observe(RequestOutcome(rids[0], "a", "s", ok=True, prompt_tokens=2000, output_tokens=10, ttft_s=0.1,
                              mean_tpot_s=0.05))
    assert m[s.STREAM_SLO, a] == pytest.approx(3 * 0.03)
    for rid in rids[1:4]:
        tp.observe(RequestOutcome(rid, "a", "s", ok=False))
    assert m[s.STREAMS, a] == 0.0 and m[s.STREAM_SLO, a] == 0.0  # exactly: nothing left over
    off, _ = _router(TokenPilotConfig())  # off: not kept (streams booked then count at tpot_slo_s)
    assert not off._s.m[s.STREAM_SLO].any()


def test_off_prices_every_stream_at_tpot_slo_s() -> None:
    _, long_a = _priced(TokenPilotConfig(explore=0.0))
    _, interactive_a = _priced(TokenPilotConfig(explore=0.0), a_class=None)
    # the classes of a's streams change nothing: the same terms, bit for bit
    for x, y in zip(long_a.terms[:9], interactive_a.terms[:9]):
        assert np.array_equal(x, y)
    assert long_a.interference[0] > 0


def test_on_long_context_streams_absorb_more_of_the_stall() -> None:
    _, off = _priced(TokenPilotConfig(explore=0.0))
    _, on = _priced(TokenPilotConfig(explore=0.0, class_tpot_slo=True))
    # b's streams are interactive: budget 50 ms as before; a's have 80 ms of budget, more slack
    assert on.interference[1] == off.interference[1]
    assert on.interference[0] < off.interference[0]
    assert on.cost[0] < on.cost[1]
    # an instance of interactive streams only: priced exactly as off (no rounding of a mean)
    _, on_i = _priced(TokenPilotConfig(explore=0.0, class_tpot_slo=True), a_class=None)
    _, off_i = _priced(TokenPilotConfig(explore=0.0), a_class=None)
    for x, y in zip(on_i.terms[:9], off_i.terms[:9]):
        assert np.array_equal(x, y)


def test_on_own_decode_budget_is_the_request_class() -> None:
    # A long-context request's own decode past 50 ms costs nothing until 80 ms.
    _, off = _priced(TokenPilotConfig(explore=0.0), LONG_CONTEXT)
    _, on = _priced(TokenPilotConfig(explore=0.0, class_tpot_slo=True), LONG_CONTEXT)
    assert np.all(on.decode <= off.decode) and np.any(on.decode < off.decode)


def test_on_a_map_of_its_own_and_a_class_outside_it() -> None:
    cfg = TokenPilotConfig(explore=0.0, class_tpot_slo=True, class_tpot_slos=(("interactive", 0.08),))
    tp, on = _priced(cfg)
    _, both80 = _priced(TokenPilotConfig(explore=0.0, tpot_slo_s=0.08))
    # every stream now 80 ms except a's long-context ones, outside the map: `tpot_slo_s` (50 ms)
    assert on.interference[1] == both80.interference[1]
    assert tp._tpot_slo_of(RequestProfile("x", "m", 10, request_class=LONG_CONTEXT)) == 0.05
    assert tp._tpot_slo_of(RequestProfile("x", "m", 10)) == 0.08
