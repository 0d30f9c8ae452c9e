"""A replica (re)started while Redis is down does not assume it is alone: it takes the last replica
count it knew from its state dir (written while Redis answered, bounded age) and enforces
budget / that count. Real gateway apps on a real redis-server, then the same server stopped."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from fleetcore.fleet_config import GatewaySettings
from gateway.app import create_app
from gateway.shared_state import RosterFile, SharedRedis
from tests.redis_control import RedisProc
from tests.test_shared_state import (N, R, Gateways, Start, fire, fleet, gateways, metric,  # noqa: F401
                                     redis_proc, three, until)


async def test_a_replica_restarted_while_redis_is_down_enforces_its_share_of_the_last_known_count(
        three: Start, gateways: Gateways, redis_proc: RedisProc, stub_upstream: Any, fake_adapter: Any,
        instance_factory: Any, tmp_path: Path) -> None:
    urls, apps = await three(redis_proc.url)
    rosters = [a.state.replicas.shared for a in apps]

    async def all_stored() -> bool:
        return all(r.live == N and r.roster_file is not None and r.roster_file.read() == N for r in rosters)
    await until(all_stored, 5)
    redis_proc.stop()
    await gateways.stop(0)  # replica 0 goes down while Redis is down...
    up = await stub_upstream(chunks=1, delay_s=0.0)
    app = create_app(fleet(tmp_path / "state0", redis_proc.url),  # ...and comes back on its state dir
                     [fake_adapter([instance_factory("i0", up.url)])], poll_interval_s=60)
    url = await gateways.start(app)
    assert app.state.replicas.shared.live == N
    assert await metric(url, "tokenfleet_replicas_live ") == N
    t0 = time.monotonic()
    statuses = await fire([url], R)  # alone it would admit the whole R
    elapsed = time.monotonic() - t0
    admitted = statuses.count(200)
    share = R / N * (1 + elapsed / 60)
    assert set(statuses) <= {200, 429}
    assert 0.9 * R / N <= admitted <= share + 1, (admitted, elapsed)
    assert await metric(url, 'tokenfleet_budget_mode{mode="local_share"}') == 1.0


def settings() -> GatewaySettings:
    return GatewaySettings(redis_prefix="roster-test", store_timeout_s=0.2)


async def test_without_a_recent_count_a_replica_started_without_redis_is_alone(tmp_path: Path) -> None:
    down = RedisProc(tmp_path)  # a port nobody listens on
    now = 1_000_000.0
    path = tmp_path / "replicas.json"
    path.write_text(json.dumps({"live": 4, "saved_unix": now - 3601}))
    shared = SharedRedis(down.url, settings(), roster_file=RosterFile(path, max_age_s=3600, wall=lambda: now))
    await shared.start()
    try:
        assert not shared.up and shared.live == 1  # too old to trust: the fleet may have been resized
    finally:
        await shared.stop()
    path.write_text(json.dumps({"live": 4, "saved_unix": now - 3599}))
    shared = SharedRedis(down.url, settings(), roster_file=RosterFile(path, max_age_s=3600, wall=lambda: now))
    await shared.start()
    try:
        assert shared.live == 4
    finally:
        await shared.stop()
    path.write_text("{not json")
    assert RosterFile(path, wall=lambda: now).read() is None


async def test_the_count_is_written_when_it_changes_and_refreshed_when_old(tmp_path: Path) -> None:
    clock = [1000.0]
    path = tmp_path / "replicas.json"
    roster = RosterFile(path, refresh_s=60, wall=lambda: clock[0])
    await roster.note(3)
    assert json.loads(path.read_text()) == {"live": 3, "saved_unix": 1000.0}
    clock[0] = 1030.0
    await roster.note(3)  # unchanged and fresh: not rewritten
    assert json.loads(path.read_text())["saved_unix"] == 1000.0
    await roster.note(2)  # changed: written at once
    assert json.loads(path.read_text()) == {"live": 2, "saved_unix": 1030.0}
    clock[0] = 1091.0
    await roster.note(2)  # unchanged but old: refreshed, so its age stays true
    assert json.loads(path.read_text()) == {"live": 2, "saved_unix": 1091.0}
    assert roster.read() == 2
