"""Hedged prefill (fleet file `gateway.hedge`, off by default): when a stream's instance has sent
no event within a delay, the same request goes to a second instance too and the stream whose
first event comes first is kept, the other aborted.

The relay (`gateway.relay`) asks `hedge_delay` whether a request is hedged and then opens it
with `open_hedged`; what the hedge needs of the relay is the narrow `HedgeHost`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Collection
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter

from fleetcore.fleet_config import HedgeSettings
from fleetcore.types import RequestProfile
from gateway.upstream_failure import NotAStream, RetryableFailure

if TYPE_CHECKING:
    from gateway.admission import AdmissionGate
    from gateway.continuation import Continuation
    from gateway.fleet_state import FleetState
    from gateway.metrics import GatewayMetrics
    from gateway.relay import DisconnectWatch, Dispatch, RelayStream, Target
    from gateway.requests import ParsedRequest
    from gateway.route_share import RouteShare


class HedgeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.outcomes = Counter("tokenfleet_hedges", "Hedged prefills: sent, and which stream was kept",
                                ["outcome"], registry=registry)
        self.prefill = Counter("tokenfleet_hedge_prefill_tokens", "Prompt tokens hedges sent to a second "
                               "instance (the extra prefill work)", ["model"], registry=registry)


class HedgeHost(Protocol):
    """What a hedge needs of the relay: placement, a new dispatch, a stream opened on it, and
    where to report who won and what failed."""

    admission: AdmissionGate | None
    route_share: RouteShare | None
    state: FleetState
    metrics: GatewayMetrics
    hedge_metrics: HedgeMetrics

    def choose(self, profile: RequestProfile, excluded: Collection[str], attempt: int,
               avoid: Collection[str] = (), leg: tuple[int, str] | None = None) -> Target | None: ...

    def new_dispatch(self, parsed: ParsedRequest, target: Target) -> Dispatch: ...

    async def open_stream(self, d: Dispatch, path: str, cont: Continuation | None) -> RelayStream: ...

    def continuation(self, parsed: ParsedRequest) -> Continuation | None: ...


def hedge_delay(h: HedgeSettings, parsed: ParsedRequest, target: Target) -> float | None:
    """How long the first instance gets to send its first event before a hedge goes out (None: no hedge)."""
    if not h.enabled or not parsed.stream or parsed.profile.request_class not in h.classes:
        return None
    predicted = target.route.predicted_ttft_s if target.route is not None else None
    return max(h.min_delay_s, h.delay_factor * (predicted or 0.0))


async def open_hedged(host: HedgeHost, watch: DisconnectWatch, parsed: ParsedRequest, path: str, d: Dispatch,
                      cont: Continuation | None, delay_s: float) -> RelayStream:
    """The stream on `d`; when it has sent no event within `delay_s`, the same request goes to a
    second instance too and the stream whose first event comes first is kept, the other
    aborted. Both failing: the first one's failure, as without a hedge (the relay's dispatch
    releases `d` then; every other dispatch is released here)."""
    first = asyncio.ensure_future(host.open_stream(d, path, cont))
    tasks: dict[asyncio.Future[RelayStream], Dispatch] = {first: d}
    failed: dict[asyncio.Future[RelayStream], BaseException] = {}
    won: asyncio.Future[RelayStream] | None = None
    try:
        await watch.race(asyncio.wait({first}, timeout=delay_s))
        if not first.done():
            second = _hedge(host, parsed, d)
            if second is not None:
                tasks[asyncio.ensure_future(host.open_stream(second, path, host.continuation(parsed)))] = second
        pending = set(tasks)
        while pending and won is None:
            done, pending = await watch.race(asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED))
            for t in done:
                exc = t.exception()
                if exc is None or isinstance(exc, NotAStream):
                    won = t  # an answer, even an error answer, ends the race
                    break
                failed[t] = exc
        if won is None:
            raise failed.get(first) or next(iter(failed.values()))
        if len(tasks) > 1:
            host.hedge_metrics.outcomes.labels("first_won" if won is first else "second_won").inc()
            if won is not first and host.admission is not None:
                host.admission.routed(parsed.profile.request_id, tasks[won].iid)
        return won.result()
    finally:
        for t, other in tasks.items():
            if t is won or (t is first and won is None):
                continue  # kept; or the first, which the relay's dispatch releases when it fails
            t.cancel()
            with contextlib.suppress(BaseException):
                await t
            exc = failed.get(t)
            if isinstance(exc, RetryableFailure):
                host.metrics.upstream_errors.labels(other.iid, exc.kind).inc()
                host.state.mark_failed(other.iid, str(exc))
                other.finish(ok=False, status=None, error=str(exc), abort=True)
            else:  # lost the race (or the client left): aborted, not failed
                other.finish(ok=False, status=None, error="the other hedge was kept", cancelled=True)


def _hedge(host: HedgeHost, parsed: ParsedRequest, first: Dispatch) -> Dispatch | None:
    """A second dispatch of the request (placement as usual, the first instance excluded)."""
    target = host.choose(parsed.profile, [first.iid], 0, leg=(0, "hedge"))
    if target is None:
        return None
    host.hedge_metrics.outcomes.labels("sent").inc()
    host.hedge_metrics.prefill.labels(parsed.profile.model).inc(parsed.profile.prompt_tokens)
    if host.route_share is not None:
        host.route_share.dispatched(parsed.profile, target.instance.instance_id)
    return host.new_dispatch(parsed, target)
