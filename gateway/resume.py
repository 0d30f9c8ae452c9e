"""Continuation legs: after a stream's upstream dies, stalls or is drained mid-stream, the
request is re-prefilled on another instance and the relayed stream reads on from there.

- `continuation_of`: a request's continuation state, or None when it is never continued.
- `resume`: after a leg failed, the decision (continue, or why not: every one counted in
  `tokenfleet_continuations_total`), the choice of the next instance, and the new leg's send,
  spliced into the client's stream by `RelayStream.switch` (`gateway.relay`).
- `drained`: the drain migration: streams on an instance being drained that would outlive the
  drain timeout are moved off it now.

What a continuation sends and how its events are spliced in are `gateway.continuation`'s; what
this module needs of the relay is the narrow `ResumeHost`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from fleetcore.sse import SSE_DONE
from fleetcore.continuation import ContinuationLimits
from fleetcore.fleet_config import FleetConfig
from fleetcore.model_tokenizer import PromptTokenizer
from fleetcore.types import RequestProfile
from gateway.continuation import (CONTINUATION_PATH, Continuation, ContinuationMetrics, continuation_tokenizer,
                                  engine_gives_ids, static_refusal)
from gateway.deadlines import Interrupted
from gateway.errors import redact_addresses
from gateway.upstream_failure import RetryableFailure, describe

if TYPE_CHECKING:
    from gateway.upstream_http import UpstreamResponse
    from gateway.admission import AdmissionGate
    from gateway.fleet_state import FleetState
    from gateway.metrics import GatewayMetrics
    from gateway.relay import Dispatch, LegFailure, RelayStream, Target
    from gateway.requests import ParsedRequest
    from gateway.route_share import RouteShare
    from gateway.tokenize_pool import TokenizePool

log = logging.getLogger("tokenfleet.gateway")

T = TypeVar("T")

DRAINED = "drained"  # the Interrupted code with which a drain moves a stream off its instance


class ResumeHost(Protocol):
    """What continuing a stream needs of the relay: placement, a new dispatch and its response
    head, and where the request's streams, limits, tokenizers and counts are kept."""

    config: FleetConfig
    clock: Callable[[], float]
    admission: AdmissionGate | None
    route_share: RouteShare | None
    state: FleetState
    metrics: GatewayMetrics
    continuation_limits: ContinuationLimits
    continuation_metrics: ContinuationMetrics
    tokenizers: Mapping[str, PromptTokenizer]
    tokenize_pool: TokenizePool
    live: set[RelayStream]

    def choose(self, profile: RequestProfile, excluded: Collection[str], attempt: int,
               avoid: Collection[str] = (), leg: tuple[int, str] | None = None) -> Target | None: ...

    def new_dispatch(self, parsed: ParsedRequest, target: Target) -> Dispatch: ...

    async def head(self, d: Dispatch, path: str, body: bytes | None = None) -> UpstreamResponse: ...

    async def error_text(self, resp: UpstreamResponse) -> str: ...


def continuation_of(host: ResumeHost, parsed: ParsedRequest) -> Continuation | None:
    """The request's continuation state, or None when it is never continued (why: a label kept
    for when it fails mid-stream)."""
    usable, tok = continuation_tokenizer(host.config, parsed.profile.model, host.tokenizers)
    # Without a usable tokenizer `static_refusal` refuses whatever else it finds (its reason
    # matters only to the label counted at a failure, `_refused_label`): no need to look.
    if not usable or static_refusal(parsed, usable, host.continuation_limits) is not None:
        return None
    return Continuation(parsed, host.continuation_limits, tok,
                        engine_ids=engine_gives_ids(host.config, parsed.profile.model))


async def _tokenized(host: ResumeHost, reason: str, rid: str, fn: Callable[..., T], *args: Any) -> T | None:
    """`fn(*args)` (tokenizing: the text relayed so far where the engine gave no ids, the prompt
    again) off the event loop, in the app's bounded tokenizer pool: its deadline, and a long
    text of the built-in tokenizer in its helper process. None, counted as `tokenize_failed`,
    when it fails or the pool refuses it (full, too slow): the stream then ends with its error."""
    try:
        return await host.tokenize_pool.run(fn, *args)
    except Exception as e:
        _counted(host, reason, "tokenize_failed")
        log.warning("request %s: continuation prompt not built: %s", rid, describe(e))
        return None


def _refused_label(host: ResumeHost, parsed: ParsedRequest) -> str:
    usable, _ = continuation_tokenizer(host.config, parsed.profile.model, host.tokenizers)
    return static_refusal(parsed, usable, host.continuation_limits) or "disabled"


def _counted(host: ResumeHost, reason: str, outcome: str) -> None:
    host.continuation_metrics.decisions.labels(reason, outcome).inc()


async def resume(host: ResumeHost, s: RelayStream, f: LegFailure) -> bytes | None:
    """After `s`'s upstream failed mid-stream: the first bytes of its continuation on another
    instance (b"" when none came yet), or None when it is not continued (the caller ends the
    stream with the error event). Every failed leg counts against the request's limit."""
    s.end_leg(f)
    c, reason = s.cont, f.reason
    if reason is None:
        return None  # the gateway is shutting down: nothing to continue on
    if c is None:
        _counted(host, reason, _refused_label(host, s.d.parsed))
        return None
    rid = c.parsed.profile.request_id
    s.gap_from, s.gap_reason = s.d.stats.last_token_at or host.clock(), reason
    while True:
        c.excluded.append(s.d.iid)
        tail = await _tokenized(host, reason, rid, c.tail_ids) if c.tail_needs_tokenizing else c.tail_ids()
        if tail is None:
            return None
        if c.sent.finished and not c.sent.unfaithful:
            # the answer was whole (its finish_reason went by); only the end of the stream was lost
            _counted(host, reason, "complete")
            c.before_tokens = len(tail)
            return (_sse_usage(c) if c.include_usage else b"") + SSE_DONE
        why = c.refused(len(tail))
        if why is not None:
            _counted(host, reason, why)
            log.warning("request %s: not continued after %s on %s: %s", rid, reason, s.d.iid, why)
            return None
        leg = await _tokenized(host, reason, rid, c.next_leg, tail)
        if leg is None:
            return None
        target = host.choose(leg.profile, c.excluded, c.done + 1, leg=(c.done + 1, reason))
        if target is None:
            _counted(host, reason, "no_instance")
            log.warning("request %s: no instance to continue on after %s", rid, reason)
            return None
        c.done += 1
        c.before_tokens = leg.generated_tokens
        c.reprefill_tokens += leg.prompt_tokens
        model = c.parsed.profile.model
        host.continuation_metrics.reprefill.labels(model).inc(leg.prompt_tokens)
        iid = target.instance.instance_id
        if host.admission is not None:
            host.admission.routed(rid, iid)
        if host.route_share is not None:
            host.route_share.dispatched(leg.profile, iid)
        log.info("request %s: continuing on %s after %s on %s (%d tokens sent, %d to re-prefill)",
                 rid, iid, reason, s.d.iid, leg.generated_tokens, leg.prompt_tokens)
        d = host.new_dispatch(replace(c.parsed, profile=leg.profile), target)
        d.carried = (s.first_token_at, leg.generated_tokens)
        switched = False
        try:
            d.resp = await host.head(d, CONTINUATION_PATH, leg.encoded(target.instance.model))
            if d.resp.status >= 400:
                status, text = d.resp.status, await host.error_text(d.resp)
                raise RetryableFailure(f"http_{status}", text,
                                       f"engine instance {d.iid} answered {redact_addresses(text)}")
            s.switch(d)
            switched = True
            await s.prefetch()
        except RetryableFailure as rf:
            host.metrics.upstream_errors.labels(d.iid, rf.kind).inc()
            if rf.kind.startswith("http_4"):  # the engine refused the continuation itself
                d.finish(ok=False, status=None, error=str(rf), abort=True)
                _counted(host, reason, "rejected")
                return None
            host.state.mark_failed(d.iid, str(rf))
            d.finish(ok=False, status=None, error=str(rf), abort=True)
            log.warning("request %s: continuation on %s failed before its first event: %s", rid, d.iid, rf)
            _counted(host, reason, "leg_failed")
            s.d = d  # excluded on the next turn
            continue
        except Interrupted:
            d.finish(ok=False, status=None, error="shutting down", abort=True)
            return None
        except asyncio.CancelledError:
            # The response is being torn down (the client left) while this leg waits for its first
            # event: it is the stream's current leg now, which the response's close ends as a 499
            # and aborts. (Ended here, with no status, the request was never counted as gone.)
            if not switched:
                s.d = d
            raise
        finally:
            if not switched and not d.finished and s.d is not d:
                d.finish(ok=False, status=None, error="continuation ended early", abort=True)
        _counted(host, reason, "continued")
        host.live.add(s)
        return s.take_pending()


def drained(host: ResumeHost, instance_id: str) -> None:
    """`instance_id` is being drained: streams on it that would outlive the drain timeout, at
    their pace so far, are continued elsewhere now instead of being cut when it stops."""
    timeout_s = host.config.planner.drain_timeout_s
    for s in list(host.live):
        if s.d.iid == instance_id and not s.d.finished and s.cont is not None and s.would_outlive(timeout_s):
            s.d.watch.interrupt(Interrupted(DRAINED, f"instance {instance_id} is draining"))


def _sse_usage(c: Continuation) -> bytes:
    return b"data: " + json.dumps(c._chunk([], usage=c.total_usage(None)), separators=(",", ":")).encode() + b"\n\n"
