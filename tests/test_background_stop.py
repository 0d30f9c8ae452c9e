"""The API key store's refresh loop and the region-policy sync stop, whenever the stop lands.

Every call either makes on its store is an `asyncio.wait_for` (`gateway.admin_store.SqliteKV`:
a worker thread's future; Redis calls are bounded the same way). On Python 3.11 `wait_for`
swallows a cancel that lands as its call completes and returns the result: the loop goes on
polling, and a stop that cancelled it once and awaited it waited for ever: the gateway's lifespan
shutdown (`tokenfleet up`'s exit, an embedded server's teardown) with it. Here the store's answer
and the stop's cancel land in the same step, every time."""

from __future__ import annotations

import asyncio
from typing import Any

from fleetcore.region_policy import PolicySet
from gateway.keys import KVKeyStore
from gateway.policy_store import Snapshot
from gateway.policy_sync import PolicySync

STOP_S = 5.0  # a stop takes one cancel or two (gateway.background: 0.1 s apart)


async def _stops(stop: Any) -> None:
    """`stop` ends within STOP_S by itself (not `wait_for`: its own cancel would end the wait)."""
    task = asyncio.ensure_future(stop)
    done, _ = await asyncio.wait({task}, timeout=STOP_S)
    if not done:
        task.cancel()
        raise AssertionError(f"the stop did not end within {STOP_S} s")
    task.result()


class _Held:
    """Each call a `wait_for` on a future, as SqliteKV's; once `hold` is set, a call waits until
    the test answers it (`answer`)."""

    def __init__(self) -> None:
        self.hold = False
        self.held: asyncio.Future[Any] | None = None
        self.holding = asyncio.Event()

    async def call(self, value: Any) -> Any:
        fut = asyncio.get_running_loop().create_future()
        if self.hold:
            self.held = fut
            self.holding.set()
        else:
            fut.set_result(value)
        return await asyncio.wait_for(fut, 30)

    def answer(self, value: Any) -> None:
        assert self.held is not None
        self.hold = False
        self.held.set_result(value)


class _KV(_Held):
    async def tail(self, log: str, limit: int) -> list[str]:
        return await self.call([])  # type: ignore[no-any-return]

    async def get(self, key: str) -> str | None:
        return await self.call(None)  # type: ignore[no-any-return]

    async def set(self, key: str, value: str) -> None:
        await self.call(None)


class _PolicyStore(_Held):
    identity = "test"

    def known(self) -> None:
        return None

    async def load(self) -> Snapshot:
        return await self.call(Snapshot(1, ()))  # type: ignore[no-any-return]


class _Chooser:
    def set_policies(self, policies: PolicySet) -> None:
        pass


async def test_the_key_store_stops_when_its_cancel_lands_as_a_store_call_answers() -> None:
    kv = _KV()
    store = KVKeyStore(kv, refresh_s=0.01)
    await store.start()
    kv.hold = True
    await asyncio.wait_for(kv.holding.wait(), STOP_S)  # the refresh loop waits on the store
    kv.answer([])  # the store answers ...
    await _stops(store.stop())  # ... as the stop's cancel lands (was: for ever)


async def test_the_policy_sync_stops_when_its_cancel_lands_as_a_load_answers() -> None:
    store = _PolicyStore()
    sync = PolicySync(store, _Chooser(), None, interval_s=0.01)  # type: ignore[arg-type]
    await sync.start()
    store.hold = True
    await asyncio.wait_for(store.holding.wait(), STOP_S)
    store.answer(Snapshot(1, ()))
    await _stops(sync.stop())
