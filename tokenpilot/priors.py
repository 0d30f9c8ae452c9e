"""What TokenPilot believes about an instance before it has seen a single request.

Starting values come from the same roofline the simulated engine uses (a model on
a GPU at a tensor-parallel degree); online learning (`tokenpilot.learning`)
corrects them from observed timings, so a wrong prior costs only a few requests.
"""

from __future__ import annotations

from fleetcore import hardware
from fleetcore.policies import EnginePrior  # plain data: the router contract registers instances with it
from fleetcore.roofline import StepTimer

__all__ = ["EnginePrior", "prior_from_physics"]


def prior_from_physics(spec: str, gpu: str, tp: int = 1, block_size: int = 16,
                       max_batched_tokens: int = 8192, gpu_memory_utilization: float = 0.9) -> EnginePrior:
    """Prior for an engine whose model and GPU are in the roofline's tables (`fleetcore.hardware`)."""
    timer = StepTimer(hardware.model(spec), hardware.gpu(gpu), tp=tp)
    full = timer.step_time([(max_batched_tokens, 0)], [])
    one = timer.step_time([], [1])
    ctx = 8192
    kv = (timer.step_time([], [1 + ctx]) - one) / ctx
    far = 65536
    attn = (timer.step_time([(max_batched_tokens, far)], []) - full) / (max_batched_tokens * far)
    return EnginePrior(
        prefill_token_s=max(full - one, 1e-9) / max_batched_tokens,
        attn_s_per_token_ctx=max(attn, 0.0),
        kv_read_s_per_token=max(kv, 0.0),
        step_overhead_s=one,
        capacity_blocks=max(1, timer.kv_capacity_tokens(gpu_memory_utilization) // block_size),
        block_size=block_size,
        max_batched_tokens=max_batched_tokens,
    )
