"""Compiled scalar arithmetic (numba) for the decision path, and numpy's rules for it.

TokenPilot's scoring runs per candidate in compiled loops (`tokenpilot.score_kernel`) whose
results must be bit-for-bit those of the numpy expressions they replaced. IEEE-754 `+ - * /`
round the same in any unit; numba compiles without fast-math, so LLVM neither reassociates
nor fuses a multiply and an add. What is not plain arithmetic follows numpy's rules here:
`np.maximum` / `np.minimum` propagate NaN (`fmax`, `fmin`), and a division by zero gives
inf or NaN instead of raising (`error_model="numpy"`).

`JIT`: the options of every compiled function. `cache=True` keeps the machine code beside the
source (`__pycache__`): the first import after an install compiles (a few seconds, once),
later processes load it. Explicit signatures compile at import, never inside a decision.
"""

from __future__ import annotations

from numba import float64, njit

JIT = {"cache": True, "error_model": "numpy", "nogil": True}
INLINE = {**JIT, "inline": "always"}


@njit(float64(float64, float64), **INLINE)
def fmax(a: float, b: float) -> float:
    """np.maximum of two floats (NaN propagates)."""
    return a if (a >= b or a != a) else b


@njit(float64(float64, float64), **INLINE)
def fmin(a: float, b: float) -> float:
    """np.minimum of two floats (NaN propagates)."""
    return a if (a <= b or a != a) else b
