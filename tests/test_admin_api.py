"""FleetMind's ops admin API over a live gateway and three local sites of simulated workers:
auth, validation, versions and audit, dry-run, and a policy change that reroutes at once."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from fleetcore.fleet_config import load_fleet_file
from gateway.embedded import serve_fleet
from tests.waits import wait_until

FLEET_FILE = Path(__file__).with_name("fleet_3sites.yaml")
ADMIN = {"Authorization": "Bearer sk-admin"}
ACME = {"Authorization": "Bearer sk-acme"}
MODEL = "llama-3.1-8b"
BLOCK_SIZE = 16  # tests/fleet_3sites.yaml: engine block_size

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gateway() -> AsyncIterator[str]:
    async with serve_fleet(load_fleet_file(FLEET_FILE), poll_interval_s=0.2) as f:
        yield f.url


async def served(c: httpx.AsyncClient, url: str, key: dict[str, str], region: str | None = None) -> tuple[str, float]:
    """(site that served a small request, seconds it took)."""
    headers = dict(key)
    if region:
        headers["x-tokenfleet-region"] = region
    t0 = time.monotonic()
    r = await c.post(f"{url}/v1/completions", headers=headers, json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    return r.headers["x-tokenfleet-site"], time.monotonic() - t0


async def served_site(c: httpx.AsyncClient, url: str, key: dict[str, str], region: str | None = None) -> str:
    return (await served(c, url, key, region))[0]


async def test_auth(gateway: str) -> None:
    async with httpx.AsyncClient() as c:
        r = await c.get(f"{gateway}/admin/v1/region-policies")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await c.get(f"{gateway}/admin/v1/region-policies", headers=ACME)
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
        r = await c.get(f"{gateway}/admin/v1/region-policies", headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        r = await c.get(f"{gateway}/admin/v1/region-policies", headers=ADMIN)
        assert r.status_code == 200
        assert r.json()["policies"][0]["tenant"] == "globex"


async def test_validation_errors_name_the_field(gateway: str) -> None:
    async with httpx.AsyncClient() as c:
        for body, param, msg in [
            ({"allowed_jurisdictions": ["mars"]}, "allowed_jurisdictions", "unknown ['mars']"),
            ({"allowed_sites": []}, "allowed_sites", "empty"),
            ({"home_site": "euw1", "allowed_jurisdictions": ["us"]}, "home_site", "outside"),
            ({"spill": "sometimes"}, "spill", "boolean"),
            ({"colour": "red"}, "colour", "Extra inputs"),
        ]:
            r = await c.put(f"{gateway}/admin/v1/region-policies/acme/*", headers=ADMIN, json=body)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == param and msg in err["message"], err
        r = await c.put(f"{gateway}/admin/v1/region-policies/nobody/*", headers=ADMIN, json={})
        assert r.status_code == 400 and "unknown tenant" in r.json()["error"]["message"]
        r = await c.delete(f"{gateway}/admin/v1/region-policies/acme/nomodel", headers=ADMIN)
        assert r.status_code == 404


async def test_policy_change_reroutes_within_a_second_and_is_audited(gateway: str) -> None:
    async with httpx.AsyncClient(timeout=10) as c:
        assert await served_site(c, gateway, ACME) == "use1"  # home: nearest to us-east
        version = (await c.get(f"{gateway}/admin/v1/region-policies", headers=ADMIN)).json()["version"]
        t0 = time.monotonic()
        r = await c.put(f"{gateway}/admin/v1/region-policies/acme/*", headers={**ADMIN, "If-Match": str(version)},
                        json={"allowed_jurisdictions": ["eu"], "description": "moved to the EU"})
        assert r.status_code == 201, r.text
        assert r.json()["version"] == version + 1
        site, took = await served(c, gateway, ACME)
        assert site == "euw1"
        assert took >= 0.075  # the EU site's emulated round trip
        assert time.monotonic() - t0 < 1.0
        # a stale writer is refused
        r = await c.put(f"{gateway}/admin/v1/region-policies/acme/*", headers={**ADMIN, "If-Match": str(version)},
                        json={})
        assert r.status_code == 412
        dry = (await c.post(f"{gateway}/admin/v1/dry-run", headers=ADMIN,
                            json={"model": MODEL, "tenant": "acme", "region": "us-east"})).json()
        assert dry["site"] == "euw1" and dry["allowed_sites"] == ["euw1"]
        assert dry["policies_applied"] == ["acme/*"] and dry["candidates"][0]["site"] == "euw1"
        r = await c.delete(f"{gateway}/admin/v1/region-policies/acme/*", headers=ADMIN)
        assert r.status_code == 200
        assert await served_site(c, gateway, ACME) == "use1"
        audit = (await c.get(f"{gateway}/admin/v1/audit", headers=ADMIN)).json()["entries"]
        assert [(e["action"], e["tenant"]) for e in audit[:2]] == [("delete", "acme"), ("create", "acme")]
        assert audit[1]["after"]["allowed_jurisdictions"] == ["eu"] and audit[0]["after"] is None
        assert audit[0]["actor"].startswith("admin:") and "sk-admin" not in str(audit)


async def test_dry_run_of_a_proposed_policy_says_what_would_change(gateway: str) -> None:
    """A proposed policy is tried, not stored: today's answer next to the proposal's, the fields
    that differ, and a warning for a tenant no key maps to."""
    async with httpx.AsyncClient(timeout=10) as c:
        before = (await c.get(f"{gateway}/admin/v1/region-policies", headers=ADMIN)).json()
        body = {"model": MODEL, "tenant": "acme", "region": "us-east",
                "proposed": {"tenant": "acme", "model": "*", "allowed_jurisdictions": ["eu"]}}
        dry = await c.post(f"{gateway}/admin/v1/dry-run", headers=ADMIN, json=body)
        assert dry.status_code == 200, dry.text
        d = dry.json()
        assert d["site"] == "use1" and d["proposed"]["site"] == "euw1"
        assert d["proposed"]["allowed_sites"] == ["euw1"] and d["proposed"]["policies_applied"] == ["acme/*"]
        assert "site" in d["changes"] and "allowed_sites" in d["changes"] and d["warnings"] == []
        # nothing was stored, and the live chooser still routes acme at home
        assert (await c.get(f"{gateway}/admin/v1/region-policies", headers=ADMIN)).json() == before
        assert await served_site(c, gateway, ACME) == "use1"
        # an unknown tenant in the sample request is a warning, not an error
        d2 = (await c.post(f"{gateway}/admin/v1/dry-run", headers=ADMIN,
                           json={"model": MODEL, "tenant": "nobody"})).json()
        assert d2["warnings"] and "unknown tenant 'nobody'" in d2["warnings"][0] and "changes" not in d2
        # a proposal naming an unknown tenant is refused like a PUT would be
        r = await c.post(f"{gateway}/admin/v1/dry-run", headers=ADMIN,
                         json={"model": MODEL, "proposed": {"tenant": "nobody", "allowed_jurisdictions": ["eu"]}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tenant"


async def test_fleet_view_shows_probed_rtts(gateway: str) -> None:
    """The gateway measures the round trip to each site from its health probes (the emulated WAN)."""
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.get(f"{gateway}/admin/v1/fleet", headers=ACME)
        assert r.status_code == 403
        sites = {s["site"]: s for s in (await c.get(f"{gateway}/admin/v1/fleet", headers=ADMIN)).json()["sites"]}
    assert sites["euw1"]["rtt_ms"]["us-east"] == 75 and sites["euw1"]["jurisdiction"] == "eu"
    assert sites["euw1"]["probe_rtt_ms"] >= 75 and sites["usw2"]["probe_rtt_ms"] >= 62
    assert sites["use1"]["probe_rtt_ms"] < 62
    pool = sites["use1"]["pools"][0]
    assert (pool["model"], pool["version"], pool["ready"], pool["starting"], pool["draining"]) == (MODEL, "v1", 1, 0, 0)
    assert 0 < pool["predicted_ttft_s"] < 5


async def test_fleet_view_counts_the_prefix_blocks_a_request_leaves_in_the_cache(gateway: str) -> None:
    """`cache_blocks` is the pool's cache index: a fresh prompt served there adds its full blocks."""
    async def use1_blocks(c: httpx.AsyncClient) -> int:
        sites = (await c.get(f"{gateway}/admin/v1/fleet", headers=ADMIN)).json()["sites"]
        return next(s for s in sites if s["site"] == "use1")["pools"][0]["cache_blocks"]

    async with httpx.AsyncClient(timeout=10) as c:
        before = await use1_blocks(c)
        prompt = " ".join(f"fleetview{i}" for i in range(300))  # unique text: no block of it is cached yet
        r = await c.post(f"{gateway}/v1/completions", headers=ACME,
                         json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-tokenfleet-site"] == "use1", r.text
        full_blocks = r.json()["usage"]["prompt_tokens"] // BLOCK_SIZE
        assert full_blocks >= 20
        # the worker's KV events reach the gateway's index asynchronously: wait for them, bounded
        now = await wait_until(lambda: use1_blocks(c), 5, f"use1's cache index to gain {full_blocks} blocks",
                               ok=lambda n: n >= before + full_blocks)
    # exactly the prompt's full blocks: the 2 output tokens do not fill another one
    assert now == before + full_blocks


async def test_residency_holds_under_region_hints(gateway: str) -> None:
    """globex may only run in the US, even when it enters from the EU."""
    async with httpx.AsyncClient(timeout=10) as c:
        for _ in range(5):
            assert await served_site(c, gateway, {"Authorization": "Bearer sk-globex"}, "eu-west") in {"use1", "usw2"}
        assert await served_site(c, gateway, ACME, "eu-west") == "euw1"


async def test_admin_bodies_with_wrong_types_are_400_naming_the_field(gateway: str) -> None:
    """Admin bodies are pydantic models: a wrong type is an OpenAI-style 400 naming the field, never a
    500 (before: `{"prompt_tokens": "abc"}` crashed the dry-run with a 500)."""
    async with httpx.AsyncClient(timeout=10) as c:
        for path, method, body, param in [
            ("/admin/v1/dry-run", "POST", {"model": MODEL, "prompt_tokens": "abc"}, "prompt_tokens"),
            ("/admin/v1/dry-run", "POST", {"model": MODEL, "prompt_tokens": -5}, "prompt_tokens"),
            ("/admin/v1/dry-run", "POST", {"model": 5}, "model"),
            ("/admin/v1/dry-run", "POST", {"model": MODEL, "tenant": ["acme"]}, "tenant"),
            ("/admin/v1/dry-run", "POST", {"model": MODEL, "region": {"x": 1}}, "region"),
            ("/admin/v1/dry-run", "POST", {"model": MODEL, "request_class": 3}, "request_class"),
            ("/admin/v1/dry-run", "POST", {"tenant": "acme"}, "model"),
            ("/admin/v1/dry-run", "POST", {"model": MODEL, "promt_tokens": 5}, "promt_tokens"),
            ("/admin/v1/dry-run", "POST", [1, 2], None),
            ("/admin/v1/planner", "PUT", {"mode": 3}, "mode"),
            ("/admin/v1/region-policies/acme/*", "PUT", {"allowed_sites": "euw1"}, "allowed_sites"),
            ("/admin/v1/region-policies/acme/*", "PUT", {"tenant": "globex"}, "tenant"),
        ]:
            r = await c.request(method, f"{gateway}{path}", headers=ADMIN, json=body)
            assert r.status_code == 400, (path, body, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["param"] == param, (body, err)
        for raw in (b"{", b'{"model": "\\ud83d"}', b"\xff\xfe"):
            r = await c.post(f"{gateway}/admin/v1/dry-run", headers={**ADMIN, "content-type": "application/json"},
                             content=raw)
            assert r.status_code == 400 and "JSON" in r.json()["error"]["message"], r.text
        # the fields it always took still work, a numeric string included (lax, as before)
        r = await c.post(f"{gateway}/admin/v1/dry-run", headers=ADMIN,
                         json={"model": f"{MODEL}@v1", "tenant": "acme", "region": "eu-west", "prompt_tokens": "2000",
                               "request_class": "batch"})
        assert r.status_code == 200 and r.json()["site"] == "euw1", r.text
        # auth comes before the body: no key, no validation detail
        r = await c.post(f"{gateway}/admin/v1/dry-run", json={"prompt_tokens": "abc"})
        assert r.status_code == 401


async def test_admin_bodies_are_in_the_openapi_document() -> None:
    from gateway.app import create_app

    app = create_app(load_fleet_file(FLEET_FILE), [])
    paths = app.openapi()["paths"]
    dry = paths["/admin/v1/dry-run"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert dry["properties"]["prompt_tokens"]["type"] == "integer" and dry["required"] == ["model"]
    put = paths["/admin/v1/region-policies/{tenant}/{model}"]["put"]["requestBody"]["content"]["application/json"]
    assert put["schema"]["properties"]["spill"]["type"] == "boolean"
    mode = paths["/admin/v1/planner"]["put"]["requestBody"]["content"]["application/json"]["schema"]
    assert mode["properties"]["mode"]["enum"] == ["auto", "advise", "off"]
