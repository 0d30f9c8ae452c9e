"""Supervision of the engine processes an adapter launched: restart one that dies, with backoff.

An engine that dies (a non-zero status or a signal: crash, OOM kill, SIGKILL) is started again
on the same instance id and port, after a wait that starts at `backoff_s` and doubles with every death
up to `backoff_max_s`; a process that stayed up for `stable_s` (default: `backoff_max_s`)
earns the short wait again. Restarts are counted per instance and logged. An engine that exits
cleanly (status 0) was told to stop by someone and stays down. Stops the adapter asked for itself (the planner's `remove_instance`, the gateway's shutdown) are `release`d
first, so they are never taken for a crash. Attached engines (static URLs, attach mode)
belong to someone else and are never supervised.

While an instance is down or being restarted, `down(instance_id)` is True: the gateway's
fleet state takes it out of routing (and out of the planner's count) without waiting for
a health check to notice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger("tokenfleet.engines")

# (restart attempt time, instance id, exit code of the process it replaces, wait before it)
RestartRecord = tuple[float, str, int | None, float]
_KEEP_RECORDS = 256


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    stable_s: float | None = None  # uptime that resets the backoff; None: backoff_max_s

    def __post_init__(self) -> None:
        if self.backoff_s <= 0 or self.backoff_max_s < self.backoff_s:
            raise ValueError("restart backoff: need 0 < backoff_s <= backoff_max_s")

    @property
    def stable_after_s(self) -> float:
        return self.backoff_max_s if self.stable_s is None else self.stable_s


class Supervisor:
    """One per launching adapter. `respawn(instance_id)` starts a replacement process (and
    returns once it is started, or raises: LookupError when the instance is no longer the
    adapter's, anything else when the replacement failed); the supervisor waits and counts."""

    def __init__(self, owner: str, policy: RestartPolicy,
                 respawn: Callable[[str], Awaitable[asyncio.subprocess.Process]]) -> None:
        self.owner = owner
        self.policy = policy
        self._respawn = respawn
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._down: set[str] = set()
        self.restarts: dict[str, int] = {}  # replacement processes started, per instance
        self.log: deque[RestartRecord] = deque(maxlen=_KEEP_RECORDS)
        self._closed = False

    def watch(self, instance_id: str, proc: asyncio.subprocess.Process) -> None:
        """Keep `instance_id` alive from now on (its current process is `proc`)."""
        if self._closed:
            return
        old = self._watchers.get(instance_id)
        if old is not None and not old.done():
            old.cancel()
        loop = asyncio.get_running_loop()
        self._watchers[instance_id] = loop.create_task(
            self._watch(instance_id, proc, loop.time()), name=f"supervise-{instance_id}")

    def down(self, instance_id: str) -> bool:
        return instance_id in self._down

    async def release(self, instance_id: str) -> None:
        """Stop supervising one instance (the adapter is about to stop it on purpose)."""
        task = self._watchers.pop(instance_id, None)
        self._down.discard(instance_id)
        await _cancel([task] if task is not None else [])

    async def close(self) -> None:
        """Stop supervising everything (shutdown): nothing is restarted after this."""
        self._closed = True
        tasks = list(self._watchers.values())
        self._watchers.clear()
        await _cancel(tasks)

    async def _watch(self, instance_id: str, proc: asyncio.subprocess.Process, started: float) -> None:
        loop = asyncio.get_running_loop()
        p = self.policy
        delay = p.backoff_s
        while True:
            code = await proc.wait()
            if code == 0:
                # A clean exit is an engine that was told to stop (an operator's SIGTERM, a Ctrl-C
                # that reached the whole process group): not a crash, and not ours to undo.
                self._down.add(instance_id)
                log.warning("%s: engine %s exited cleanly (status 0): it was told to stop; not restarting",
                            self.owner, instance_id)
                return
            up = loop.time() - started
            if up >= p.stable_after_s:
                delay = p.backoff_s
            self._down.add(instance_id)
            log.warning("%s: engine %s exited with code %s after %.1f s up; restarting in %.1f s",
                        self.owner, instance_id, code, up, delay)
            while True:
                await asyncio.sleep(delay)
                self.restarts[instance_id] = self.restarts.get(instance_id, 0) + 1
                self.log.append((loop.time(), instance_id, code, delay))
                waited, delay = delay, min(2 * delay, p.backoff_max_s)
                try:
                    proc = await self._respawn(instance_id)
                except asyncio.CancelledError:
                    raise
                except LookupError as e:  # the adapter no longer has it: nothing to keep alive
                    log.info("%s: not restarting %s: %s", self.owner, instance_id, e)
                    self._down.discard(instance_id)
                    return
                except Exception as e:  # the replacement died too: wait longer, try again
                    log.warning("%s: restart %d of %s failed after a %.1f s wait (%s); next try in %.1f s",
                                self.owner, self.restarts[instance_id], instance_id, waited, e, delay)
                    code = None
                    continue
                started = loop.time()
                break
            self._down.discard(instance_id)
            log.warning("%s: engine %s restarted (restart %d, pid %d)", self.owner, instance_id,
                        self.restarts[instance_id], proc.pid)


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    # Re-cancel until done: a cancellation landing as an inner wait completes can be swallowed.
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.1)
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            t.result()
