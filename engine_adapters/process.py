"""Engine processes the gateway starts: spawn tied to the gateway's life, stop gracefully.

Shared by every adapter that launches local processes (sim workers, vLLM, SGLang).
Two guarantees matter more than anything else here: an engine never outlives the
gateway (even when the gateway is SIGKILLed), and a stop never hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import IO, Any

_PR_SET_PDEATHSIG = 1
# A process SIGKILL cannot end at once (uninterruptible sleep: a hung GPU driver call, a dead NFS
# mount) held the stop, and the gateway's exit, for ever: past this it is left to the kernel.
KILL_WAIT_S = 5.0

log = logging.getLogger("tokenfleet.engines")


def die_with_parent() -> None:
    """Linux: the child gets SIGTERM if the gateway dies, so no orphans even on SIGKILL."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


async def spawn(argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                stdout: int | IO[Any] | None = asyncio.subprocess.PIPE,
                stderr: int | IO[Any] | None = None,
                own_group: bool = False, pass_fds: Sequence[int] = ()) -> asyncio.subprocess.Process:
    """Start `argv` with no stdin, dying with the gateway.

    `own_group` puts the child in a new process group: engines such as vLLM fork
    helpers (engine core, workers) that a hard kill must reach too (`kill_group`).
    `pass_fds`: descriptors the child keeps open (a heartbeat pipe's write end).
    """
    linux = sys.platform.startswith("linux")
    return await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=stdout, stderr=stderr,
        env=dict(env) if env is not None else None,
        preexec_fn=die_with_parent if linux else None, start_new_session=own_group, pass_fds=tuple(pass_fds))


def kill_group(proc: asyncio.subprocess.Process, sig: int = signal.SIGKILL) -> bool:
    """Signal the process group led by `proc` (see `spawn(own_group=True)`); False if it is empty."""
    try:
        os.killpg(proc.pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


async def terminate(procs: Iterable[asyncio.subprocess.Process], grace_s: float,
                    groups: bool = False) -> None:
    """SIGTERM every process, wait up to `grace_s` for all of them, SIGKILL the rest.

    With `groups`, whatever is left of each process group after its leader exited
    (an engine's helper processes) is killed too, so nothing lingers holding memory or ports.
    """
    procs = list(procs)
    for p in procs:
        if p.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)

    async def reap(p: asyncio.subprocess.Process) -> None:
        try:
            await asyncio.wait_for(p.wait(), grace_s)
        except asyncio.TimeoutError:
            await kill(p, groups)
        if groups:
            kill_group(p)  # stragglers of an exited leader; a no-op when the group is empty

    await asyncio.gather(*(reap(p) for p in procs))


async def kill(p: asyncio.subprocess.Process, group: bool = False) -> None:
    """SIGKILL `p` (with `group`, its whole process group) and wait at most KILL_WAIT_S for it."""
    # The process before its group: under asyncio's own loop `p.kill()` first polls (waitpid) the
    # child, and a leader the group kill had already ended was reaped there, behind the loop's
    # back; its exit code then read 255 ("unknown child process") instead of -9.
    with contextlib.suppress(ProcessLookupError):
        p.kill()
    if group:
        kill_group(p)
    try:
        await asyncio.wait_for(p.wait(), KILL_WAIT_S)
    except asyncio.TimeoutError:
        log.error("pid %d has not exited %.0f s after SIGKILL (uninterruptible sleep?); "
                  "not waiting for it", p.pid, KILL_WAIT_S)


async def drain(stream: asyncio.StreamReader) -> None:
    """Keep reading so a chatty child can never block on a full pipe."""
    while await stream.read(65536):
        pass


async def exit_code_soon(proc: asyncio.subprocess.Process, timeout_s: float = 2.0) -> int | None:
    try:
        return await asyncio.wait_for(proc.wait(), timeout_s)
    except asyncio.TimeoutError:
        return None
