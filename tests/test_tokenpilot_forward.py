"""The scheduler-forward TTFT (tokenpilot/forward.py): its step time against the engine's roofline,
its arithmetic of queued chunks, and, in the simulator, predictions closer to what requests got than
the cost model's own queue + prefill seconds; a request held by admission teaches no slow GPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fleetcore import hardware
from fleetcore.fleet_config import load_fleet_file
from fleetcore.roofline import StepTimer
from fleetcore.types import InstanceSnapshot, RequestOutcome, RequestProfile
from tokenpilot.forward import forward_ttft, step_s
from tokenpilot.priors import prior_from_physics
from tokenpilot.router import TokenPilot, TokenPilotConfig

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("spec,gpu,tp,budget", [("llama-3.1-8b", "H100", 1, 2048), ("llama-3.1-70b", "H200", 2, 8192)])
def test_step_time_follows_the_roofline_on_mixed_batches(spec: str, gpu: str, tp: int, budget: int) -> None:
    prior = prior_from_physics(spec, gpu, tp, max_batched_tokens=budget)
    timer = StepTimer(hardware.model(spec), hardware.gpu(gpu), tp)
    worst = 0.0
    for decodes, ctx_each in ((0, 0), (16, 2000), (64, 2000), (128, 4000)):
        for prefill in (0, 64, budget // 8, budget // 2, budget - decodes):
            if prefill + decodes == 0 or prefill < 0:
                continue
            real = timer.step_time([(prefill, 0)] if prefill else [], [ctx_each] * decodes)
            ours = step_s(prefill + decodes, decodes * ctx_each, prior.prefill_token_s, prior.kv_read_s_per_token,
                          prior.step_overhead_s, budget)
            worst = max(worst, abs(ours - real) / real)
    # (the cost model's sum of compute and memory ran 20-50% high on such steps)
    assert worst < 0.12, worst


def test_queued_chunks_add_full_steps() -> None:
    token_s, overhead, budget = 1e-5, 5e-3, 2048.0
    full = step_s(budget, 0.0, token_s, 0.0, overhead, budget)

    def ttft(ahead: float, uncached: float, decoding: float = 0.0) -> float:
        return forward_ttft(ahead, uncached, 0.0, decoding, 0.0, budget, token_s, 0.0, 0.0, overhead)

    assert ttft(0, 2048) == pytest.approx(full)  # idle: its own full chunk, nothing under way
    assert ttft(0, 100) == pytest.approx(step_s(100.0, 0.0, token_s, 0.0, overhead, budget))
    # Three chunks queued ahead: half the step under way, then the rest of them, then its own.
    assert ttft(3 * 2048, 2048) == pytest.approx(0.5 * full + 3 * full + full)
    # Decoding streams take a token each of every step: the same prompt needs a second step for
    # its last 48 tokens (with the 48 decodes), after half the decode step under way.
    small = step_s(96.0, 0.0, token_s, 0.0, overhead, budget)
    assert ttft(0, 2048, decoding=48) == pytest.approx(0.5 * step_s(48.0, 0.0, token_s, 0.0, overhead, budget)
                                                       + full + small)


def test_in_the_simulator_it_predicts_better_than_the_cost_models_seconds() -> None:
    from fleetsim.simulator import FleetSimulator, HashCache, fleet_instances, prepare, spec_prior
    from workloads import head, load_trace, scale_rate

    fleet = load_fleet_file(REPO / "bench" / "fleet_slomax.yaml")  # 4 x 8B on H100, 2,048-token chunks
    wl = scale_rate(head(load_trace(REPO / "traces" / "AzureLLMInferenceTrace_conv.csv"), 1500), 12.0)
    rows: list[tuple[float, float, float]] = []
    pred: dict[str, tuple[float, float]] = {}

    class Recorder(TokenPilot):
        def route(self, profile, candidates, now):  # type: ignore[no-untyped-def]
            d = super().route(profile, candidates, now)
            c = next(c for c in d.candidates if c.name == d.instance_id)
            pred[profile.request_id] = (c.detail["prior_ttft_s"], c.detail["forward_ttft_s"])
            return d

        def observe(self, outcome: RequestOutcome) -> None:
            p = pred.pop(outcome.request_id, None)
            if p is not None and outcome.ok and outcome.ttft_s:
                rows.append((*p, outcome.ttft_s))
            super().observe(outcome)

    router = Recorder(seed=0)
    for spec in fleet_instances(fleet):
        router.register_instance(spec.instance_id, spec_prior(spec))
    FleetSimulator(fleet, router).run(prepare(wl.requests, fleet, hash_cache=HashCache()))
    r = np.array(rows)
    assert len(r) > 1000
    queued = r[:, 2] > 1.5 * np.median(r[:, 2])  # where the queue matters
    assert queued.sum() > 100

    def err(j: int, m: np.ndarray) -> float:
        return float(np.median(np.abs(r[m, j] - r[m, 2]) / r[m, 2]))

    everyone = np.ones(len(r), dtype=bool)
    # (measured at this commit: 11% vs 17% for all, 12% vs 15% where the queue matters)
    assert err(1, everyone) < 0.75 * err(0, everyone), (err(1, everyone), err(0, everyone))
    assert err(1, queued) < 0.85 * err(0, queued), (err(1, queued), err(0, queued))
    assert err(1, everyone) < 0.2


def test_time_held_before_dispatch_is_not_taken_for_a_slow_gpu() -> None:
    prior = prior_from_physics("llama-3.1-8b", "H100")
    tp = TokenPilot({"a": prior}, config=TokenPilotConfig(explore=0.0))
    a = InstanceSnapshot(instance_id="a", site="s", model="m", version="v", url="http://a")
    t = 1000.0
    for i in range(200):  # each held 5 s by admission, then served exactly as predicted
        p = RequestProfile(request_id=f"r{i}", model="m", prompt_tokens=1000, stream=True, arrival=t - 5.0,
                           block_hashes=tuple(range(i * 100, i * 100 + 62)))
        d = tp.route(p, [a], t)
        assert d.predicted_ttft_s is not None
        predicted = d.candidates[0].detail["prior_ttft_s"]
        tp.on_first_token(p.request_id, t + predicted)
        tp.observe(RequestOutcome(p.request_id, "a", "s", ok=True, prompt_tokens=1000, output_tokens=1,
                                  ttft_s=5.0 + predicted))
        t += 10.0
    assert tp.explain("a")["prefill_speed_factor"] == pytest.approx(1.0, abs=0.02)


def test_tokens_ahead_follow_dispatches_and_first_tokens() -> None:
    prior = prior_from_physics("llama-3.1-8b", "H100", max_batched_tokens=2048)
    tp = TokenPilot({"a": prior}, config=TokenPilotConfig(explore=0.0))
    a = InstanceSnapshot(instance_id="a", site="s", model="m", version="v", url="http://a")

    def send(i: int, now: float) -> float:
        p = RequestProfile(request_id=f"r{i}", model="m", prompt_tokens=4096, stream=True,
                           block_hashes=tuple(range(i * 1000, i * 1000 + 256)))
        d = tp.route(p, [a], now)
        return float(d.candidates[0].detail["ahead_tokens"])

    assert send(0, 0.0) == 0.0
    assert send(1, 0.0) == pytest.approx(4096)  # r0 is ahead, none of it done at the same instant
    assert send(2, 0.0) == pytest.approx(8192)
    # r0 and r1 through (their first tokens): only r2 is ahead, less what the clock says is done,
    # but no less than r2 minus one chunk (a step may already have carried part of it)
    tp.on_first_token("r0", 0.1)
    tp.on_first_token("r1", 0.2)
    ahead = send(3, 0.2)
    assert 4096 - 2048 - 1e-6 <= ahead <= 4096 + 1e-6
    # much later, with no first token seen, the clock drains what is left of r2 but not r3's
    # share below the bound: r2 and r3 are outstanding, so at least r3 - a chunk remains
    assert send(4, 60.0) >= 4096 - 2048 - 1e-6
