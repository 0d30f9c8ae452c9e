"""A compute-efficiency curve (tokens per step -> fraction of the dense peak) from a Vidur profile.

    python bench/kernel_eff_curve.py MLP_CSV [--tp 2] [--peak-tflops 989] [--plateau-from 2048]

MLP_CSV: one of Microsoft Vidur's per-operation GPU profiles, e.g. (not in this repository; read
it from github.com/microsoft/vidur) `data/profiling/compute/h100/meta-llama/Llama-2-70b-hf/mlp.csv`.
Columns read: `num_tokens`, `num_tensor_parallel_workers`, the model shape (`n_head`,
`n_kv_head`, `n_embd`, `n_expanded_embd`, `use_gated_mlp`) and `time_stats.<op>.median` (ms) of
the four linear ops of a layer: `attn_pre_proj` (QKV), `attn_post_proj` (O), `mlp_up_proj`
(gate + up), `mlp_down_proj`.

Per row of the chosen TP: achieved fraction of the peak
    f(n) = FLOPs(n) / (sum of the four medians * peak),  FLOPs(n) = 2 * n * linear params / tp
(per GPU of the TP group). Plateau: the median of f over rows with n >= --plateau-from. The curve
is f normalised so the plateau equals the roofline's calibrated constant
(`fleetcore.roofline.DEFAULT_COMPUTE_EFFICIENCY`, 0.66), smoothed over an octave (the median of
the normalised f over rows with n in [n/sqrt(2), n*sqrt(2)]: real chunks come in every size, and a
single token count carries the GEMM tiling's steps, e.g. 384); also printed: the curve at the
exact token counts (the multiples of 256 are the sawtooth's peaks).

`mem-bound` says where the profiled row is within 25% of the same linear ops' weight read on the
profiled GPU at the roofline's memory efficiency (--mem-tbs, H100-SXM's 3.35 TB/s): there the
time is the weight read and f is only a lower bound of the kernels' compute efficiency, so the
curve printed for the fleet file starts at the first compute-bound point (held below it by the
roofline's clamp); `--all-points` prints the lower-bound curve from the smallest n too.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

from fleetcore.hardware import ModelSpec
from fleetcore.roofline import DEFAULT_COMPUTE_EFFICIENCY, DEFAULT_MEMORY_EFFICIENCY

LINEAR_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
POINTS = (16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096)


def linear_params(row: Mapping[str, str]) -> int:
    """Weights of the four linear ops of one layer (whole model, before the TP split): the
    roofline's own count (`ModelSpec.linear_params_per_layer`) for the profiled shape."""
    if row["use_gated_mlp"] != "True":
        raise SystemExit("only gated-MLP profiles (Llama family) are read here")
    h, nh = int(row["n_embd"]), int(row["n_head"])
    shape = ModelSpec("profiled", num_layers=1, hidden_size=h, num_heads=nh, num_kv_heads=int(row["n_kv_head"]),
                      head_dim=h // nh, intermediate_size=int(row["n_expanded_embd"]),
                      vocab_size=int(row["vocab_size"]), max_model_len=1)
    return shape.linear_params_per_layer


def fractions(rows: Sequence[Mapping[str, str]], tp: int, peak_flops: float) -> dict[int, float]:
    """Achieved fraction of the peak per token count (duplicate rows of one count: their median)."""
    per_n: dict[int, list[float]] = {}
    for r in rows:
        if int(r["num_tensor_parallel_workers"]) != tp:
            continue
        n = int(r["num_tokens"])
        t_s = sum(float(r[f"time_stats.{op}.median"]) for op in LINEAR_OPS) * 1e-3
        per_n.setdefault(n, []).append(2.0 * n * linear_params(r) / tp / (t_s * peak_flops))
    return {n: statistics.median(v) for n, v in sorted(per_n.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", type=Path)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="the profiled GPU's dense bf16 peak")
    ap.add_argument("--mem-tbs", type=float, default=3.35, help="the profiled GPU's memory bandwidth")
    ap.add_argument("--plateau-from", type=int, default=2048)
    ap.add_argument("--all-points", action="store_true", help="the fleet-file curve from the smallest n")
    a = ap.parse_args()
    data = a.csv.read_bytes()
    rows = list(csv.DictReader(data.decode().splitlines()))
    f = fractions(rows, a.tp, a.peak_tflops * 1e12)
    if not f:
        raise SystemExit(f"no rows with num_tensor_parallel_workers == {a.tp}")
    plateau = statistics.median(v for n, v in f.items() if n >= a.plateau_from)
    scale = DEFAULT_COMPUTE_EFFICIENCY / plateau
    params = linear_params(rows[0])
    print(f"sha256 {hashlib.sha256(data).hexdigest()}  rows {len(rows)}  TP{a.tp} token counts {len(f)}")
    print(f"plateau (median f, n >= {a.plateau_from}): {plateau:.3f}; scale to "
          f"{DEFAULT_COMPUTE_EFFICIENCY}: x{scale:.3f}")
    print("| tokens | linear ops ms (sum of medians) | f raw | f normalised | octave median, normalised | "
          "time / weight read |")
    print("|---:|---:|---:|---:|---:|---:|")
    curve: list[tuple[int, float]] = []
    exact: list[tuple[int, float]] = []
    first_compute_bound: int | None = None
    for n in POINTS:
        if n not in f:
            continue
        t_ms = 2.0 * n * params / a.tp / (f[n] * a.peak_tflops * 1e12) * 1e3
        mem_ms = params * 2 / a.tp / (a.mem_tbs * 1e12 * DEFAULT_MEMORY_EFFICIENCY) * 1e3
        window = [v for m, v in f.items() if n / math.sqrt(2) <= m <= n * math.sqrt(2)]
        smooth = statistics.median(window) * scale
        bound = t_ms / mem_ms
        if bound >= 1.25 and first_compute_bound is None:
            first_compute_bound = n
        curve.append((n, smooth))
        exact.append((n, f[n] * scale))
        print(f"| {n:,} | {t_ms:.4f} | {f[n]:.3f} | {f[n] * scale:.3f} | {smooth:.3f} | "
              f"{bound:.2f}{' (mem-bound)' if bound < 1.25 else ''} |")
    start = curve[0][0] if a.all_points or first_compute_bound is None else first_compute_bound
    for name, pts in (("octave medians", curve), ("exact token counts", exact)):
        line = ", ".join(f"[{n}, {e:.3f}]" for n, e in pts if n >= start)
        print(f"\n# {name}\ncompute_efficiency_curve: [{line}]")


if __name__ == "__main__":
    main()
