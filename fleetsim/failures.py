"""Engine failures in virtual time: what fails when, how the gateway notices, and the tally.

`tokenfleet simulate --fail-rate R --stall-rate R` gives every simulated instance two
independent Poisson processes (per instance-hour of up time): **deaths** (the engine
process is gone: KV cache and in-flight requests lost; it serves again after a restart)
and **stalls** (the process stops producing anything for `stall_s`, as under SIGSTOP, and
then resumes with its state). The draws are seeded per (seed, instance, kind), so a run
is reproducible and one instance's failures do not depend on another's.

How the gateway notices, as the live relay does (`gateway/relay.py`, `gateway/deadlines.py`):

* death: the connection resets; each in-flight request hears it half a round trip after
  the death, and a request sent to a dead engine hears it when it arrives. The instance
  is unready at once (a refused connection takes it out).
* stall: nothing arrives. A request that has had a token gives up `stream_idle_timeout_s`
  after its last one; one that has not, at its first-byte deadline
  (`max(first_byte_timeout_floor_s, first_byte_timeout_factor x predicted TTFT)` from its
  dispatch). The instance is unready at the first such give-up or when health checks have
  missed `health_misses_to_unready` times, whichever is first, and ready again when the
  stall ends.

What follows a failure is decided elsewhere: before the first token the request is retried
on another instance (one retry, as the relay's `MAX_ATTEMPTS`), after it the rule set of
`fleetcore.continuation` says whether it is continued (and the simulator places the
continuation with `fleetmind.place`, like any attempt).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import xxhash

from fleetcore.continuation import ContinuationLimits, ContinuationReason
from fleetcore.fleet_config import GatewaySettings
from fleetcore.first_byte import first_byte_deadline_s as first_byte_deadline
from fleetcore.prefix import ROOT_HASH, synthetic_block_hashes

DEFAULT_STALL_S = 120.0  # long enough that the idle deadline (30 s by default) notices it

FaultKind = Literal["death", "stall"]


@dataclass(frozen=True, slots=True)
class FailureModel:
    """What `simulate --fail-rate/--stall-rate` asks for. Rates are per instance-hour."""

    fail_rate_per_h: float = 0.0
    stall_rate_per_h: float = 0.0
    stall_s: float = DEFAULT_STALL_S
    restart_s: float | None = None  # None: the deployment's `startup_s` (fleetsim.planning.startup_s)
    seed: int = 0
    limits: ContinuationLimits = field(default_factory=ContinuationLimits)  # enabled=False: --no-continuation

    def __post_init__(self) -> None:
        if self.fail_rate_per_h < 0 or self.stall_rate_per_h < 0:
            raise ValueError("failure rates must be >= 0")
        if not self.stall_s > 0:
            raise ValueError("stall_s must be positive")
        if self.restart_s is not None and self.restart_s < 0:
            raise ValueError("restart_s must be >= 0")

    @property
    def active(self) -> bool:
        return self.fail_rate_per_h > 0 or self.stall_rate_per_h > 0


class FaultClock:
    """Seeded exponential waits between one instance's failures of one kind."""

    def __init__(self, model: FailureModel) -> None:
        self._model = model
        self._rngs: dict[tuple[str, FaultKind], random.Random] = {}

    def next_after(self, instance_id: str, kind: FaultKind, t: float) -> float | None:
        """When `instance_id` next fails this way, counting up time from `t`; None: never."""
        rate_h = self._model.fail_rate_per_h if kind == "death" else self._model.stall_rate_per_h
        if rate_h <= 0:
            return None
        rng = self._rngs.get((instance_id, kind))
        if rng is None:  # str seeds are hashed with sha512: stable across runs and machines
            rng = self._rngs[(instance_id, kind)] = random.Random(f"{self._model.seed}/{instance_id}/{kind}")
        return t + rng.expovariate(rate_h / 3600.0)


def health_detect_s(g: GatewaySettings) -> float:
    """How long health checks take to call a silent engine unready: each missed check is one
    timeout (or one interval, if longer), and it takes `health_misses_to_unready` of them."""
    return g.health_misses_to_unready * max(g.health_interval_s, g.health_timeout_s)


def first_byte_deadline_s(g: GatewaySettings, predicted_ttft_s: float | None) -> float:
    """The relay's first-byte deadline, from the fleet file's `gateway:` block."""
    return first_byte_deadline(g.first_byte_timeout_floor_s, g.first_byte_timeout_factor, predicted_ttft_s)


def tail_block_hashes(request_id: str, prompt_hashes: tuple[int, ...], full_blocks: int) -> tuple[int, ...]:
    """Hashes of the blocks a continuation's prompt (prompt + generated tokens) has past the
    prompt's own hashed blocks, chained on from the prompt's last block hash.

    The simulator has no token ids, so the generated text of a request is named by its id:
    the same request's tail always hashes the same, a longer tail extends a shorter one, and
    no two requests share a tail (a sampled continuation is the request's own).
    """
    n = full_blocks - len(prompt_hashes)
    if n <= 0:
        return ()
    tail_id = xxhash.xxh64_intdigest(f"generated:{request_id}".encode())
    parent = prompt_hashes[-1] if prompt_hashes else ROOT_HASH
    return tuple(synthetic_block_hashes([tail_id], n, parent=parent))


@dataclass
class FailureStats:
    """The tally of one run: the `failures` block of its result row."""

    deaths: int = 0
    stalls: int = 0
    retries: int = 0  # attempts before the first token, sent again elsewhere
    continuations: Counter[str] = field(default_factory=Counter)  # by ContinuationReason
    refused: Counter[str] = field(default_factory=Counter)  # by fleetcore.continuation.refusal label
    failed: Counter[str] = field(default_factory=Counter)  # requests ended with an error, by why
    continued_requests: set[str] = field(default_factory=set)
    reprefill_tokens: int = 0  # prompt + tail tokens the continuations computed again
    reprefill_cached_tokens: int = 0  # of their prompts, found in the new instance's prefix cache
    lost_s: list[float] = field(default_factory=list)  # per continuation: failure -> next token at the client

    def continued(self, request_id: str, reason: ContinuationReason) -> None:
        self.continuations[reason] += 1
        self.continued_requests.add(request_id)

    def as_dict(self) -> dict[str, Any]:
        lost = np.asarray(self.lost_s, dtype=float) * 1e3
        pct = ({"p50": float(np.percentile(lost, 50)), "p95": float(np.percentile(lost, 95)),
                "mean": float(lost.mean())} if lost.size else {"p50": None, "p95": None, "mean": None})
        return {
            "deaths": self.deaths, "stalls": self.stalls, "retries_before_first_token": self.retries,
            "continuations": dict(sorted(self.continuations.items())),
            "continued_requests": len(self.continued_requests),
            "continuation_refused": dict(sorted(self.refused.items())),
            "failed_requests": sum(self.failed.values()), "failed_by_reason": dict(sorted(self.failed.items())),
            "reprefill_tokens": self.reprefill_tokens, "reprefill_cached_tokens": self.reprefill_cached_tokens,
            "time_lost_per_continuation_ms": pct,
        }


__all__ = ["DEFAULT_STALL_S", "FailureModel", "FailureStats", "FaultClock",
           "first_byte_deadline_s", "health_detect_s", "tail_block_hashes"]
