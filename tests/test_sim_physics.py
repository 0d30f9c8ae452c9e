"""Roofline step timer: calibration against Vidur profiles and sanity properties."""

from __future__ import annotations

import pytest

from fleetcore.hardware import GPUS, MODELS, gpu, model
from fleetcore.roofline import StepTimer

# (model, gpu, prefill tokens in one short-context step, published ms) — Vidur
# profiles, linear layers only, TP=1 (see /work/shared/notes/peers-and-engines.md).
STEP_POINTS = [
    ("llama-2-7b", "H100", 1, 5.6),
    ("llama-2-7b", "H100", 512, 12.0),
    ("llama-2-7b", "H100", 2048, 40.4),
    ("llama-3-8b", "A100-80GB", 1, 9.7),
    ("llama-3-8b", "A100-80GB", 512, 34.6),
    ("llama-3-8b", "A100-80GB", 2048, 143.7),
]
PLATEAU_POINTS = [
    ("llama-2-7b", "H100", 50_000.0),
    ("llama-3-8b", "A100-80GB", 15_000.0),
]


@pytest.mark.parametrize(("model_name", "gpu_name", "tokens", "published_ms"), STEP_POINTS,
                         ids=[f"{m}-{g}-{n}tok" for m, g, n, _ in STEP_POINTS])
def test_calibration_step_time_within_20pct(model_name: str, gpu_name: str, tokens: int, published_ms: float) -> None:
    ours_ms = StepTimer(model(model_name), gpu(gpu_name)).step_time([(tokens, 0)], []) * 1e3
    assert abs(ours_ms / published_ms - 1) <= 0.20, f"ours {ours_ms:.2f} ms vs published {published_ms} ms"


@pytest.mark.parametrize(("model_name", "gpu_name", "published"), PLATEAU_POINTS,
                         ids=[f"{m}-{g}-plateau" for m, g, _ in PLATEAU_POINTS])
def test_calibration_prefill_plateau_within_20pct(model_name: str, gpu_name: str, published: float) -> None:
    ours = StepTimer(model(model_name), gpu(gpu_name)).prefill_throughput_tokens_per_s()
    assert abs(ours / published - 1) <= 0.20, f"ours {ours:.0f} tok/s vs published {published:.0f}"


def test_large_prefill_approaches_plateau() -> None:
    t = StepTimer(model("llama-3.1-8b"), gpu("h100"))
    rate = 8192 / t.step_time([(8192, 0)], [])
    assert 0.8 * t.prefill_throughput_tokens_per_s() < rate < t.prefill_throughput_tokens_per_s()


def test_architecture_numbers() -> None:
    assert model("Llama-3.1-8B").total_params == pytest.approx(8.03e9, rel=0.01)
    assert model("llama-3.1-70b").total_params == pytest.approx(70.6e9, rel=0.01)
    assert model("qwen2.5-32b").total_params == pytest.approx(32.8e9, rel=0.02)
    assert model("llama-2-7b").total_params == pytest.approx(6.74e9, rel=0.01)
    # 32 layers * 8 kv heads * 128 * 2 (K,V) * 2 bytes
    assert model("llama-3.1-8b").kv_bytes_per_token == 131072
    assert model("meta-llama/Llama-3.1-8B") is MODELS["llama-3.1-8b"]
    assert gpu("h200") is GPUS["h200"]


def test_lookup_errors_list_known_names() -> None:
    with pytest.raises(ValueError, match="llama-3.1-8b"):
        model("gpt-5")
    with pytest.raises(ValueError, match="h100"):
        gpu("tpu-v5")


def test_monotonic_in_tokens_and_context() -> None:
    t = StepTimer(model("llama-3.1-8b"), gpu("h100"))
    by_tokens = [t.step_time([(n, 0)], []) for n in (1, 64, 256, 1024, 4096, 8192)]
    assert by_tokens == sorted(by_tokens) and by_tokens[0] < by_tokens[-1]
    by_ctx = [t.step_time([(512, p)], []) for p in (0, 1000, 8000, 32000, 100000)]
    assert by_ctx == sorted(by_ctx) and by_ctx[0] < by_ctx[-1]
    by_dec_ctx = [t.step_time([], [c] * 64) for c in (100, 1000, 8000, 32000)]
    assert by_dec_ctx == sorted(by_dec_ctx) and by_dec_ctx[0] < by_dec_ctx[-1]


def test_decode_is_memory_bound() -> None:
    t = StepTimer(model("llama-3.1-8b"), gpu("h100"))
    # Doubling a short-context decode batch barely moves the step (weights dominate) ...
    small, double = t.step_time([], [128] * 16), t.step_time([], [128] * 32)
    assert double < 1.1 * small
    # ... while the KV read grows it with context: 64 x 32k tokens ~ 275 GB/s-seconds of KV.
    long_ctx = t.step_time([], [32000] * 64)
    kv_bytes = 64 * 32000 * model("llama-3.1-8b").kv_bytes_per_token
    assert long_ctx > small + kv_bytes / gpu("h100").mem_bw_bytes_s
    # A decode batch's time is far above its compute time.
    flops = 2 * model("llama-3.1-8b").non_embedding_params * 32
    assert small > 5 * flops / gpu("h100").peak_flops


def test_step_time_matches_totals_and_empty_is_zero() -> None:
    t = StepTimer(model("llama-3.1-8b"), gpu("h200"))
    assert t.step_time([], []) == 0.0
    a = t.step_time([(100, 50)], [10, 20])
    pairs = 100 * 50 + 100 * 101 // 2 + 11 + 21
    assert a == pytest.approx(t.step_time_totals(102, 3, pairs, 80))


def test_tensor_parallel_faster_and_70b_fit() -> None:
    m, g = model("llama-3.1-70b"), gpu("h100")
    tp1, tp4 = StepTimer(m, g, tp=1), StepTimer(m, g, tp=4)
    for prefill, decode in (([], [2000] * 32), ([(2048, 0)], []), ([(1, 0)], [])):
        assert tp4.step_time(prefill, decode) < tp1.step_time(prefill, decode)
    with pytest.raises(ValueError, match="does not fit"):
        tp1.kv_capacity_tokens()
    cap = tp4.kv_capacity_tokens()
    assert 300_000 < cap < 700_000
    # TP=4 is not 4x faster on a decode step: all-reduces and overhead stay.
    assert tp4.step_time([], [2000] * 32) > tp1.step_time([], [2000] * 32) / 4


def test_kv_capacity_8b_h100_near_vllm() -> None:
    # vLLM reports ~450k KV tokens for Llama-3.1-8B on one H100 at utilization 0.9.
    cap = StepTimer(model("llama-3.1-8b"), gpu("h100")).kv_capacity_tokens(0.9)
    assert 400_000 < cap < 500_000
    with pytest.raises(ValueError):
        StepTimer(model("llama-3.1-8b"), gpu("h100")).kv_capacity_tokens(0.0)


def test_all_table_combinations_are_finite() -> None:
    for m in MODELS.values():
        for g in GPUS.values():
            t = StepTimer(m, g, tp=8)
            assert 0 < t.step_time([(256, 1000)], [500] * 8) < 10
