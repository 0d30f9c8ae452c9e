"""Continuation of a stream whose engine died, stalled or was drained: the one rule set.

When an instance fails after the first token, the gateway (and the simulator) may
re-issue the request to another instance as *prompt + tokens generated so far*,
asking only for the remaining output budget, and splice the new stream into the
client's. This module decides whether a request may be continued and what the
continuation's profile is; it does no I/O. The live relay (`gateway/continuation.py`)
and the simulator (`fleetsim/simulator.py`) both call it, so "may this be
continued, and how is it routed" has one implementation.

Where the continuation runs is an ordinary routing decision: the continuation
profile carries the original prefix's block hashes followed by the generated
tail's, so an instance holding the prefix re-prefills only the tail.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from fleetcore.types import RequestProfile

# Why a stream needed continuing (the `reason` label of tokenfleet_continuations_total).
ContinuationReason = Literal["engine_died", "stalled", "drained"]
CONTINUATION_REASONS: tuple[ContinuationReason, ...] = ("engine_died", "stalled", "drained")


@dataclass(frozen=True, slots=True)
class ContinuationLimits:
    """Operator knobs (fleet file `gateway.continuation`)."""

    enabled: bool = True
    max_continuations: int = 2  # per request; the third failure ends the stream with an error event
    max_reprefill_tokens: int = 32768  # prompt + generated tail a continuation may re-prefill


@dataclass(frozen=True, slots=True)
class Faithfulness:
    """What of the request decides whether a continuation would equal an uninterrupted run.

    A continuation re-samples from prompt + generated tokens; that is the same
    distribution as the uninterrupted stream only when nothing else carries state:
    several choices (`n > 1`) would have to be re-synchronised, logprobs of the
    spliced prefix are lost, and constrained decoding (tools, JSON schema, regex,
    grammar) holds a parser state the engine cannot resume from text.
    """

    n: int = 1
    logprobs: bool = False
    constrained: bool = False  # tools / response_format json / guided_* requested
    echo: bool = False  # completions `echo`: the client would see the prompt twice


def refusal(f: Faithfulness, *, continuations_done: int, generated_tokens: int,
            prompt_tokens: int, remaining_tokens: int | None,
            limits: ContinuationLimits) -> str | None:
    """None when the request may be continued now, else the reason it may not (a label)."""
    if not limits.enabled:
        return "disabled"
    if f.n > 1:
        return "n_gt_1"
    if f.logprobs:
        return "logprobs"
    if f.constrained:
        return "constrained_decoding"
    if f.echo:
        return "echo"
    if continuations_done >= limits.max_continuations:
        return "limit"
    if remaining_tokens is not None and remaining_tokens <= 0:
        return "budget_spent"  # nothing left to generate: the stream is complete as it is
    if prompt_tokens + generated_tokens > limits.max_reprefill_tokens:
        return "reprefill_too_long"
    return None


def remaining_budget(max_tokens: int | None, generated_tokens: int) -> int | None:
    """The output budget the continuation asks for (None: the engine's own limit)."""
    if max_tokens is None:
        return None
    return max(0, max_tokens - generated_tokens)


def continuation_profile(profile: RequestProfile, *, generated_tokens: int,
                         tail_block_hashes: tuple[int, ...]) -> RequestProfile:
    """The profile routing sees for a continuation.

    `tail_block_hashes` are the hashes of the full blocks that prompt + generated
    tokens add past the prompt's own full blocks, chained on from the prompt's last
    block hash (the caller hashes: the gateway from token ids, the simulator from
    the request's synthetic ids), so the prefix index finds the original prefix.
    The request id is kept: the client sees one stream, and the decision log
    and traces show every leg under one id (the caller's attempt number tells
    them apart).
    """
    return replace(
        profile,
        prompt_tokens=profile.prompt_tokens + generated_tokens,
        block_hashes=tuple(profile.block_hashes) + tuple(tail_block_hashes),
        max_tokens=remaining_budget(profile.max_tokens, generated_tokens),
    )
