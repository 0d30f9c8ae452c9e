"""API keys by API across replicas (issue 18): real gateway apps (uvicorn, real sockets) on one real
redis-server — a key created on one replica works on another, a revocation or rotation on any
replica reaches all within 2 s, per-key budgets on top of the tenant's, 403 (not 401) for an
API-created key on admin endpoints — and one gateway without Redis keeping its keys across a restart."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import aiohttp

from tests.redis_control import RedisProc
from tests.test_shared_state import ADMIN_H, BODY, Gateways, Start, gateways, redis_proc, three, until  # noqa: F401


async def call(method: str, url: str, key: str | None = None, body: Any = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else ADMIN_H
    async with aiohttp.ClientSession() as s, s.request(method, url, json=body, headers=headers) as r:
        return r.status, await r.json(content_type=None)


async def chat(url: str, key: str) -> int:
    return (await call("POST", url + "/v1/chat/completions", key, BODY))[0]


async def create(url: str, **body: Any) -> dict[str, Any]:
    status, out = await call("POST", url + "/admin/v1/keys", body={"tenant": "a", **body})
    assert status == 201, out
    return out  # type: ignore[no-any-return]


async def refused_within(url: str, key: str, limit_s: float = 2.0) -> float:
    async def refused() -> bool:
        return await chat(url, key) == 401
    took = await until(refused, limit_s)
    assert took < limit_s
    return took


async def test_a_key_created_on_one_replica_works_everywhere_and_revocation_reaches_all(
        three: Start, redis_proc: RedisProc) -> None:
    urls, apps = await three(redis_proc.url)
    a, b, c = urls
    created = await create(a, name="ci")
    key, key_id = created["key"], created["id"]
    assert await chat(a, key) == 200  # at once on the replica that created it
    async def works_on_b_and_c() -> bool:  # each replica picks it up at its next refresh
        return await chat(b, key) == 200 and await chat(c, key) == 200
    assert await until(works_on_b_and_c, 2.0) < 2.0
    status, listing = await call("GET", c + "/admin/v1/keys")
    assert status == 200 and [k["id"] for k in listing["data"]] == [key_id]

    t0 = time.monotonic()
    status, revoked = await call("DELETE", f"{b}/admin/v1/keys/{key_id}")
    assert status == 200 and revoked["revoked"] is True
    assert await chat(b, key) == 401  # at once where it was revoked
    await refused_within(a, key, 2.0 - (time.monotonic() - t0))
    await refused_within(c, key, 2.0 - (time.monotonic() - t0))
    assert time.monotonic() - t0 < 2.0
    status, audit = await call("GET", a + "/admin/v1/keys/audit")
    assert [e["action"] for e in audit["data"] if e["key_id"] == key_id] == ["revoke", "create"]


async def test_rotation_on_one_replica_refuses_the_old_key_everywhere(three: Start, redis_proc: RedisProc) -> None:
    urls, apps = await three(redis_proc.url)
    a, b, c = urls
    created = await create(a)
    old, key_id = created["key"], created["id"]
    async def everywhere() -> bool:
        return all([await chat(u, old) == 200 for u in urls])
    await until(everywhere, 2.0)
    t0 = time.monotonic()
    status, rotated = await call("POST", f"{c}/admin/v1/keys/{key_id}/rotate")
    assert status == 200
    new = rotated["key"]
    for u in urls:
        await refused_within(u, old, 2.0 - (time.monotonic() - t0))
    assert time.monotonic() - t0 < 2.0
    assert all([await chat(u, new) == 200 for u in urls])


async def test_a_keys_budget_on_top_of_its_tenants(three: Start, redis_proc: RedisProc) -> None:
    urls, apps = await three(redis_proc.url, n=1)
    (a,) = urls
    limited = await create(a, budgets={"requests_per_minute": 2})
    other = await create(a)
    assert limited["budgets"] == {"requests_per_minute": 2}
    assert [await chat(a, limited["key"]) for _ in range(2)] == [200, 200]
    status, err = await call("POST", a + "/v1/chat/completions", limited["key"], BODY)
    assert status == 429 and err["error"]["code"] == "rate_limit_exceeded" and "API key" in err["error"]["message"]
    assert await chat(a, other["key"]) == 200  # the same tenant, another key: its budget is the tenant's


async def test_an_api_created_key_gets_403_on_admin_endpoints(three: Start, redis_proc: RedisProc) -> None:
    urls, apps = await three(redis_proc.url, n=1)
    (a,) = urls
    key = (await create(a))["key"]
    for method, path in (("GET", "/admin/v1/keys"), ("GET", "/admin/v1/region-policies"),
                         ("GET", "/admin/v1/audit")):
        status, err = await call(method, a + path, key)
        assert status == 403, (path, err)
    status, _ = await call("GET", a + "/admin/v1/keys", "sk-tf-nonsense")
    assert status == 401


async def test_one_gateway_without_redis_keeps_its_keys_across_a_restart(gateways: Gateways, stub_upstream: Any,
                                                                         fake_adapter: Any, instance_factory: Any,
                                                                         tmp_path: Path) -> None:
    from gateway.app import create_app
    from tests.test_shared_state import fleet

    up = await stub_upstream(chunks=1, delay_s=0.0)

    def app() -> Any:
        return create_app(fleet(tmp_path / "state", None), [fake_adapter([instance_factory("i0", up.url)])],
                          poll_interval_s=60)
    first = await gateways.start(app())
    created = await create(first, budgets={"tokens_per_minute": 100000})
    revoked = await create(first)
    await call("DELETE", f"{first}/admin/v1/keys/{revoked['id']}")
    assert await chat(first, created["key"]) == 200
    await gateways.stop(0)
    second = await gateways.start(app())  # a new app on the same state dir
    assert await chat(second, created["key"]) == 200
    assert await chat(second, revoked["key"]) == 401
    status, listing = await call("GET", second + "/admin/v1/keys")
    by_id = {k["id"]: k for k in listing["data"]}
    assert by_id[created["id"]]["budgets"] == {"tokens_per_minute": 100000}
    assert by_id[revoked["id"]]["revoked"] is True
