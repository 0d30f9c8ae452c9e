"""When the gateway gives up on an engine before its first byte: the rules the relay and the
simulator share (`gateway/relay.py`, `gateway/deadlines.py`; `fleetsim/failures.py`).

Before the first byte reached the client a failed attempt is retried elsewhere; after it,
`fleetcore.continuation` decides. The first-byte deadline scales with the predicted TTFT
but never drops below a generous floor: a prediction is a guess, and a wrong timeout kills
a request that would have been served.
"""

from __future__ import annotations

ATTEMPTS_BEFORE_FIRST_BYTE = 2  # the first try plus one retry elsewhere


def first_byte_deadline_s(floor_s: float, factor: float, predicted_ttft_s: float | None) -> float:
    """Seconds from dispatch the gateway waits for an engine's first byte."""
    return max(floor_s, factor * (predicted_ttft_s or 0.0))
