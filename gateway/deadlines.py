"""Deadlines on every wait for an engine: what the gateway gives it before calling it stalled.

The fleet file's `gateway:` block sets them (`fleetcore.fleet_config.GatewaySettings`):

- connect: `connect_timeout_s` (the upstream client's own connect deadline, `gateway.upstream_http`);
- first byte: `max(first_byte_timeout_floor_s, first_byte_timeout_factor x predicted TTFT)`,
  from sending the request to the first whole SSE event (streams) or the response head
  (non-streaming answers, which an engine only sends once the whole generation is done: there
  the deadline is extended while the engine keeps passing its health checks, so a long answer
  from a live engine is not cut, and a stopped one is given up on within a health period);
- idle: `stream_idle_timeout_s`, each later read (a stream's next bytes, a body's next chunk).

`UpstreamWatch` enforces them for one dispatch with a single timer that re-arms lazily (at most
once per idle period), not one timer per read: a stream relays one read per token. The same
watch lets graceful shutdown interrupt the dispatch at its next wait (`interrupt`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from fleetcore.fleet_config import GatewaySettings
from fleetcore.first_byte import first_byte_deadline_s

T = TypeVar("T")
_EARLY_S = 1e-3  # loop timers may fire up to a clock tick early; that is not "before the deadline"


class UpstreamStalled(TimeoutError):
    """The engine sent nothing within its deadline (`phase`: "first_byte" or "idle")."""

    def __init__(self, phase: str, waited_s: float) -> None:
        super().__init__(f"no bytes from the engine for {waited_s:.1f} s ({phase})")
        self.phase = phase
        self.waited_s = waited_s


class Interrupted(Exception):
    """The gateway itself ended the wait (graceful shutdown's grace ran out): `code` says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class Deadlines:
    connect_s: float
    first_byte_floor_s: float
    first_byte_factor: float
    idle_s: float

    @classmethod
    def from_settings(cls, s: GatewaySettings) -> Deadlines:
        return cls(s.connect_timeout_s, s.first_byte_timeout_floor_s, s.first_byte_timeout_factor,
                   s.stream_idle_timeout_s)

    def first_byte_s(self, predicted_ttft_s: float | None) -> float:
        return first_byte_deadline_s(self.first_byte_floor_s, self.first_byte_factor, predicted_ttft_s)


class UpstreamWatch:
    """Bounds each wait of a dispatch on its engine; one at a time, from whichever task waits."""

    __slots__ = ("idle_s", "_loop", "_task", "_started", "_due", "_keep_waiting", "_recheck_s", "_phase",
                 "_cancelling", "_cause", "_interrupt", "_timer", "_timer_at")

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self._loop = asyncio.get_running_loop()
        self._task: asyncio.Task[object] | None = None
        self._started = 0.0
        self._due: float | None = None  # when the pending wait expires; None: no wait pending
        self._keep_waiting: Callable[[], bool] | None = None
        self._recheck_s = idle_s
        self._phase = "idle"
        self._cancelling = 0
        self._cause: BaseException | None = None  # set when this watch cancelled the waiting task
        self._interrupt: Interrupted | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")

    def now(self) -> float:
        return self._loop.time()

    async def wait(self, aw: Awaitable[T], *, deadline: float | None = None,
                   keep_waiting: Callable[[], bool] | None = None, recheck_s: float | None = None,
                   phase: str = "idle") -> T:
        """`aw`'s result, or UpstreamStalled once `deadline` (default: now + idle) has passed, or the
        Interrupted given to `interrupt`. Past the deadline, `keep_waiting()` returning True grants
        another `recheck_s` (the engine shows it is alive some other way)."""
        # On the relay's hot path (one call per token event): plain attribute writes, no timer
        # unless none is pending or this deadline is earlier than the pending one.
        if self._interrupt is not None:
            if asyncio.iscoroutine(aw):
                aw.close()
            raise self._interrupt
        task = asyncio.current_task(self._loop)  # the loop given: no getpid() (gateway.relay.DisconnectWatch.race)
        assert task is not None
        self._task = task
        self._cancelling = task.cancelling()
        self._started = now = self._loop.time()
        self._due = due = deadline if deadline is not None else now + self.idle_s
        self._keep_waiting = keep_waiting
        self._phase = phase
        if recheck_s is not None:
            self._recheck_s = recheck_s
        if self._timer is None or due < self._timer_at:
            self._arm(due)
        try:
            result = await aw
        except asyncio.CancelledError:
            cause = self._take_cause(task)
            if cause is not None:
                raise cause from None
            raise
        finally:
            self._due = None
            self._task = None
        if self._cause is not None:
            self._take_cause(task)  # cancelled too late to matter: the result won
        return result

    def interrupt(self, reason: Interrupted) -> None:
        """End the pending wait now, and every later one at once."""
        self._interrupt = reason
        if self._due is not None:
            self._end(reason)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _take_cause(self, task: asyncio.Task[object]) -> BaseException | None:
        """The exception this watch cancelled the task for, unless someone else cancelled it too."""
        cause, self._cause = self._cause, None
        if cause is None:
            return None
        return cause if task.uncancel() <= self._cancelling else None

    def _arm(self, due: float) -> None:
        """`wait` arms only when no timer is pending or the pending one is later than `due`; an
        earlier one fires first and re-arms for the wait then pending: one timer per idle period."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = due
        self._timer = self._loop.call_at(due, self._fire)

    def _fire(self) -> None:
        self._timer, self._timer_at = None, float("inf")
        if self._due is None or self._cause is not None:
            return  # no wait pending: the next one arms its own timer
        now = self.now()
        if now + _EARLY_S < self._due:
            self._arm(self._due)
        elif self._keep_waiting is not None and self._keep_waiting():
            self._due = now + self._recheck_s
            self._arm(self._due)
        else:
            self._end(UpstreamStalled(self._phase, now - self._started))

    def _end(self, cause: BaseException) -> None:
        if self._task is None or self._cause is not None:
            return
        self._cause = cause
        self._task.cancel()
