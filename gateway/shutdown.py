"""Graceful shutdown of the serving path: nothing in flight is cut silently.

On SIGTERM (`gateway.cli`) `begin` flips readiness (`/health` answers 503 "shutting_down",
new requests get 503 `gateway_shutdown` with Retry-After) while the server stops accepting
connections; dispatches in flight get `shutdown_grace_s` to finish. Then `expire` interrupts
every one still open at its next wait on the engine: a stream ends with an SSE error event
(code `gateway_shutdown`) and `[DONE]`, a request still waiting for its answer gets a 503. The
ASGI server's own graceful timeout is set longer than the grace, so it never cancels first.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.deadlines import Interrupted, UpstreamWatch

log = logging.getLogger("tokenfleet.gateway")

GATEWAY_SHUTDOWN = "gateway_shutdown"
SHUTDOWN_MESSAGE = "The gateway is shutting down; the request was ended before it finished. Retry it."


class Shutdown:
    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.draining = False  # readiness is off: no new work
        self.expired = False  # the grace is over: whatever is still open gets ended
        self._open: set[UpstreamWatch] = set()
        self._timer: asyncio.TimerHandle | None = None

    @property
    def in_flight(self) -> int:
        return len(self._open)

    def begin(self) -> None:
        """Flip readiness and start the grace period (idempotent; call it on the event loop)."""
        if self.draining:
            return
        self.draining = True
        log.warning("shutting down: %d request(s) in flight get %.1f s to finish", len(self._open), self.grace_s)
        self._timer = asyncio.get_running_loop().call_later(self.grace_s, self.expire)

    def expire(self) -> None:
        """End everything still in flight now (the grace ran out, or a second signal forces it)."""
        self.draining = self.expired = True
        self.close()
        if self._open:
            log.warning("shutdown grace over: ending %d request(s) still in flight", len(self._open))
        for watch in list(self._open):
            watch.interrupt(Interrupted(GATEWAY_SHUTDOWN, SHUTDOWN_MESSAGE))

    def track(self, watch: UpstreamWatch) -> None:
        self._open.add(watch)
        if self.expired:
            watch.interrupt(Interrupted(GATEWAY_SHUTDOWN, SHUTDOWN_MESSAGE))

    def untrack(self, watch: UpstreamWatch) -> None:
        self._open.discard(watch)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
