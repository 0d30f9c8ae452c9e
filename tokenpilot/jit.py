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
Where the package folder is not writable, the cache goes to the temporary directory.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from numba import config, float64, njit

if not os.environ.get("NUMBA_CACHE_DIR") and not os.access(Path(__file__).parent, os.W_OK):
    # An install this user cannot write to (a container image run as another user): numba
    # would find no place for its cache and refuse to compile. A per-user folder in the
    # temporary directory instead (NUMBA_CACHE_DIR, set at image build, is better: it keeps the
    # compiled code across starts, see deploy/docker/Dockerfile).
    config.CACHE_DIR = os.path.join(tempfile.gettempdir(), f"tokenfleet-numba-{getattr(os, 'getuid', lambda: 0)()}")

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
