"""DisconnectWatch on its own: a fake ASGI receive channel whose client leaves when the test says.

Every task waiting in `race` when the client leaves must see ClientGone (that is what makes
the relay count a 499 and abort the upstream); a plain CancelledError there ends a dispatch
as "ended early", with no status, which is what the real-vLLM disconnect test once saw.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from gateway import relay
from gateway.relay import ClientGone, DisconnectWatch

WAIT_S = 2.0  # far above LAZY_WATCH_S (the watcher's start) on a loaded machine


class Client:
    """The receive channel of one request whose body was read: it only ever says disconnect."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()
        self.on_leave: Callable[[], None] | None = None  # runs in the same loop turn as the leave

    async def receive(self) -> dict[str, str]:
        await self.gone.wait()
        if self.on_leave is not None:
            self.on_leave()
        return {"type": "http.disconnect"}


async def _blocked(entered: asyncio.Event) -> None:
    entered.set()
    await asyncio.Event().wait()  # work that only ends when cancelled (an engine in a long prefill)


async def _raced(watch: DisconnectWatch) -> tuple[asyncio.Task[None], asyncio.Event]:
    entered = asyncio.Event()
    task = asyncio.create_task(watch.race(_blocked(entered)))
    await asyncio.wait_for(entered.wait(), WAIT_S)
    return task, entered


async def test_every_task_waiting_when_the_client_leaves_sees_client_gone() -> None:
    """Two tasks in `race` at once (the P/D flow's decode leg beside the request's task): with one
    waiting slot per request the second overwrote the first, which was never cancelled."""
    client = Client()
    watch = DisconnectWatch(client.receive)
    first, _ = await _raced(watch)
    second, _ = await _raced(watch)
    client.gone.set()
    done, pending = await asyncio.wait({first, second}, timeout=WAIT_S)
    for t in pending:
        t.cancel()
    assert not pending, "a task waiting in race was not told that the client left"
    for t in (first, second):
        assert isinstance(t.exception(), ClientGone)
    await watch.aclose()


async def test_client_gone_when_another_cancel_lands_in_the_same_turn() -> None:
    """The client leaves as someone else cancels the same task (the P/D flow aborting a decode leg
    whose prefill failed, a hedge, the server): it is still the client's leaving that the
    relay must count. One slot's cancel count made it a plain CancelledError."""
    client = Client()
    watch = DisconnectWatch(client.receive)
    task, _ = await _raced(watch)
    client.on_leave = task.cancel
    client.gone.set()
    done, _ = await asyncio.wait({task}, timeout=WAIT_S)
    assert done, "the raced task did not end"
    assert not task.cancelled() and isinstance(task.exception(), ClientGone)
    assert watch.left
    await watch.aclose()


async def test_a_race_after_the_client_left_raises_at_once_and_the_499_is_counted_once() -> None:
    client = Client()
    watch = DisconnectWatch(client.receive)
    task, _ = await _raced(watch)
    client.gone.set()
    await asyncio.wait({task}, timeout=WAIT_S)
    assert isinstance(task.exception(), ClientGone)
    entered = asyncio.Event()
    with pytest.raises(ClientGone):
        await watch.race(_blocked(entered))
    assert not entered.is_set()  # never started: nothing was sent for a client that is gone
    assert watch.take_gone() and not watch.take_gone()
    await watch.aclose()


async def test_a_cancel_that_is_not_the_clients_stays_a_cancel() -> None:
    client = Client()
    watch = DisconnectWatch(client.receive)
    task, _ = await _raced(watch)
    task.cancel()
    await asyncio.wait({task}, timeout=WAIT_S)
    assert task.cancelled()
    assert not watch.left
    # the watch goes on serving the request's next wait
    second, _ = await _raced(watch)
    client.gone.set()
    await asyncio.wait({second}, timeout=WAIT_S)
    assert isinstance(second.exception(), ClientGone)
    await watch.aclose()


async def test_a_result_that_swallowed_the_cancel_stands_and_the_next_race_says_gone() -> None:
    """Work that catches the cancel and ends on its own (3.11's wait_for can, as its inner call
    completes) keeps its result (it may own a connection); the task's cancel count is restored
    and the request's next wait raises ClientGone."""
    client = Client()
    watch = DisconnectWatch(client.receive)
    entered = asyncio.Event()

    async def swallowing() -> int:
        entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return 7
        return 0

    async def request() -> tuple[int, int, bool]:
        got = await watch.race(swallowing())
        cancelling = asyncio.current_task().cancelling()  # type: ignore[union-attr]
        try:
            await watch.race(asyncio.sleep(0))
        except ClientGone:
            return got, cancelling, True
        return got, cancelling, False

    task = asyncio.create_task(request())
    await asyncio.wait_for(entered.wait(), WAIT_S)
    client.gone.set()
    assert await asyncio.wait_for(task, WAIT_S) == (7, 0, True)
    await watch.aclose()



def _fire(handle: asyncio.TimerHandle) -> None:
    """Run a timer's callback now, as the loop would at its time (and not again later)."""
    callback = handle._callback  # type: ignore[attr-defined]
    handle.cancel()
    callback()


async def test_one_timer_serves_the_races_of_a_request_and_a_late_race_still_gets_its_watcher(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay, "LAZY_WATCH_S", 3600.0)  # fired by the test (`_fire`), never by time
    client = Client()
    watch = DisconnectWatch(client.receive)

    async def quick() -> int:
        return 1

    assert await watch.race(quick()) == 1
    first = watch._timer
    assert first is not None
    for _ in range(3):  # head, first event, the stream: each over at once
        assert await watch.race(quick()) == 1
    assert watch._timer is first and not first.cancelled()  # armed once, left for the next race
    _fire(first)  # it fires between races: nothing to watch
    assert watch._watcher is None and watch._timer is None
    task, _ = await _raced(watch)  # a race after it arms anew...
    second = watch._timer
    assert second is not None and second is not first
    _fire(second)  # ...and when that fires with the race still waiting, the watcher starts
    assert watch._watcher is not None
    client.gone.set()
    with pytest.raises(ClientGone):
        await asyncio.wait_for(task, WAIT_S)
    await watch.aclose()


async def test_aclose_cancels_the_timer_left_armed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay, "LAZY_WATCH_S", 3600.0)
    watch = DisconnectWatch(Client().receive)

    async def quick() -> None:
        return None

    await watch.race(quick())
    timer = watch._timer
    assert timer is not None and not timer.cancelled()
    await watch.aclose()
    assert timer.cancelled() and watch._timer is None
