"""Hardware and model tables of the roofline (`fleetcore.roofline`): GPUs and models.

Shared vocabulary, not an engine: the simulated engine times its steps with it, and the
policies (TokenPilot's priors, FleetMind's demand model) size work with the same numbers.

Pure data: no I/O. Numbers are datasheet values (GPUs) and the published
Hugging Face ``config.json`` values (models); `fleetcore.roofline` turns them
into step times with efficiency factors calibrated once for all GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One accelerator.

    ``peak_tflops_bf16``: dense bf16 tensor-core peak (no sparsity).
    ``mem_bw_tbs``: device memory bandwidth, TB/s (1e12 bytes/s).
    ``mem_gib``: device memory, GiB.
    ``nvlink_gbs``: per-GPU *unidirectional* interconnect bandwidth in GB/s
    (1e9 bytes/s) that a ring all-reduce can use; PCIe for cards without NVLink.
    """

    name: str
    peak_tflops_bf16: float
    mem_bw_tbs: float
    mem_gib: float
    nvlink_gbs: float

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops_bf16 * 1e12

    @property
    def mem_bw_bytes_s(self) -> float:
        return self.mem_bw_tbs * 1e12

    @property
    def mem_bytes(self) -> float:
        return self.mem_gib * GIB


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A dense decoder-only transformer (Llama/Qwen family: GQA + gated MLP)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    dtype_bytes: int = 2

    @property
    def linear_params_per_layer(self) -> int:
        """q/o projections (h x heads*d), k/v with GQA (h x kv_heads*d), gated MLP (3*h*i)."""
        h = self.hidden_size
        q_o = 2 * h * self.num_heads * self.head_dim
        k_v = 2 * h * self.num_kv_heads * self.head_dim
        mlp = 3 * h * self.intermediate_size
        return q_o + k_v + mlp

    @property
    def non_embedding_params(self) -> int:
        # Norm weights and biases are < 0.01% of the total: left out.
        return self.linear_params_per_layer * self.num_layers

    @property
    def embedding_params(self) -> int:
        """Input embedding + untied lm_head (none of the tabled models tie them)."""
        return 2 * self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        return self.non_embedding_params + self.embedding_params

    @property
    def weight_bytes(self) -> int:
        return self.total_params * self.dtype_bytes

    @property
    def lm_head_bytes(self) -> int:
        return self.vocab_size * self.hidden_size * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer: 2 * layers * kv_heads * head_dim * dtype_bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


# H200: datasheet peaks (989 TFLOP/s, 4.8 TB/s) rather than the ~790 TFLOP/s and
# ~4.3 TB/s measured on this workplace's H200. The efficiency factors in
# roofline.py were fitted against *datasheet* peaks of H100 and A100, so they
# already absorb the datasheet-to-achieved gap; feeding them measured peaks
# would count that gap twice. Memory: nvidia-smi shows ~140 GiB of the
# marketed 141 GB; 141 is kept as the table value (the 10% utilization headroom
# dwarfs the difference).
GPUS: dict[str, GpuSpec] = {
    g.name.lower(): g
    for g in (
        GpuSpec("H100-SXM", peak_tflops_bf16=989.0, mem_bw_tbs=3.35, mem_gib=80.0, nvlink_gbs=450.0),
        GpuSpec("H200", peak_tflops_bf16=989.0, mem_bw_tbs=4.8, mem_gib=141.0, nvlink_gbs=450.0),
        GpuSpec("A100-80GB", peak_tflops_bf16=312.0, mem_bw_tbs=2.0, mem_gib=80.0, nvlink_gbs=300.0),
        # L40S has no NVLink: TP all-reduce goes over PCIe Gen4 x16 (~32 GB/s each way).
        GpuSpec("L40S", peak_tflops_bf16=362.0, mem_bw_tbs=0.864, mem_gib=48.0, nvlink_gbs=32.0),
    )
}
# Common spellings.
GPUS["h100"] = GPUS["h100-sxm"]
GPUS["a100"] = GPUS["a100-80gb"]

MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256, 131072),
        ModelSpec("llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256, 131072),
        ModelSpec("qwen2.5-32b", 64, 5120, 40, 8, 128, 27648, 152064, 32768),
        # Calibration models (Vidur profile points).
        ModelSpec("llama-2-7b", 32, 4096, 32, 32, 128, 11008, 32000, 4096),
        ModelSpec("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256, 8192),
    )
}


def _lookup(table: dict, kind: str, name: str):
    key = name.strip().lower()
    # Accept hub-style names such as "meta-llama/Llama-3.1-8B".
    if key not in table and "/" in key:
        key = key.rsplit("/", 1)[1]
    try:
        return table[key]
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(sorted(table))}") from None


def gpu(name: str) -> GpuSpec:
    """Case-insensitive GPU lookup; ValueError lists known names."""
    return _lookup(GPUS, "GPU", name)


def model(name: str) -> ModelSpec:
    """Case-insensitive model lookup; ValueError lists known names."""
    return _lookup(MODELS, "model", name)
