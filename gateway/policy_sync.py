"""Keeps the site chooser on the newest region policies this gateway can know; residency fails closed.

`PolicySync` polls the policy store, hands each newer version to the site chooser (never an
older one), and keeps the store's known state (version, policies, audit tail) durably on
local disk (`gateway.policy_snapshot`). At start it reads that file, so a gateway that
cannot reach its store serves from the last persisted snapshot.

A gateway that has neither — a policy store it cannot reach and no snapshot on disk —
does not know the policy of *any* tenant: a policy may exist for any tenant, or for `*`,
and the fleet file's policies are only the seed of a new store, not proof of the current
ones. Until the store first answers, `GuardedSiteChooser` therefore refuses every request
that needs a site (503 `region_policy_unavailable`, with `Retry-After`), whatever its
tenant; it never routes unrestricted. Service resumes on the first poll that reaches the
store. A gateway that once knew its policies keeps them while the store is down.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Collection

from fleetcore.fleet_config import FleetConfig
from fleetcore.policies import SiteChooser
from fleetcore.region_policy import PolicySet, Residency
from fleetcore.types import FleetView, RequestOutcome, RequestProfile, SiteDecision
from gateway.background import cancel_and_wait
from gateway.errors import SERVER_ERROR, GatewayError
from gateway.admin_store import SqliteKV, SqlitePolicyStore
from gateway.policy_snapshot import SnapshotFile, state_dir
from gateway.policy_store import KnownState, PolicyStore, Snapshot, StoreUnavailable, fleet_identity

log = logging.getLogger("tokenfleet.gateway")

# A disk that does not finish a small write in this long is reported; the next poll retries.
_DISK_TIMEOUT_S = 5.0


def region_policy_unavailable(retry_after_s: int) -> GatewayError:
    return GatewayError(
        503, "This gateway cannot tell where the request may run: its region policy store is unreachable "
             "and it has no saved copy of the policies. Refused rather than routed unrestricted; retry shortly.",
        type=SERVER_ERROR, code="region_policy_unavailable", headers={"Retry-After": str(retry_after_s)})


def policy_store_unavailable(detail: str, retry_after_s: int) -> GatewayError:
    return GatewayError(503, f"The region policy store is unavailable: {detail}. Retry shortly.",
                        type=SERVER_ERROR, code="policy_store_unavailable",
                        headers={"Retry-After": str(retry_after_s)})


class PolicySync:
    def __init__(self, store: PolicyStore, chooser: SiteChooser, snapshot_file: SnapshotFile | None, *,
                 interval_s: float = 0.5, retry_after_s: int = 1) -> None:
        self.store = store
        self.interval_s = interval_s
        self.retry_after_s = retry_after_s
        self._chooser = chooser
        self._file = snapshot_file
        self._applied = -1
        self._persisted: KnownState | None = None
        self._write_lock = asyncio.Lock()
        self._store_ok = True
        self._refused = False  # a load failed while nothing was known: requests were refused
        self._task: asyncio.Task[None] | None = None
        on_disk = snapshot_file.read() if snapshot_file is not None else None
        if on_disk is not None:
            store.remember(on_disk)  # also the version floor: the store never goes below it
            self._persisted = on_disk
            log.info("region policies: version %d from %s", on_disk.version, snapshot_file.path)  # type: ignore[union-attr]
        state = store.known()
        self.known = state is not None  # False: refuse routing until the store answers
        if state is not None:
            self._apply(state.snapshot)

    def _apply(self, snap: Snapshot) -> None:
        if snap.version <= self._applied:
            return  # versions only go forward
        self._applied = snap.version
        self._chooser.set_policies(PolicySet(snap.policies, snap.version))

    async def accept(self, snap: Snapshot) -> None:
        """A snapshot read from (or just committed to) the store: route by it and keep it on disk."""
        self._apply(snap)
        if not self.known:
            if self._refused:
                log.warning("region policies: the store answered (version %d); serving again", snap.version)
            else:  # (the first answer at start-up: nothing was refused, nothing to warn of)
                log.info("region policies: version %d from the store", snap.version)
        self.known = True
        await self.persist()

    async def persist(self) -> None:
        if self._file is None:
            return
        async with self._write_lock:  # one writer at a time, and always the newest state
            state = self.store.known()
            if state is None or _same(state, self._persisted):
                return
            try:
                await asyncio.wait_for(asyncio.to_thread(self._file.write, state), _DISK_TIMEOUT_S)
                self._persisted = state
            except (OSError, TimeoutError, asyncio.TimeoutError) as e:
                log.error("region policies: cannot save the snapshot %s (%s); will retry", self._file.path, e)

    async def sync_once(self) -> bool:
        """One poll; True when the store answered."""
        try:
            snap = await self.store.load()
        except StoreUnavailable as e:
            if self._store_ok:
                log.warning("region policies: %s; %s", e, "keeping version %d" % self._applied if self.known
                            else "refusing requests until it answers (no saved snapshot)")
            self._store_ok = False
            self._refused = self._refused or not self.known
            return False
        if not self._store_ok:
            log.warning("region policies: the store is reachable again")
        self._store_ok = True
        await self.accept(snap)
        return True

    async def start(self) -> None:
        """First poll now (bounded by the store's timeout), then every `interval_s`."""
        await self.sync_once()
        self._task = asyncio.create_task(self._run(), name="region-policies")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sync_once()
            except Exception:  # a bug must not end the watch: the next poll tries again
                log.exception("region policy sync failed")

    async def stop(self) -> None:
        # Cancelled until it ends: a store call (`asyncio.wait_for`) swallows a cancel that lands
        # as it completes (Python 3.11), and the poll loop went on: a plain `await` waited for ever.
        task, self._task = self._task, None
        await cancel_and_wait([task])


def _same(a: KnownState, b: KnownState | None) -> bool:
    # A restore adds an audit entry at the same version: compare the newest entry too.
    return b is not None and a.version == b.version and a.audit[:1] == b.audit[:1]


class GuardedSiteChooser(SiteChooser):
    """The site chooser, refusing to choose while the gateway knows no region policies; the
    rest of the contract goes straight to the chooser it guards."""

    def __init__(self, inner: SiteChooser, sync: PolicySync) -> None:
        self.inner = inner
        self.name = inner.name
        self._sync = sync

    def choose(self, profile: RequestProfile, view: FleetView, now: float,
               exclude_instances: Collection[str] = ()) -> SiteDecision:
        if not self._sync.known:
            raise region_policy_unavailable(self._sync.retry_after_s)
        return self.inner.choose(profile, view, now, exclude_instances=exclude_instances)

    def observe(self, outcome: RequestOutcome) -> None:
        self.inner.observe(outcome)

    def residency(self, profile: RequestProfile, view: FleetView) -> Residency | None:
        return self.inner.residency(profile, view)

    def set_policies(self, policies: PolicySet) -> None:
        self.inner.set_policies(policies)

    def with_policies(self, policies: PolicySet) -> SiteChooser:
        return self.inner.with_policies(policies)


def build_policy_sync(config: FleetConfig, store: PolicyStore | None, chooser: SiteChooser,
                      interval_s: float = 0.5) -> PolicySync:
    """The gateway's policy sync over `store` (None: a SQLite store for one gateway, per fleet,
    under the state directory), with its snapshot file under the state directory."""
    directory = state_dir(config.gateway.state_dir)
    if store is None:
        # One replica: the durable admin store, a SQLite file per fleet (gateway.admin_store). The
        # lineage keeps the in-process store's name, so a gateway upgraded in place keeps its snapshot.
        fleet_id = fleet_identity([s.name for s in config.sites], [t.name for t in config.tenants],
                                  [m.name for m in config.models], config.region_policies)
        identity = "memory#" + fleet_id
        snapshot_file = SnapshotFile(directory, identity)
        kv = SqliteKV(directory / f"admin-{fleet_id}.sqlite3", timeout_s=config.gateway.store_timeout_s)
        store = SqlitePolicyStore(kv, config.region_policies, identity=identity, known=snapshot_file.read())
    else:
        snapshot_file = SnapshotFile(directory, store.identity)
    retry_after = max(1, math.ceil(max(interval_s, config.gateway.store_timeout_s)))
    return PolicySync(store, chooser, snapshot_file, interval_s=interval_s, retry_after_s=retry_after)
