"""Residency fails closed when the policy store fails: a real redis-server (restarted empty, killed,
SIGSTOPped), the real gateway on uvicorn, stub engines in a US and an EU site.

eu-team enters from us-east, so without its EU-only policy the gateway would serve it in
us-east-1 (the nearest site): every check below sends it many requests and reads
`x-tokenfleet-site` on each. On the code before this change every test here fails: Redis
restarted empty was re-seeded from the fleet file (version 1, no policies, eu-team in
us-east-1), admin calls answered 500 (Redis down) or hung (Redis stopped), a gateway started
against a hung Redis routed unrestricted, an older version in Redis was applied, and an
in-process store forgot admin changes on restart.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleetcore.fleet_config import FleetConfig, parse_fleet
from gateway.app import create_app
from gateway.policy_store import RedisPolicyStore
from tests.conftest import FakeAdapter, StubUpstream, make_instance
from tests.redis_control import RedisProc
from gateway.embedded import serve_app

ADMIN = {"Authorization": "Bearer sk-admin"}
EU_TEAM = {"Authorization": "Bearer sk-eu", "x-tokenfleet-region": "us-east"}
DEV = {"Authorization": "Bearer sk-dev"}
MODEL = "m1"
EU_ONLY = {"allowed_jurisdictions": ["eu"], "description": "EU data stays in the EU"}
STORE_TIMEOUT_S = 0.5
PREFIX = "tokenfleet:region-policies"


@pytest.fixture
def redis_proc(tmp_path: Path) -> Iterator[RedisProc]:
    r = RedisProc(tmp_path)
    r.start()
    try:
        yield r
    finally:
        r.stop()


# --- the gateway ---

def fleet(state_dir: Path) -> FleetConfig:
    return parse_fleet({
        "regions": ["us-east", "eu-west"], "default_region": "us-east",
        "sites": [
            {"name": "us-east-1", "region": "us-east", "jurisdiction": "us", "rtt_ms": {"us-east": 1, "eu-west": 75}},
            {"name": "eu-west-1", "region": "eu-west", "jurisdiction": "eu", "rtt_ms": {"us-east": 75, "eu-west": 1}},
        ],
        "models": [{"name": MODEL, "versions": ["v1"], "engine": {"spec": "llama-3.1-8b", "max_model_len": 4096}}],
        "tenants": [{"name": "dev", "api_keys": ["sk-dev"], "region": "us-east"},
                    {"name": "eu-team", "api_keys": ["sk-eu"], "region": "us-east"}],
        "admin_api_keys": ["sk-admin"],
        "gateway": {"store_timeout_s": STORE_TIMEOUT_S, "state_dir": str(state_dir)},
    })


@pytest.fixture
async def engines(stub_upstream: Any) -> list[StubUpstream]:
    return [await stub_upstream(chunks=1, delay_s=0.0), await stub_upstream(chunks=1, delay_s=0.0)]


@asynccontextmanager
async def gateway(state_dir: Path, engines: list[StubUpstream], redis_url: str | None) -> AsyncIterator[str]:
    config = fleet(state_dir)
    adapter = FakeAdapter([make_instance("use1-0", engines[0].url, site="us-east-1"),
                           make_instance("euw1-0", engines[1].url, site="eu-west-1")])
    store = RedisPolicyStore(redis_url, config.region_policies, timeout_s=STORE_TIMEOUT_S) if redis_url else None
    try:
        async with serve_app(create_app(config, [adapter], poll_interval_s=0.1, policy_store=store)) as url:
            yield url
    finally:
        if store is not None:
            await store.close()


async def sites_of(c: httpx.AsyncClient, url: str, key: dict[str, str], n: int = 30) -> list[tuple[int, str | None, str | None]]:
    """(status, serving site, error code) of n small requests."""
    out = []
    for _ in range(n):
        r = await c.post(f"{url}/v1/completions", headers=key, json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
        code = r.json()["error"]["code"] if r.status_code >= 400 else None
        out.append((r.status_code, r.headers.get("x-tokenfleet-site"), code))
    return out


async def put_eu_only(c: httpx.AsyncClient, url: str) -> int:
    r = await c.put(f"{url}/admin/v1/region-policies/eu-team/*", headers=ADMIN, json=EU_ONLY)
    assert r.status_code == 201, r.text
    return int(r.json()["version"])


async def eventually(check: Any, timeout_s: float = 10.0, every_s: float = 0.05) -> Any:
    """Poll `check()` (async, returns a truthy value when done) until it holds or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = await check()
        if result:
            return result
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(every_s)


class Watcher:
    """eu-team traffic in the background while the store fails: records where each request ran."""

    def __init__(self, c: httpx.AsyncClient, url: str) -> None:
        self.seen: list[tuple[int, str | None, str | None]] = []
        self._task = asyncio.create_task(self._run(c, url))

    async def _run(self, c: httpx.AsyncClient, url: str) -> None:
        while True:
            self.seen.extend(await sites_of(c, url, EU_TEAM, 1))
            await asyncio.sleep(0.01)

    async def stop(self) -> list[tuple[int, str | None, str | None]]:
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        return self.seen


def only_eu(seen: list[tuple[int, str | None, str | None]]) -> None:
    served = [s for status, s, _ in seen if status == 200]
    assert served and set(served) == {"eu-west-1"}, sorted(set(served))


# --- (a) Redis restarted empty ---

@pytest.mark.slow
async def test_redis_restarted_empty_restores_the_last_known_good_policies(
        tmp_path: Path, redis_proc: RedisProc, engines: list[StubUpstream]) -> None:
    async with gateway(tmp_path / "state", engines, redis_proc.url) as url, httpx.AsyncClient(timeout=10) as c:
        assert {s for _, s, _ in await sites_of(c, url, EU_TEAM, 5)} == {"us-east-1"}  # no policy yet: nearest
        version = await put_eu_only(c, url)
        assert version == 2
        only_eu(await sites_of(c, url, EU_TEAM))
        watcher = Watcher(c, url)
        redis_proc.stop()
        redis_proc.start()  # empty

        async def restored() -> Any:
            r = await c.get(f"{url}/admin/v1/region-policies", headers=ADMIN)
            return r.status_code == 200 and r.json()

        body = await eventually(restored)
        assert body["version"] == 2 and [p["tenant"] for p in body["policies"]] == ["eu-team"]
        assert body["policies"][0]["allowed_jurisdictions"] == ["eu"]
        only_eu(await sites_of(c, url, EU_TEAM, 40))
        seen = await watcher.stop()
        only_eu(seen)
        assert all(status == 200 for status, _, _ in seen), seen  # routing never stopped
        audit = (await c.get(f"{url}/admin/v1/audit", headers=ADMIN)).json()["entries"]
        assert audit[0]["action"] == "restore" and audit[0]["version"] == 2
        assert "empty" in audit[0]["after"]["reason"]
        assert (audit[1]["action"], audit[1]["tenant"]) == ("create", "eu-team")
        with redis_proc.client() as r:  # the store itself holds the restored state
            assert r.get(f"{PREFIX}:version") == "2" and "eu-team" in r.get(f"{PREFIX}:policies")
        # the restored store takes admin writes again, on top of the restored version
        r2 = await c.put(f"{url}/admin/v1/region-policies/dev/*", headers=ADMIN, json={"allowed_jurisdictions": ["us"]})
        assert r2.status_code == 201 and r2.json()["version"] == 3


# --- (b) Redis down or hung under a running gateway ---

async def timed_admin_calls(c: httpx.AsyncClient, url: str) -> list[tuple[int, str, str | None, float]]:
    calls = [("GET", "/admin/v1/region-policies", None), ("GET", "/admin/v1/region-policies/eu-team/*", None),
             ("PUT", "/admin/v1/region-policies/dev/*", {"allowed_jurisdictions": ["us"]}),
             ("DELETE", "/admin/v1/region-policies/eu-team/*", None), ("GET", "/admin/v1/audit", None)]
    out = []
    for method, path, body in calls:
        t0 = time.monotonic()
        r = await c.request(method, f"{url}{path}", headers=ADMIN, json=body)
        took = time.monotonic() - t0
        out.append((r.status_code, r.json()["error"]["code"] if r.status_code >= 400 else "",
                    r.headers.get("retry-after"), took))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["killed", "hung"])
async def test_store_down_keeps_routing_and_admin_fails_fast(
        tmp_path: Path, redis_proc: RedisProc, engines: list[StubUpstream], failure: str) -> None:
    async with gateway(tmp_path / "state", engines, redis_proc.url) as url, httpx.AsyncClient(timeout=10) as c:
        await put_eu_only(c, url)
        if failure == "killed":
            redis_proc.stop()
        else:
            redis_proc.pause()
        results = await timed_admin_calls(c, url)
        for status, code, retry_after, took in results:
            assert (status, code) == (503, "policy_store_unavailable"), results
            assert retry_after is not None and int(retry_after) >= 1
            assert took < STORE_TIMEOUT_S + 1.0, results  # bounded by the store timeout, never a hang
        only_eu(await sites_of(c, url, EU_TEAM, 40))
        assert {s for _, s, _ in await sites_of(c, url, DEV, 5)} == {"us-east-1"}  # unrestricted tenant still served
        # the dry-run needs no store: it still answers, with the last known policies
        dry = await c.post(f"{url}/admin/v1/dry-run", headers=ADMIN,
                           json={"model": MODEL, "tenant": "eu-team", "region": "us-east"})
        assert dry.status_code == 200 and dry.json()["allowed_sites"] == ["eu-west-1"]
        if failure == "hung":
            redis_proc.resume()

            async def answers() -> bool:
                r = await c.get(f"{url}/admin/v1/region-policies", headers=ADMIN)
                return r.status_code == 200 and r.json()["version"] == 2

            await eventually(answers)


# --- (c) Redis hung when a gateway starts ---

@pytest.mark.slow
async def test_gateway_started_against_a_hung_store_serves_its_snapshot(
        tmp_path: Path, redis_proc: RedisProc, engines: list[StubUpstream]) -> None:
    state = tmp_path / "state"
    async with gateway(state, engines, redis_proc.url) as url, httpx.AsyncClient(timeout=10) as c:
        await put_eu_only(c, url)
    assert list(state.glob("region-policies-*.json")), "no snapshot on disk"
    redis_proc.pause()
    async with gateway(state, engines, redis_proc.url) as url, httpx.AsyncClient(timeout=10) as c:
        seen = await sites_of(c, url, EU_TEAM, 40)
        assert all(status == 200 for status, _, _ in seen), seen
        only_eu(seen)
        t0 = time.monotonic()
        r = await c.get(f"{url}/admin/v1/region-policies", headers=ADMIN)
        assert r.status_code == 503 and time.monotonic() - t0 < STORE_TIMEOUT_S + 1.0


@pytest.mark.slow
async def test_gateway_started_against_a_hung_store_without_snapshot_refuses_then_resumes(
        tmp_path: Path, redis_proc: RedisProc, engines: list[StubUpstream]) -> None:
    async with gateway(tmp_path / "first", engines, redis_proc.url) as url, httpx.AsyncClient(timeout=10) as c:
        await put_eu_only(c, url)  # the store holds the EU-only policy (version 2)
    redis_proc.pause()
    async with gateway(tmp_path / "empty", engines, redis_proc.url) as url, httpx.AsyncClient(timeout=10) as c:
        for key in (EU_TEAM, DEV):
            t0 = time.monotonic()
            r = await c.post(f"{url}/v1/completions", headers=key, json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
            assert r.status_code == 503 and time.monotonic() - t0 < 1.0, r.text
            assert r.json()["error"]["code"] == "region_policy_unavailable" and int(r.headers["retry-after"]) >= 1
            assert "x-tokenfleet-site" not in r.headers
        refused = await sites_of(c, url, EU_TEAM, 20)
        assert {(status, code) for status, _, code in refused} == {(503, "region_policy_unavailable")}
        assert engines[0].requests == [] and engines[1].requests == []  # nothing reached any engine
        watcher = Watcher(c, url)
        redis_proc.resume()

        async def serving() -> bool:
            return any(status == 200 for status, _, _ in watcher.seen)

        await eventually(serving)
        only_eu(await sites_of(c, url, EU_TEAM, 40))
        seen = await watcher.stop()
        only_eu(seen)
        assert {code for status, _, code in seen if status != 200} <= {"region_policy_unavailable"}
        assert {s for _, s, _ in await sites_of(c, url, DEV, 5)} == {"us-east-1"}


# --- (d) an older version in the store ---

async def test_an_older_version_in_the_store_is_never_applied(
        tmp_path: Path, redis_proc: RedisProc, engines: list[StubUpstream]) -> None:
    async with gateway(tmp_path / "state", engines, redis_proc.url) as url, httpx.AsyncClient(timeout=10) as c:
        await put_eu_only(c, url)
        watcher = Watcher(c, url)
        with redis_proc.client() as r:  # an old backup comes back: version 1, no policies
            r.mset({f"{PREFIX}:version": 1, f"{PREFIX}:policies": "[]"})

            async def healed_or_leaked() -> bool:
                leaked = any(status == 200 and site != "eu-west-1" for status, site, _ in watcher.seen)
                return leaked or (r.get(f"{PREFIX}:version") == "2"
                                  and "eu-team" in (r.get(f"{PREFIX}:policies") or ""))

            await eventually(healed_or_leaked)
            only_eu(watcher.seen)
            assert r.get(f"{PREFIX}:version") == "2"
        # several poll intervals more of traffic after the store went back and was healed
        only_eu(await sites_of(c, url, EU_TEAM, 40))
        seen = await watcher.stop()
        only_eu(seen)
        assert all(status == 200 for status, _, _ in seen)
        body = (await c.get(f"{url}/admin/v1/region-policies", headers=ADMIN)).json()
        assert body["version"] == 2 and body["policies"][0]["tenant"] == "eu-team"
        audit = (await c.get(f"{url}/admin/v1/audit", headers=ADMIN)).json()["entries"]
        assert audit[0]["action"] == "restore" and audit[0]["before"] == {"version": 1}


# --- a single gateway (no Redis) keeps admin changes across a restart ---

async def test_in_process_store_survives_a_restart(tmp_path: Path, engines: list[StubUpstream]) -> None:
    state = tmp_path / "state"
    async with gateway(state, engines, None) as url, httpx.AsyncClient(timeout=10) as c:
        assert await put_eu_only(c, url) == 2
    async with gateway(state, engines, None) as url, httpx.AsyncClient(timeout=10) as c:
        body = (await c.get(f"{url}/admin/v1/region-policies", headers=ADMIN)).json()
        assert body["version"] == 2 and body["policies"][0]["allowed_jurisdictions"] == ["eu"]
        audit = (await c.get(f"{url}/admin/v1/audit", headers=ADMIN)).json()["entries"]
        assert (audit[0]["action"], audit[0]["tenant"]) == ("create", "eu-team")
        only_eu(await sites_of(c, url, EU_TEAM, 20))
