"""Overload is refused, not queued without bound: a cap on the /v1 requests in progress.

Whatever the admission policy (FCFS admits everything), a gateway whose event loop cannot
keep up would otherwise let accepted requests pile up inside it — parsed, queued, waiting —
until every one of them is late. This outermost layer counts the POST /v1 requests it lets
in on two bounds:

* `pending`: accepted, response not started (parse, admission queue, routing, connect and
  first byte). This is the backlog that grows when the gateway or the fleet falls behind.
* `inflight`: in progress at all, streams included (memory, sockets).

A request over either bound is answered at once, before its body is read or anything is
parsed: 503, OpenAI-style body with code `gateway_overloaded`, `Retry-After`. Counting is
exact: a request leaves `pending` with its response's first message (or when its handling
ends without one) and `inflight` when its handling ends, however it ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import overloaded


@dataclass(slots=True)
class Backlog:
    """The two bounds and their counts (shared with /metrics: `GatewayMetrics.watch_backlog`)."""

    max_inflight: int
    max_pending: int
    retry_after_s: int
    inflight: int = 0
    pending: int = 0

    def refusal(self) -> tuple[str, str] | None:
        """(which bound, why) when a new request is over a bound; None when it may come in."""
        if self.pending >= self.max_pending:
            return "pending", f"{self.pending} requests are waiting for their response to start"
        if self.inflight >= self.max_inflight:
            return "inflight", f"{self.inflight} requests are in progress"
        return None


class OverloadLimit:
    """Pure ASGI middleware (no task, no buffering: two counters and a wrapped `send`)."""

    def __init__(self, app: ASGIApp, backlog: Backlog, on_refused: Callable[[str], None] | None = None) -> None:
        self.app = app
        self.b = backlog
        self.on_refused = on_refused  # (which bound) -> None: metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        b = self.b
        refused = b.refusal()
        if refused is not None:
            await self.refuse(scope, receive, send, *refused)
            return
        b.inflight += 1
        b.pending += 1
        started = False

        async def counted_send(message: Message) -> None:
            nonlocal started
            if not started and message["type"] == "http.response.start":
                started = True
                b.pending -= 1
            await send(message)

        try:
            await self.app(scope, receive, counted_send)
        finally:
            b.inflight -= 1
            if not started:
                b.pending -= 1

    async def refuse(self, scope: Scope, receive: Receive, send: Send, bound: str, why: str) -> None:
        await refuse(self.b, self.on_refused, scope, receive, send, bound, why)


async def refuse(backlog: Backlog, on_refused: Callable[[str], None] | None, scope: Scope, receive: Receive,
                 send: Send, bound: str, why: str) -> None:
    """The 503 (with Retry-After) for a request over `bound` of `backlog`, counted by `on_refused`:
    the one refusal of both ways in (`OverloadLimit`, `gateway.fast_path.FastLane`)."""
    if on_refused is not None:
        on_refused(bound)
    err = overloaded(f"The gateway is overloaded ({why})", "gateway_overloaded", backlog.retry_after_s)
    await err.response()(scope, receive, send)
