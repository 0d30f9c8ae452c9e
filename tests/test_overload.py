"""Overload is refused, not queued without bound (gateway.overload), even with FCFS admission.

A real flood against the gateway served over real HTTP in front of a launched sim worker:
requests over `gateway.max_pending_requests` (accepted, response not started) or
`gateway.max_inflight_requests` (in progress, streams included) get 503 `gateway_overloaded`
with Retry-After and an OpenAI-style body at once; the others are served; nothing is dropped,
and the counts return to zero.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Any

import httpx
import pytest
import yaml

from fleetcore.fleet_config import parse_fleet
from gateway.embedded import ServedFleet, serve_fleet
from gateway.overload import Backlog
from tests.waits import wait_until

KEY = "sk-test-acme"
HEADERS = {"Authorization": f"Bearer {KEY}"}


def _fleet(time_scale: float, gateway: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(f"""
sites:
  - {{name: east, region: us-east, jurisdiction: us}}
models:
  - name: llama-3.1-8b
    versions: ["v1"]
    engine: {{spec: llama-3.1-8b, max_model_len: 8192, block_size: 16}}
deployments:
  - {{site: east, model: llama-3.1-8b, instances: 1, gpu: H100, adapter: sim, options: {{time_scale: {time_scale}}}}}
admission: {{policy: fcfs}}
tenants:
  - {{name: acme, api_keys: [{KEY}]}}
""") | {"gateway": gateway}


def _chat(max_tokens: int, words: int = 8) -> dict[str, Any]:
    return {"model": "llama-3.1-8b", "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": " ".join(["tokens"] * words)}]}


def _backlog(f: ServedFleet) -> Backlog:
    backlog = f.app.state.backlog
    assert isinstance(backlog, Backlog)
    return backlog


async def _metric(client: httpx.AsyncClient, url: str, line_start: str) -> float:
    text = (await client.get(f"{url}/metrics", headers=HEADERS)).text
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _assert_refusal(r: httpx.Response, bound_words: str) -> None:
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert err["code"] == "gateway_overloaded" and err["type"] == "server_error"
    assert bound_words in err["message"]


def _served(time_scale: float, max_pending: int, max_inflight: int) -> AbstractAsyncContextManager[ServedFleet]:
    gateway = {"max_pending_requests": max_pending, "max_inflight_requests": max_inflight}
    return serve_fleet(parse_fleet(_fleet(time_scale, gateway)), poll_interval_s=0.2)


@pytest.fixture
async def slow_start() -> AsyncIterator[ServedFleet]:
    # physics 40x slower: a ~2k-token prompt takes a good fraction of a second to its first token
    async with _served(40.0, max_pending=4, max_inflight=1000) as f:
        yield f


async def test_a_flood_past_the_pending_bound_is_refused_at_once_and_the_rest_served(
        slow_start: ServedFleet) -> None:
    f = slow_start
    backlog = _backlog(f)
    seen_pending: list[int] = []

    async def one(client: httpx.AsyncClient) -> httpx.Response:
        async with client.stream("POST", f"{f.url}/v1/chat/completions", json=_chat(2, words=1500),
                                 headers=HEADERS) as r:
            seen_pending.append(backlog.pending)
            await r.aread()
            return r

    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        flood = await asyncio.gather(*(one(client) for _ in range(40)))
        served = [r for r in flood if r.status_code == 200]
        refused = [r for r in flood if r.status_code != 200]
        assert len(served) + len(refused) == 40  # every request answered
        assert len(served) >= 4 and len(refused) >= 10, (len(served), len(refused))
        for r in refused:
            _assert_refusal(r, "waiting for their response to start")
        for r in served:
            assert b"data: [DONE]" in r.content
        assert max(seen_pending) <= 4  # the bound held
        await wait_until(lambda: (backlog.pending, backlog.inflight), 10, "the counts back to zero",
                         ok=lambda v: v == (0, 0))
        assert await _metric(client, f.url, 'tokenfleet_overload_refused_total{bound="pending"}') == len(refused)
        # the flood over, a request goes through
        r = await client.post(f"{f.url}/v1/chat/completions", json=_chat(2), headers=HEADERS)
        assert r.status_code == 200


@pytest.fixture
async def long_streams() -> AsyncIterator[ServedFleet]:
    async with _served(1.0, max_pending=100, max_inflight=5) as f:
        yield f


async def test_streams_past_the_inflight_bound_are_refused_and_other_paths_still_answer(
        long_streams: ServedFleet) -> None:
    f = long_streams
    backlog = _backlog(f)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        opened = []
        readers = []  # kept: a dropped iterator would close its stream
        try:
            for _ in range(5):  # five long streams, each past its first event
                cm = client.stream("POST", f"{f.url}/v1/chat/completions", json=_chat(2000), headers=HEADERS)
                r = await cm.__aenter__()
                opened.append(cm)
                assert r.status_code == 200
                readers.append(r.aiter_bytes())
                await readers[-1].__anext__()
            assert backlog.inflight == 5
            r = await client.post(f"{f.url}/v1/chat/completions", json=_chat(2), headers=HEADERS)
            _assert_refusal(r, "5 requests are in progress")
            # the cap is for /v1 work only: health, metrics and the model list still answer
            assert (await client.get(f"{f.url}/health")).status_code == 200
            assert (await client.get(f"{f.url}/v1/models", headers=HEADERS)).status_code == 200
            assert await _metric(client, f.url, 'tokenfleet_requests_in_progress') == 5
        finally:
            for reader in readers:
                await reader.aclose()
            for cm in opened:  # the client goes away: the streams end, the slots come back
                await cm.__aexit__(None, None, None)
        await wait_until(lambda: (backlog.pending, backlog.inflight), 10, "the counts back to zero",
                         ok=lambda v: v == (0, 0))
        r = await client.post(f"{f.url}/v1/chat/completions", json=_chat(2), headers=HEADERS)
        assert r.status_code == 200
        assert await _metric(client, f.url, 'tokenfleet_overload_refused_total{bound="inflight"}') == 1
