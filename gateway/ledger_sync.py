"""The goodput ledger aggregated over the gateway's replicas in Redis.

Each replica keeps its own ledger (SLOMax books every request there, purely) and, every
`ledger_push_s`, writes what changed to Redis in one pipelined MULTI/EXEC: per wall-clock
window one hash `{prefix}:ledger:{window}` whose fields are `replica|tenant|class|counter`
holding that replica's *absolute* figure (HSET, not HINCRBY: a push whose reply was lost
can be sent again without counting twice), and a sorted set of the windows. The report
(`/v1/reports/goodput`) sums the fields over replicas: the same totals from any replica,
behind by at most one push period of the others (its own figures are pushed first).
Windows expire after the ledger's `keep_windows`.

Windows: the ledger books by the gateway's monotonic clock; each replica maps its windows
to wall-clock ones by its own offset (wall - monotonic, fixed at start), rounded to the
nearest window, so a request may land one window off on another replica's report; totals
are exact. Without Redis (or while it is down) the report is this replica's ledger, as for
a single gateway, and says so (`"source": "local"`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection
from typing import Any

from gateway.background import cancel_and_wait
from gateway.policy_store import StoreUnavailable
from gateway.shared_state import SharedRedis
from slomax.ledger import COUNTERS, Cell, GoodputLedger

log = logging.getLogger("tokenfleet.gateway")
_SEP = "|"


def _fields(cell: Cell) -> dict[str, int]:
    out = {k: getattr(cell, k) for k in COUNTERS}
    out.update({f"rej:{r}": n for r, n in cell.rejected_by.items()})
    return out


class LedgerSync:
    def __init__(self, shared: SharedRedis, ledger: GoodputLedger, clock: Callable[[], float]) -> None:
        self.shared = shared
        self.ledger = ledger
        self.window_s = ledger.window_s
        self._offset = time.time() - clock()  # wall - monotonic: this replica's window mapping
        self._pushed: dict[tuple[int, str, str], dict[str, int]] = {}  # what Redis holds of ours
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    def _wall_window(self, w: int) -> int:
        return round((w * self.window_s + self._offset) / self.window_s)

    async def push(self) -> None:
        """Write every cell that changed since the last push (one round trip)."""
        async with self._lock:
            changed: dict[tuple[int, str, str], dict[str, int]] = {}
            for w in self.ledger.windows():
                for (tenant, cls), cell in self.ledger.window_cells(w).items():
                    key = (w, tenant, cls)
                    now = _fields(cell)
                    if self._pushed.get(key) != now:
                        changed[key] = now
            live = set(self.ledger.windows())
            for key in [k for k in self._pushed if k[0] not in live]:  # windows the ledger dropped
                del self._pushed[key]
            if not changed:
                return
            ttl_ms = round(self.window_s * (self.ledger.keep_windows + 1) * 1000)
            rid = self.shared.replica_id
            async with self.shared.redis.pipeline(transaction=True) as pipe:
                for (w, tenant, cls), figures in changed.items():
                    ww = self._wall_window(w)
                    hkey = self.shared.key("ledger", str(ww))
                    pipe.hset(hkey, mapping={_SEP.join((rid, tenant, cls, k)): v for k, v in figures.items()})
                    pipe.pexpire(hkey, ttl_ms)
                    pipe.zadd(self.shared.key("ledger", "windows"), {str(ww): ww})
                oldest = self._wall_window(self.ledger.windows()[0]) - 1 if self.ledger.windows() else 0
                pipe.zremrangebyscore(self.shared.key("ledger", "windows"), "-inf",
                                      min(oldest, round(time.time() / self.window_s) - self.ledger.keep_windows))
                await self.shared.call("ledger_push", pipe.execute())
            self._pushed.update(changed)

    async def report(self, *, tenants: Collection[str] | None, request_class: str | None,
                     since_unix: float | None, per_window: bool) -> list[dict[str, Any]]:
        """The fleet-wide report rows, windows in unix time (StoreUnavailable: use the local ledger)."""
        await self.push()
        lo = "-inf" if since_unix is None else str(int(since_unix // self.window_s))
        windows = await self.shared.call("ledger_read", self.shared.redis.zrangebyscore(
            self.shared.key("ledger", "windows"), lo, "+inf"))
        async with self.shared.redis.pipeline(transaction=False) as pipe:
            for ww in windows:
                pipe.hgetall(self.shared.key("ledger", ww))
            hashes = await self.shared.call("ledger_read", pipe.execute()) if windows else []
        merged = GoodputLedger(self.window_s, keep_windows=max(1, len(windows)))
        for ww, fields in zip(windows, hashes):
            cells: dict[tuple[str, str], Cell] = {}
            for name, value in fields.items():
                try:
                    _, tenant, cls, counter = name.split(_SEP, 3)
                    n = int(value)
                except ValueError:
                    continue  # not ours to read: skip rather than fail the report
                cell = cells.setdefault((tenant, cls), Cell())
                if counter.startswith("rej:"):
                    cell.rejected_by[counter[4:]] = cell.rejected_by.get(counter[4:], 0) + n
                elif counter in COUNTERS:
                    setattr(cell, counter, getattr(cell, counter) + n)
            for (tenant, cls), cell in cells.items():
                merged.merge_cell(int(ww), tenant, cls, cell)
        return merged.report(tenants=tenants, request_class=request_class, since=since_unix, per_window=per_window)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="ledger-push")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.shared.settings.ledger_push_s)
            if not self.shared.up:
                continue  # the heartbeat probes; the ledger keeps everything meanwhile
            try:
                await self.push()
            except StoreUnavailable:
                pass
            except Exception:  # a bug must not end the pushes
                log.exception("goodput ledger push failed")

    async def stop(self) -> None:
        await cancel_and_wait([self._task])
        self._task = None
        try:  # the last figures, so the others' reports include them
            await self.push()
        except StoreUnavailable:
            pass
