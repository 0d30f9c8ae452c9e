"""engine_adapters.process: a stop never hangs."""

from __future__ import annotations

import asyncio

import pytest

from engine_adapters import process


class _Unkillable:
    """A process in uninterruptible sleep (a hung GPU driver call): signals land, it never exits."""

    pid = 999_999_999
    returncode = None

    def __init__(self) -> None:
        self.signals: list[str] = []
        self._never = asyncio.Event()

    def send_signal(self, sig: int) -> None:
        self.signals.append("TERM")

    def kill(self) -> None:
        self.signals.append("KILL")

    async def wait(self) -> int:
        await self._never.wait()
        return 0


async def test_a_process_sigkill_cannot_end_does_not_hold_the_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    """`terminate` waited on the process after SIGKILL with no deadline: an engine stuck in the kernel
    held the adapter's stop, and the gateway's exit, for ever."""
    monkeypatch.setattr(process, "KILL_WAIT_S", 0.2, raising=False)
    p = _Unkillable()
    await asyncio.wait_for(process.terminate([p], 0.1), 10)  # type: ignore[list-item]
    assert p.signals == ["TERM", "KILL"]
