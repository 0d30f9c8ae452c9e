"""`tokenfleet up --workers/--replicas`: the supervisor's restart of a member that died or hung."""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine_adapters import process
from engine_adapters.process import terminate
from gateway import replicas as replicas_mod
from gateway.liveness import Pulse
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


# A member that beats from its loop as a gateway does (`gateway.liveness.heartbeat`, on the pipe
# the supervisor passes). Start 1: ready, beats a few times, then a blocking call holds its loop
# for ever (HANG=block) or it is stopped (HANG=stop: SIGSTOP itself). Start 2 on: beats for ever.
_BEATING_MEMBER = """
import asyncio, os, signal, sys, time
from pathlib import Path
from gateway.liveness import heartbeat
args = sys.argv[1:]
f = Path(args[0])
n = int(f.read_text() or 0) + 1 if f.exists() else 1
f.write_text(str(n))
fd, every = int(args[args.index("--heartbeat-fd") + 1]), float(args[args.index("--heartbeat-s") + 1])

async def main():
    beats = asyncio.ensure_future(heartbeat(fd, every))
    print("tokenfleet: gateway ready at http://127.0.0.1:1", flush=True)
    await asyncio.sleep(3 * every)
    if n == 1 and os.environ["HANG"] == "block":
        time.sleep(3600)
    if n == 1 and os.environ["HANG"] == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    await asyncio.sleep(3600)

asyncio.run(main())
"""
LIVENESS_S = 1.0


def _beating(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hang: str) -> tuple[Replica, Path]:
    monkeypatch.setenv("HANG", hang)
    counter, script = tmp_path / "starts", tmp_path / "member.py"
    script.write_text(_BEATING_MEMBER)
    return Replica(0, 1, [sys.executable, str(script), str(counter)], "worker", liveness_timeout_s=LIVENESS_S), counter


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


@pytest.mark.parametrize("hang", ["block", "stop"])
async def test_a_member_whose_loop_hangs_is_killed_and_restarted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str], hang: str) -> None:
    """A member that stays alive with its loop held (a blocking call; SIGSTOP) was never restarted:
    `_watch` only waited for it to exit. Its heartbeat stops; it is killed and started again."""
    r, counter = _beating(tmp_path, monkeypatch, hang)
    await r.start()
    assert r.proc is not None
    pid = r.proc.pid
    async with _watching(r):
        await wait_until(lambda: r.restarts, 20, "the hung member killed and restarted")
        assert r.hangs == 1 and counter.read_text() == "2"
    out = capsys.readouterr().out
    assert re.search(rf"^tokenfleet: worker 0 \(pid {pid}\) sent no heartbeat for \d+ s: killed$", out, re.M), out
    assert "exited with code -9; restarting" in out and "(restart 1; 1 after a missed heartbeat)" in out, out


async def test_a_member_whose_loop_runs_is_never_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Beats seen for three timeouts (the supervisor's own looks, not a sleep): never killed."""
    r, counter = _beating(tmp_path, monkeypatch, "none")
    await r.start()
    assert r.proc is not None and r.pulse is not None
    armed, pid = r.pulse.last, r.proc.pid
    async with _watching(r) as watch:
        await wait_until(lambda: r.pulse is not None and r.pulse.last - armed >= 3 * LIVENESS_S, 20,
                         "beats seen for three timeouts")
        assert not watch.done() and r.restarts == r.hangs == 0 and r.proc.pid == pid and r.proc.returncode is None
    assert counter.read_text() == "1"


async def test_the_fleets_stop_ends_the_liveness_watch_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A member being stopped with the fleet is left to its own drain: the watch, cancelled, ends
    now and kills nothing (the fleet's stop terminates members itself, after the watchers)."""
    r, _ = _beating(tmp_path, monkeypatch, "none")
    await r.start()
    assert r.proc is not None
    async with _watching(r) as watch:
        await wait_until(lambda: r.pulse is not None and r.beaten(), 20, "a beat")
        t0 = time.monotonic()
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        assert time.monotonic() - t0 < 0.5 and r.proc.returncode is None and r.hangs == 0


class _Unkillable:
    """A member in uninterruptible sleep: SIGKILL lands, it never exits."""

    pid = 999_999_999
    returncode = None

    def kill(self) -> None:
        pass

    async def wait(self) -> int:
        await asyncio.Event().wait()
        return 0


async def test_a_hung_member_that_outlives_its_sigkill_does_not_hold_the_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process, "KILL_WAIT_S", 0.1)
    r = Replica(0, 1, ["member"], "worker", liveness_timeout_s=1.0, proc=_Unkillable())  # type: ignore[arg-type]
    r.pulse = Pulse(1.0, time.monotonic() - 2.0)  # silent for longer than its timeout already
    assert await asyncio.wait_for(replicas_mod._until_exit(r), 5) is None
    assert r.hangs == 1
