"""The roofline's optional compute-efficiency curve: off = the constant bit for bit, on = applied.

Golden step times below were printed by main's `fleetcore.roofline` at 951f657 (before the curve
existed); without a curve every one must come out identical (==, not approx).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from engine_adapters.sim.engine import SimEngine
from fleetcore.fleet_config import FleetConfig, load_fleet_file
from fleetcore.hardware import gpu, model
from fleetcore.roofline import DEFAULT_COMPUTE_EFFICIENCY, StepTimer
from fleetsim.disagg import pd_fleet
from fleetsim.simulator import fleet_instances

# (model, gpu, tp, prefill chunks, decode context lens, step seconds, plateau tok/s) at 951f657.
GOLDEN = [
    ("llama-3.1-70b", "h200", 2, [(1024, 0)], [], 0.11618470718454108, 9034.022609789361),
    ("llama-3.1-70b", "h200", 2, [(512, 6000)], [4000] * 30, 0.06849871573084945, 9034.022609789361),
    ("llama-3.1-70b", "h200", 2, [], [8000] * 60, 0.04071149013333333, 9034.022609789361),
    ("llama-3.1-8b", "h100", 1, [(8192, 0)], [], 0.2026395861903974, 46762.422873423646),
    ("llama-3.1-8b", "h100", 1, [(100, 50)], [300, 700], 0.006156832764179105, 46762.422873423646),
    ("qwen2.5-32b", "a100", 4, [(2048, 1000), (37, 0)], [1] * 5, 0.18019505427195026, 12147.004096887178),
]

CURVE = [(512, 0.50), (1024, 0.60), (4096, 0.66)]


@pytest.mark.parametrize(("m", "g", "tp", "prefill", "decode", "step_s", "plateau"), GOLDEN,
                         ids=[f"{c[0]}-{c[1]}-tp{c[2]}-{i}" for i, c in enumerate(GOLDEN)])
def test_no_curve_is_the_constant_bit_for_bit(m: str, g: str, tp: int, prefill: list[tuple[int, int]],
                                              decode: list[int], step_s: float, plateau: float) -> None:
    t = StepTimer(model(m), gpu(g), tp)
    assert t.step_time(prefill, decode) == step_s
    assert t.prefill_throughput_tokens_per_s() == plateau
    assert t.compute_efficiency_at(1024) == DEFAULT_COMPUTE_EFFICIENCY


def _compute_part(t: StepTimer, tokens: int) -> float:
    """Step time less the fixed and per-token costs that do not depend on the efficiency."""
    return t.step_time([(tokens, 0)], []) - t.step_overhead_s - t._comm_fixed_s - t._comm_s_per_tok * tokens


def test_curve_scales_a_compute_bound_step_by_its_efficiency() -> None:
    m, g = model("llama-3.1-70b"), gpu("h200")
    flat, curved = StepTimer(m, g, 2), StepTimer(m, g, 2, compute_efficiency_curve=CURVE)
    # 1,024 and 512 tokens are compute bound on 2 x H200: the compute term is the step.
    assert _compute_part(curved, 1024) == pytest.approx(_compute_part(flat, 1024) * 0.66 / 0.60, rel=1e-12)
    assert _compute_part(curved, 512) == pytest.approx(_compute_part(flat, 512) * 0.66 / 0.50, rel=1e-12)
    # Interpolated in tokens between points, held flat outside them.
    assert curved.compute_efficiency_at(768) == pytest.approx(0.55)
    assert curved.compute_efficiency_at(2560) == pytest.approx(0.63)
    assert curved.compute_efficiency_at(16) == 0.50
    assert curved.compute_efficiency_at(8192) == 0.66
    assert curved.prefill_throughput_tokens_per_s() == pytest.approx(flat.prefill_throughput_tokens_per_s())


def test_curve_leaves_a_memory_bound_step_alone() -> None:
    m, g = model("llama-3.1-70b"), gpu("h200")
    flat, curved = StepTimer(m, g, 2), StepTimer(m, g, 2, compute_efficiency_curve=CURVE)
    decode = [8000] * 20  # 20 streams: weights + KV read, far above 20 tokens' FLOPs at 0.5
    assert curved.step_time([], decode) == flat.step_time([], decode)


def test_a_constant_curve_equals_the_constant() -> None:
    m, g = model("llama-3.1-8b"), gpu("h100")
    flat, const = StepTimer(m, g, 1), StepTimer(m, g, 1, compute_efficiency_curve=[(1, DEFAULT_COMPUTE_EFFICIENCY)])
    for prefill, decode in (([(4096, 0)], []), ([(333, 900)], [100] * 7), ([], [2000] * 40)):
        assert const.step_time(prefill, decode) == pytest.approx(flat.step_time(prefill, decode), rel=1e-12)


@pytest.mark.parametrize(("curve", "needle"), [
    ([], "at least one point"),
    ([(512, 0.5), (512, 0.6)], "strictly increasing"),
    ([(1024, 0.6), (512, 0.5)], "strictly increasing"),
    ([(512, 1.2)], r"\(0, 1\]"),
    ([(512, 0.0)], r"\(0, 1\]"),
    ([(0, 0.5)], ">= 1"),
    ([(512.5, 0.5)], ">= 1"),
    ([(512, 0.5, 1)], "want"),
])
def test_bad_curves_are_refused(curve: list, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        StepTimer(model("llama-3.1-8b"), gpu("h100"), compute_efficiency_curve=curve)


def _fleet_with_curve(curve: list | None) -> FleetConfig:
    raw = yaml.safe_load(Path("deploy/sim/pd32.yaml").read_text())
    if curve is not None:
        raw["models"][0]["engine"]["compute_efficiency_curve"] = curve
    return FleetConfig.model_validate(raw)


def test_fleet_file_curve_reaches_the_simulated_engines() -> None:
    assert load_fleet_file(Path("deploy/sim/pd32.yaml")).models[0].engine.compute_efficiency_curve is None
    curve = [[512, 0.5], [1024, 0.6], [4096, 0.66]]
    for mode in ("off", "static"):  # `static` runs the P/D copy of the fleet (its 1,024 budget)
        spec = fleet_instances(pd_fleet(_fleet_with_curve(curve), mode))[0]
        engine = SimEngine(spec.engine)
        assert engine.timer.compute_efficiency_curve == tuple((n, e) for n, e in curve)
        assert engine.timer.compute_efficiency_at(768) == pytest.approx(0.55)
    plain = SimEngine(fleet_instances(_fleet_with_curve(None))[0].engine)
    assert plain.timer.compute_efficiency_curve is None


def test_bad_fleet_file_curve_is_a_field_error() -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        _fleet_with_curve([[1024, 0.6], [512, 0.5]])
