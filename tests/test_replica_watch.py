"""`tokenfleet up --workers/--replicas`: the supervisor's restart of a member that died."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine_adapters.process import terminate
from gateway import replicas as replicas_mod
from gateway.replicas import Replica
from tests.waits import wait_until

# Start 1: ready, then exits (a crash). Start 2: hangs before saying it is ready. Start 3 on: ready, serves.
_MEMBER = """
import sys, time
from pathlib import Path
f = Path(sys.argv[1])
n = int(f.read_text() or 0) + 1 if f.exists() else 1
f.write_text(str(n))
if n == 2:
    time.sleep(3600)
print("tokenfleet: gateway ready at http://127.0.0.1:1", flush=True)
if n == 1:
    sys.exit(3)
time.sleep(3600)
"""


@contextlib.asynccontextmanager
async def _watching(r: Replica) -> AsyncIterator[asyncio.Future[None]]:
    """The supervisor's `_watch` of `r` (short backoffs), running; stopped and `r` ended after."""
    config = SimpleNamespace(gateway=SimpleNamespace(engine_restart_backoff_s=0.01, engine_restart_backoff_max_s=0.05))
    stop = asyncio.Event()
    watch = asyncio.ensure_future(replicas_mod._watch(r, config, stop))  # type: ignore[arg-type]
    try:
        yield watch
    finally:
        stop.set()
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        assert r.proc is not None
        await terminate([r.proc], 1.0)


async def test_a_restart_that_hangs_before_ready_is_killed_and_tried_again(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A restart that never printed its ready line (READY_TIMEOUT_S) was left running and `_watch` waited on
    it for ever: the worker stayed hung and was never restarted again."""
    monkeypatch.setattr(replicas_mod, "READY_TIMEOUT_S", 0.5)
    monkeypatch.setattr(replicas_mod, "STOP_EXTRA_S", 0.5)
    counter = tmp_path / "starts"
    script = tmp_path / "member.py"
    script.write_text(_MEMBER)
    r = Replica(0, 1, [sys.executable, str(script), str(counter)], "worker")
    await r.start()
    async with _watching(r):
        await wait_until(lambda: r.restarts, 20, "the worker restarted after its hung restart was killed")
        assert counter.read_text() == "3"


async def test_a_restart_that_cannot_spawn_is_tried_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fork/exec failing once (EAGAIN, ENOMEM, EMFILE under pressure) raised OSError out of `_watch`:
    its task ended and the worker was never restarted again."""
    counter = tmp_path / "starts"
    script = tmp_path / "member.py"
    script.write_text(_MEMBER.replace("if n == 2:", "if n == -1:"))  # no hang: the spawn fails instead
    r = Replica(0, 1, [sys.executable, str(script), str(counter)], "worker")
    await r.start()
    real, calls = replicas_mod.spawn, []

    async def flaky(*args: object, **kw: object) -> object:
        calls.append(1)
        if len(calls) == 1:
            raise OSError(11, "Resource temporarily unavailable")
        return await real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(replicas_mod, "spawn", flaky)
    async with _watching(r) as watch:
        await wait_until(lambda: r.restarts or watch.done(), 20, "the worker restarted after a failed spawn")
        assert not watch.done() and r.restarts == 1 and len(calls) == 2
