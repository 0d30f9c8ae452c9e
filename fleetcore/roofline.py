"""Roofline step timer: how long one engine forward step takes.

A step runs a batch of sequences; each contributes ``n`` new tokens on top of
``p`` tokens already in its KV cache (a decode is n=1). The step costs

    time = max(FLOPs / (peak * compute_eff), bytes / (bw * memory_eff))
           + step_overhead + TP all-reduce cost

FLOPs: linear layers (2 * params * tokens), attention (QK^T and PV against the
context, causal inside the chunk), and lm_head for every sequence in the batch
(vLLM V1 computes logits at each scheduled request's last token, also for
partial prefills, and discards those). Bytes: every weight read once per step,
every sequence's cached KV read, the new tokens' KV written.

Calibration (one set for all GPUs). Fitted to Vidur's profiles (linear layers
only, TP=1): Llama-2-7B on H100 and Llama-3-8B on A100. Both GPUs fit the same
factors within ~10%, which is why they are kept global: they describe how far
the kernels (cuBLAS GEMMs, FlashAttention, memory-bound GEMV) get from the
datasheet peak, not a particular card. compute_eff=0.66 reproduces the
prefill plateaus (50k tok/s H100, 15k tok/s A100 => 0.655 and 0.671 of peak);
memory_eff=0.8 plus 0.5 ms of per-step overhead (launches, sampling, scheduler)
reproduces the 1-token steps (5.6 ms, 9.7 ms). Peaks are datasheet values, see
hardware.py. Attention, KV traffic and lm_head are not in Vidur's linear-only
numbers; at the calibration points they add <5%.

Optional small-step efficiency (off by default): `compute_efficiency_curve`, points
(tokens per step, compute efficiency) interpolated linearly in tokens and held flat outside
them, replaces the constant in the compute term of a step by the efficiency at that step's
new-token count (prefill chunks and decodes together: the GEMMs' M dimension). Real GEMMs reach
a lower fraction of the peak at small M; bench/kernel_eff_curve.py derives a curve from a Vidur
profile (bench/DISAGG.md "Small-chunk kernel efficiency"). Without it every step time is the
constant's, bit for bit.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

from fleetcore.hardware import GpuSpec, ModelSpec

DEFAULT_COMPUTE_EFFICIENCY = 0.66
DEFAULT_MEMORY_EFFICIENCY = 0.80
DEFAULT_STEP_OVERHEAD_S = 0.5e-3
# Per all-reduce fixed cost (NCCL / custom all-reduce launch + sync on NVLink).
DEFAULT_TP_ALLREDUCE_LATENCY_S = 8e-6
# Per-GPU memory held back from the KV cache: activations at the batch-token
# budget, CUDA graphs, NCCL buffers, allocator slack.
DEFAULT_ACTIVATION_RESERVE_GIB = 1.5


class StepTimer:
    """Step time of one model on one TP group; cheap to call (constants precomputed)."""

    __slots__ = (
        "model", "gpu", "tp", "compute_efficiency", "memory_efficiency",
        "step_overhead_s", "tp_allreduce_latency_s", "activation_reserve_gib",
        "_inv_flops_rate", "_inv_bytes_rate", "_linear_flops_per_tok",
        "_attn_flops_per_pair", "_lm_head_flops_per_seq", "_weight_bytes",
        "_kv_bytes_per_tok", "_comm_fixed_s", "_comm_s_per_tok", "compute_efficiency_curve",
        "_inv_peak", "_curve_tokens", "_curve_eff",
    )

    def __init__(
        self,
        model: ModelSpec,
        gpu: GpuSpec,
        tp: int = 1,
        compute_efficiency: float = DEFAULT_COMPUTE_EFFICIENCY,
        memory_efficiency: float = DEFAULT_MEMORY_EFFICIENCY,
        step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S,
        tp_allreduce_latency_s: float = DEFAULT_TP_ALLREDUCE_LATENCY_S,
        activation_reserve_gib: float = DEFAULT_ACTIVATION_RESERVE_GIB,
        compute_efficiency_curve: Sequence[tuple[int, float]] | None = None,
    ) -> None:
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        if not (0 < compute_efficiency <= 1 and 0 < memory_efficiency <= 1):
            raise ValueError("efficiencies must be in (0, 1]")
        self.model = model
        self.gpu = gpu
        self.tp = tp
        self.compute_efficiency = compute_efficiency
        self.memory_efficiency = memory_efficiency
        self.step_overhead_s = step_overhead_s
        self.tp_allreduce_latency_s = tp_allreduce_latency_s
        self.activation_reserve_gib = activation_reserve_gib
        curve = validate_efficiency_curve(compute_efficiency_curve)
        self.compute_efficiency_curve = curve
        self._curve_tokens = tuple(n for n, _ in curve) if curve else ()
        self._curve_eff = tuple(e for _, e in curve) if curve else ()
        self._inv_peak = 1.0 / gpu.peak_flops

        # Everything below is per GPU of the TP group: work is split tp ways.
        # KV heads cannot be split finer than one head per GPU (vLLM replicates).
        kv_shards = min(tp, model.num_kv_heads)
        self._inv_flops_rate = 1.0 / (gpu.peak_flops * compute_efficiency)
        self._inv_bytes_rate = 1.0 / (gpu.mem_bw_bytes_s * memory_efficiency)
        self._linear_flops_per_tok = 2.0 * model.non_embedding_params / tp
        # One (query token, key token) pair: QK^T and PV, 2 FLOPs per MAC each.
        self._attn_flops_per_pair = 4.0 * model.num_heads * model.head_dim * model.num_layers / tp
        self._lm_head_flops_per_seq = 2.0 * model.hidden_size * model.vocab_size / tp
        # Input embedding is a gather (a few rows), so only lm_head + linears are read.
        self._weight_bytes = (model.non_embedding_params * model.dtype_bytes + model.lm_head_bytes) / tp
        self._kv_bytes_per_tok = model.kv_bytes_per_token / kv_shards
        if tp > 1:
            # Two all-reduces per layer (after attention, after MLP) of
            # tokens*hidden activations; a ring moves 2*(tp-1)/tp of it per GPU.
            n_ar = 2 * model.num_layers
            self._comm_fixed_s = n_ar * tp_allreduce_latency_s
            ring = 2.0 * (tp - 1) / tp
            self._comm_s_per_tok = n_ar * ring * model.hidden_size * model.dtype_bytes / (gpu.nvlink_gbs * 1e9)
        else:
            self._comm_fixed_s = 0.0
            self._comm_s_per_tok = 0.0

    # -- hot path ---------------------------------------------------------

    def step_time_totals(self, num_tokens: int, num_seqs: int, attn_pairs: int, ctx_tokens: int) -> float:
        """Step time from batch totals (the engine keeps these as it schedules).

        num_tokens: new tokens computed in the step; num_seqs: sequences in the
        batch; attn_pairs: sum over new tokens of the keys each attends to;
        ctx_tokens: tokens already in KV that the batch reads.
        """
        if num_tokens <= 0:
            return 0.0
        flops = (
            self._linear_flops_per_tok * num_tokens
            + self._attn_flops_per_pair * attn_pairs
            + self._lm_head_flops_per_seq * num_seqs
        )
        nbytes = self._weight_bytes + self._kv_bytes_per_tok * (ctx_tokens + num_tokens)
        tc = flops * self._inv_flops_rate if not self._curve_tokens else (
            flops * self._inv_peak / self.compute_efficiency_at(num_tokens))
        tm = nbytes * self._inv_bytes_rate
        return (tc if tc > tm else tm) + self.step_overhead_s + self._comm_fixed_s + self._comm_s_per_tok * num_tokens

    def step_time(self, prefill: Sequence[tuple[int, int]], decode_context_lens: Sequence[int]) -> float:
        """Seconds for one step.

        prefill: (new_tokens, tokens_already_in_context) per prefill chunk.
        decode_context_lens: context length (tokens in KV) per decoding sequence;
        each decode adds one token that attends to its context and itself.
        """
        n_dec = len(decode_context_lens)
        dec_ctx = sum(decode_context_lens)
        tokens = n_dec
        ctx = dec_ctx
        pairs = dec_ctx + n_dec
        for n, p in prefill:
            tokens += n
            ctx += p
            # Token i of the chunk (1-based) attends to p + i keys (causal).
            pairs += n * p + (n * (n + 1) >> 1)
        return self.step_time_totals(tokens, n_dec + len(prefill), pairs, ctx)

    def compute_efficiency_at(self, num_tokens: int) -> float:
        """Fraction of the peak the compute term runs at for a step of `num_tokens` new tokens."""
        xs = self._curve_tokens
        if not xs:
            return self.compute_efficiency
        i = bisect_right(xs, num_tokens)
        if i == 0:
            return self._curve_eff[0]
        if i == len(xs):
            return self._curve_eff[-1]
        x0, x1 = xs[i - 1], xs[i]
        e0, e1 = self._curve_eff[i - 1], self._curve_eff[i]
        return e0 + (e1 - e0) * (num_tokens - x0) / (x1 - x0)

    # -- derived figures --------------------------------------------------

    def prefill_throughput_tokens_per_s(self) -> float:
        """Plateau of prefill throughput for short contexts (linear layers bound; with a curve, at
        its largest point)."""
        inv_rate = self._inv_flops_rate if not self._curve_eff else self._inv_peak / self._curve_eff[-1]
        return 1.0 / (self._linear_flops_per_tok * inv_rate + self._comm_s_per_tok)

    def kv_capacity_tokens(self, gpu_memory_utilization: float = 0.9) -> int:
        """KV tokens that fit in the TP group after weights and an activation reserve."""
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        per_gpu_budget = self.gpu.mem_bytes * gpu_memory_utilization
        reserve = self.activation_reserve_gib * (1 << 30)
        free = per_gpu_budget - self._weight_bytes_total_per_gpu() - reserve
        if free <= 0:
            need_gib = (self.model.weight_bytes / self.tp + reserve) / (1 << 30)
            raise ValueError(
                f"model {self.model.name} does not fit on {self.tp} x {self.gpu.name}: needs "
                f"~{need_gib:.1f} GiB per GPU for weights + reserve, "
                f"{per_gpu_budget / (1 << 30):.1f} GiB usable at utilization {gpu_memory_utilization}; "
                f"raise tp"
            )
        return int(free // self._kv_bytes_per_tok)

    def _weight_bytes_total_per_gpu(self) -> float:
        # Memory holds all weights including the input embedding (sharded by vLLM).
        return self.model.weight_bytes / self.tp


def validate_efficiency_curve(
        curve: Sequence[tuple[int, float]] | Sequence[Sequence[float]] | None) -> tuple[tuple[int, float], ...] | None:
    """A compute-efficiency curve as (tokens, efficiency) pairs, or None (off); ValueError if bad.

    Tokens strictly increasing and >= 1, efficiencies in (0, 1]; an empty curve is refused
    (None is the way to say off).
    """
    if curve is None:
        return None
    pts: list[tuple[int, float]] = []
    for p in curve:
        if len(p) != 2:
            raise ValueError(f"compute_efficiency_curve point {list(p)!r}: want [tokens, efficiency]")
        n, e = p
        if int(n) != n or n < 1:
            raise ValueError(f"compute_efficiency_curve tokens must be integers >= 1, got {n!r}")
        if not 0 < e <= 1:
            raise ValueError(f"compute_efficiency_curve efficiency must be in (0, 1], got {e!r}")
        if pts and n <= pts[-1][0]:
            raise ValueError("compute_efficiency_curve tokens must be strictly increasing")
        pts.append((int(n), float(e)))
    if not pts:
        raise ValueError("compute_efficiency_curve needs at least one point (leave it unset for the constant)")
    return tuple(pts)
