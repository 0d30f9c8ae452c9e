"""A client's `X-Request-Id` names its request in headers, logs and the engine's request, but two
requests in flight with the same one are two requests: admission keeps each its own entry.

Admission (the gate's queue futures, its admitted set, SLOMax's requests and the tenant's
concurrent-stream count) was keyed by the id as sent: the second of two concurrent requests
overwrote the first's entry, so one of them ended without giving its capacity back (a tenant's
stream slot held for good; sent on purpose, a tenant could starve itself and the pool's class
shares) and a queued one lost its future (left waiting until its client gave up). Real gateway,
real sockets, SLOMax over one stub engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from fleetcore.fleet_config import FleetConfig, parse_fleet
from gateway.app import create_app
from tests.waits import wait_until

CHAT = "/v1/chat/completions"
KEY = "sk-tenant-a"
BODY = {"model": "m1", "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 4, "stream": True}
SLACK_S = 15.0  # a loaded 2-core CI machine


def fleet(tenant: dict[str, Any] | None = None, admission: dict[str, Any] | None = None) -> FleetConfig:
    return parse_fleet({
        "sites": [{"name": "use1", "region": "us-east", "jurisdiction": "us"}],
        "models": [{"name": "m1", "versions": ["v1"], "engine": {"spec": "llama-3.1-8b", "max_model_len": 4096}}],
        "tenants": [{"name": "a", "api_keys": [KEY], **(tenant or {})}],
        **({"admission": admission} if admission else {}),
    })


async def _start(gateway_server: Callable[[Any], Awaitable[str]], stub_upstream: Any, fake_adapter: Any,
                 instance_factory: Any, config: FleetConfig) -> tuple[str, Any, Any]:
    stub = await stub_upstream(chunks=10, delay_s=0.05)  # each stream lasts ~0.5 s: they overlap
    app = create_app(config, [fake_adapter([instance_factory("i0", stub.url)])], poll_interval_s=60)
    return await gateway_server(app), app.state.tokenfleet.admission, stub


async def _post(url: str, rid: str | None, headers: dict[str, str] | None = None) -> tuple[int, str, str]:
    h = {"Authorization": f"Bearer {KEY}", **({"X-Request-Id": rid} if rid else {}), **(headers or {})}
    async with aiohttp.ClientSession() as s, s.post(url + CHAT, json=BODY, headers=h) as r:
        return r.status, r.headers.get("x-request-id", ""), await r.text()


async def test_two_streams_with_one_request_id_each_give_their_slot_back(
        gateway_server: Any, stub_upstream: Any, fake_adapter: Any, instance_factory: Any) -> None:
    url, gate, stub = await _start(gateway_server, stub_upstream, fake_adapter, instance_factory,
                                   fleet({"budgets": {"concurrent_streams": 2}}))
    first = asyncio.create_task(_post(url, "dup-1"))
    await wait_until(lambda: len(stub.requests), SLACK_S, "the first stream at the engine", ok=lambda n: n == 1)
    second = asyncio.create_task(_post(url, "dup-1"))
    await wait_until(lambda: len(stub.requests), SLACK_S, "the second stream at the engine", ok=lambda n: n == 2)
    async with asyncio.timeout(SLACK_S):
        results = [await first, await second]
    assert [status for status, _, _ in results] == [200, 200]
    assert all("[DONE]" in text for _, _, text in results)
    # Both ended: the tenant's two stream slots are free again (one was held for good).
    await wait_until(lambda: gate._admitted, SLACK_S, "both released", ok=lambda a: not a)
    assert gate.policy.budgets.get("a", time.monotonic()).streams == 0
    async with asyncio.timeout(SLACK_S):
        again = await asyncio.gather(_post(url, None), _post(url, None))
    assert [status for status, _, _ in again] == [200, 200]
    ids = [rid for _, rid, _ in results]
    assert ids[0] == "dup-1" and ids[1].startswith("dup-1") and ids[1] != ids[0]  # told apart, and told so
    assert len({r["headers"]["x-request-id"] for r in stub.requests[:2]}) == 2  # the engine sees two requests


async def test_two_queued_requests_with_one_request_id_are_both_answered(
        gateway_server: Any, stub_upstream: Any, fake_adapter: Any, instance_factory: Any) -> None:
    # One long-context request at a time (cap 0.5 per instance on a one-instance pool: 1).
    url, gate, stub = await _start(gateway_server, stub_upstream, fake_adapter, instance_factory,
                                   fleet(admission={"classes": {"long_context": {"max_concurrency": 0.5}}}))
    lc = {"x-tokenfleet-class": "long_context"}
    running = asyncio.create_task(_post(url, "runs", lc))
    await wait_until(lambda: len(stub.requests), SLACK_S, "the first request at the engine", ok=lambda n: n == 1)
    queued = [asyncio.create_task(_post(url, "dup-2", lc)) for _ in range(2)]
    await wait_until(lambda: gate.policy.ledger.totals[("a", "long_context")].queued, SLACK_S,
                     "both to wait in the queue", ok=lambda n: n == 2)
    async with asyncio.timeout(SLACK_S):  # one of them waited for ever: its queue future was overwritten
        results = [await running, *[await t for t in queued]]
    assert [status for status, _, _ in results] == [200, 200, 200]
    assert gate.waiting == 0
    await wait_until(lambda: gate._admitted, SLACK_S, "all three released", ok=lambda a: not a)
