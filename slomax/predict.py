"""Online estimates SLOMax keeps (service times, prefix hit rates, engine speeds).

An exponentially weighted mean is all it needs: the figures drift with the load and the
mix, so recent samples should count most. No clock is read here.
"""

from __future__ import annotations


class Ewma:
    __slots__ = ("alpha", "n", "value")

    def __init__(self, alpha: float = 0.1) -> None:
        self.alpha = alpha
        self.value: float | None = None
        self.n = 0

    def add(self, x: float) -> None:
        self.n += 1
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)
