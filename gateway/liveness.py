"""Liveness of a `--workers` / `--replicas` member: its event loop beats, the supervisor listens.

A member whose event loop hangs (a blocking call, a stuck driver call, SIGSTOP, a CPU-bound stall
that never ends) stays alive, so the supervisor's restart of members that exit never sees it, and
with SO_REUSEPORT the kernel keeps handing it its share of new connections, which then hang. So
each member proves, from its loop, that the loop runs: `heartbeat` writes one byte every
`beat_interval` to a pipe the supervisor gave it (`--heartbeat-fd`). A blocked or stopped loop
stops writing; the supervisor (`gateway.replicas`) kills a member silent for the fleet file's
`gateway.liveness_timeout_s` (gunicorn's worker timeout, Kubernetes' liveness probe) and restarts
it as it restarts one that died.

Why a pipe of its own rather than lines on the member's stdout (which the supervisor reads too):
a beat is one non-blocking write of one byte, so a supervisor that falls behind can never block
the member's loop (a full pipe drops the beat: the unread ones say the same) and a beat never
interleaves with a line another thread is printing; the stdout tail kept for crash messages
stays what the member said; and the supervisor need not wake for each beat: it looks at the pipe
only four times per timeout (`Pulse.look`), reading whatever arrived since, so an idle fleet costs
it one wakeup per member every few seconds, not one a second.

Counting starts when the member says it is ready (`Pulse` is armed then): loading the fleet file
and binding before that are bounded by the supervisor's start-up timeout instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass

BEAT_S = 1.0  # the most often a member writes: one wakeup a second of an otherwise idle loop
_LOOKS_PER_TIMEOUT = 4  # the supervisor looks this often per timeout: a kill is at most a quarter late
_READ_BYTES = 65536  # a pipe's whole buffer: one read takes every beat that waited


def beat_interval(timeout_s: float) -> float:
    """How often a member beats: every second, or four times per timeout when that is shorter, so
    that a beat and a look can miss each other and the member still has half its timeout spare."""
    return min(BEAT_S, timeout_s / _LOOKS_PER_TIMEOUT)


@dataclass
class Pulse:
    """What the supervisor knows of one member's heartbeat: when it last saw one. Pure: the caller
    passes the clock and says whether beats arrived since its last look."""

    timeout_s: float
    last: float  # the last look that found a beat (armed at the member's ready line)

    def look(self, now: float, beaten: bool) -> float:
        """Seconds until the next look; zero or less: silent for the whole timeout (kill it).

        A beat found now is credited to now, not to the earlier moment it may have been written,
        so a member is never judged silent before `timeout_s` has really passed; it may be judged
        up to one look interval late."""
        if beaten:
            self.last = max(self.last, now)
        left = self.last + self.timeout_s - now
        return min(left, self.timeout_s / _LOOKS_PER_TIMEOUT) if left > 0 else left

    def silent_for(self, now: float) -> float:
        return now - self.last


class BeatPipe:
    """The supervisor's end of one member's heartbeat pipe (one per start of the member)."""

    def __init__(self) -> None:
        self._read, self.write_fd = os.pipe()
        os.set_blocking(self._read, False)  # a look takes what is there and never waits

    def handed_over(self) -> None:
        """Close our copy of the write end once the member has its own: else the pipe outlives it."""
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1

    def arrived(self) -> bool:
        """Whether any beat came since the last call (an end of file, the member gone: no)."""
        if self._read < 0:
            return False
        try:
            return bool(os.read(self._read, _READ_BYTES))
        except BlockingIOError:
            return False

    def close(self) -> None:
        self.handed_over()
        if self._read >= 0:
            os.close(self._read)
            self._read = -1


async def heartbeat(fd: int, every_s: float) -> None:
    """The member's side: write one byte to `fd` every `every_s` from this event loop, until
    cancelled. Run it for the process's whole life, not the app's: a member draining its streams
    after SIGTERM (the server's graceful shutdown, then the app's lifespan end) still beats, so
    the supervisor never kills it mid-drain."""
    os.set_inheritable(fd, False)  # the member's own child processes must not hold the pipe open
    os.set_blocking(fd, False)  # a full pipe (the supervisor behind) must never block the loop
    try:
        while True:
            try:
                os.write(fd, b".")
            except BlockingIOError:
                pass  # the pipe is full of unread beats: they say the same
            except OSError:  # EPIPE: the supervisor is gone (and this process goes with it)
                return
            await asyncio.sleep(every_s)
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
