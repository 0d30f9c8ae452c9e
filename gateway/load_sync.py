"""Load in flight across gateway replicas: each replica's own dispatches plus the others' counts.

A replica knows exactly what it sent to each engine instance and not yet finished
(`FleetState.begin/end`); it knows nothing of what the other replicas sent. Every
`gateway.load_sync_s` (default 0.1 s) each replica writes its own per-instance counts to
Redis (one key per replica, expiring after a few periods, so a dead replica's streams stop
counting) and reads the others' in the same round trip (one script). The sum of the others'
lands in `InstanceState.remote_inflight`, which the routing snapshot adds to the replica's own
count: the policies that weigh in-flight counts (the peers) see one fleet-wide figure, at most
one period plus a round trip stale. TokenPilot does not read the count: it books each of the
others' dispatches itself, as it books its own, from the route-share records
(`gateway.route_share`, `InstanceRouter.note_dispatch`). Engine metrics (running, waiting, KV use), polled by every replica, stay the ground
truth for what the engines are doing; this only closes the gap between two polls.

The same round trip tells each replica its place in the roster (index among the live replicas'
ids, sorted, and their number): the router wrapper (`fleetcore.replica_spread.SpreadRouter`) uses
it so that replicas routing at the same instant, blind to each other for up to a period, pick
apart instead of all sending to the one instance each believes best.

Redis unreachable: the others' counts are dropped (each replica routes on its own dispatches
and the engines' metrics, as a single gateway does), the replica routes over the whole pool
as one does, and the next period tries again.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable

from fleetcore.replica_spread import ALONE, ReplicaSlot, SpreadRouter
from gateway.background import cancel_and_wait
from gateway.fleet_state import FleetState
from gateway.policy_store import StoreUnavailable
from gateway.shared_state import SharedRedis

log = logging.getLogger("tokenfleet.gateway")

# KEYS[1]: this replica's load key; KEYS[2]: the roster. ARGV: own counts (JSON), TTL in ms,
# own replica id, the load-key prefix. Returns the number of live replicas, this one's index
# among their sorted ids (-1: not in the roster yet), then the others' counts (JSON each).
_EXCHANGE = """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
local ids = redis.call('ZRANGE', KEYS[2], 0, -1)
table.sort(ids)
local out = {#ids, -1}
for i, id in ipairs(ids) do
  if id == ARGV[3] then
    out[2] = i - 1
  else
    local v = redis.call('GET', ARGV[4] .. id)
    if v then table.insert(out, v) end
  end
end
return out
"""

# A replica's counts outlive it by this many periods at most (then they expire in Redis).
_TTL_PERIODS = 5


def roster_slot(replicas: object, index: object) -> ReplicaSlot:
    """This replica's slot from the exchange's answer; ALONE when it is not (yet) in the roster."""
    if isinstance(replicas, int) and isinstance(index, int) and 0 <= index < replicas:
        return ReplicaSlot(replicas, index)
    return ALONE


def merge_remote(own_id: str, payloads: Iterable[str]) -> dict[str, int]:
    """Sum the other replicas' per-instance counts; a malformed payload is skipped, not trusted."""
    total: dict[str, int] = {}
    for raw in payloads:
        try:
            counts = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(counts, dict):
            continue
        for iid, n in counts.items():
            if isinstance(iid, str) and isinstance(n, int) and n > 0:
                total[iid] = total.get(iid, 0) + n
    return total


class LoadSync:
    """Exchanges in-flight counts with the other replicas every `period_s` (`start`/`stop`)."""

    def __init__(self, shared: SharedRedis, state: FleetState, period_s: float,
                 router: SpreadRouter | None = None) -> None:
        self.shared = shared
        self.state = state
        self.period_s = period_s
        self.router = router  # gets this replica's slot in the roster at every exchange
        self._script = shared.redis.register_script(_EXCHANGE)
        self._task: asyncio.Task[None] | None = None

    def own_counts(self) -> dict[str, int]:
        return {st.instance.instance_id: st.inflight for st in self.state.states() if st.inflight > 0}

    async def exchange(self) -> dict[str, int]:
        """One round trip: publish ours, read theirs, apply the sum. StoreUnavailable on failure."""
        s = self.shared
        ttl_ms = max(1, round(self.period_s * _TTL_PERIODS * 1000))
        own = json.dumps(self.own_counts(), separators=(",", ":"))
        answer = await s.call("load_sync", self._script(
            keys=[s.key("load", s.replica_id), s.key("replicas")],
            args=[own, ttl_ms, s.replica_id, s.key("load", "")]))
        remote = merge_remote(s.replica_id, answer[2:])
        self._apply(remote, roster_slot(*answer[:2]) if len(answer) >= 2 else ALONE)
        return remote

    def _apply(self, remote: dict[str, int], slot: ReplicaSlot) -> None:
        for st in self.state.states():
            st.remote_inflight = remote.get(st.instance.instance_id, 0)
        if self.router is not None:
            self.router.slot = slot

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="load-sync")

    async def _run(self) -> None:
        while True:
            try:
                await self.exchange()
            except StoreUnavailable:
                self._apply({}, ALONE)  # stale counts are worse than none: route on our own and the engines'
            except Exception:  # a bug must not end the exchange: the next period tries again
                log.exception("load sync failed")
            await asyncio.sleep(self.period_s)

    async def stop(self) -> None:
        await cancel_and_wait([self._task])
        self._task = None
