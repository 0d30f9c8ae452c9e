"""Tenants do not see each other: /debug/decisions shows a tenant key only its own tenant's
routing decisions (the admin sees all), and /metrics without a key carries no per-tenant
series (the admin's /metrics has them)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest

from gateway.app import create_app

KEYS = {"alpha": "sk-alpha", "beta": "sk-beta"}
ADMIN = "sk-admin-iso"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
async def gateway(stub_upstream: Callable[..., Awaitable[Any]], gateway_server: Callable[[Any], Awaitable[str]],
                  fake_adapter: Any, instance_factory: Any, config_factory: Any) -> AsyncIterator[httpx.AsyncClient]:
    stub = await stub_upstream()
    config = config_factory(tenants=[{"name": t, "api_keys": [k]} for t, k in KEYS.items()])
    config = config.model_copy(update={"admin_api_keys": [ADMIN]})
    app = create_app(config, [fake_adapter([instance_factory("i0", stub.url)])])
    async with httpx.AsyncClient(base_url=await gateway_server(app), timeout=10) as client:
        for tenant, key in KEYS.items():
            for n in range(2):
                r = await client.post("/v1/completions", headers=auth(key),
                                      json={"model": "m1", "prompt": f"{tenant} {n}", "max_tokens": 2})
                assert r.status_code == 200, r.text
        yield client


async def test_a_tenant_sees_only_its_own_decisions(gateway: httpx.AsyncClient) -> None:
    for tenant, key in KEYS.items():
        r = await gateway.get("/debug/decisions?limit=100", headers=auth(key))
        assert r.status_code == 200
        seen = {d["tenant"] for d in r.json()["decisions"]}
        assert seen == {tenant}, f"{tenant} saw {seen}"
        assert len(r.json()["decisions"]) == 2
    r = await gateway.get("/debug/decisions?limit=1", headers=auth(KEYS["alpha"]))
    assert [d["tenant"] for d in r.json()["decisions"]] == ["alpha"]  # the limit counts own decisions


async def test_the_admin_sees_every_tenants_decisions_and_strangers_none(gateway: httpx.AsyncClient) -> None:
    r = await gateway.get("/debug/decisions?limit=100", headers=auth(ADMIN))
    assert r.status_code == 200 and {d["tenant"] for d in r.json()["decisions"]} == set(KEYS)
    assert (await gateway.get("/debug/decisions")).status_code == 401
    assert (await gateway.get("/debug/decisions", headers=auth("sk-nobody"))).status_code == 401


def tenant_values(text: str) -> set[str]:
    return set(re.findall(r'tenant="([^"]*)"', text))


async def test_metrics_without_a_key_carry_no_tenant_series(gateway: httpx.AsyncClient) -> None:
    for headers in ({}, auth(KEYS["alpha"])):  # a scraper, or a tenant's key: the public view
        r = await gateway.get("/metrics", headers=headers)
        assert r.status_code == 200
        assert tenant_values(r.text) == set(), tenant_values(r.text)
        assert "alpha" not in r.text and "beta" not in r.text
        # the fleet-wide totals are still there, summed over tenants
        total = re.search(r'tokenfleet_goodput_requests_total\{class="interactive",result="arrived"\} (\S+)', r.text)
        assert total is not None and float(total.group(1)) == 4.0, r.text
        assert "tokenfleet_requests_total" in r.text


async def test_the_admin_scrapes_per_tenant_series(gateway: httpx.AsyncClient) -> None:
    r = await gateway.get("/metrics", headers=auth(ADMIN))
    assert r.status_code == 200 and tenant_values(r.text) == set(KEYS)
    assert 'tokenfleet_goodput_requests_total{class="interactive",result="arrived",tenant="alpha"} 2.0' in r.text
    assert 'tokenfleet_slo_attainment{class="interactive",tenant="beta"}' in r.text
    assert (await gateway.get("/metrics", headers=auth("sk-nobody"))).status_code == 401
