"""The real `openai` SDK against the `tokenfleet up` wiring: sim workers as processes, gateway on uvicorn."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from engine_adapters.base import EngineAdapter, Instance
from fleetcore.fleet_config import load_fleet_file
from gateway.embedded import serve_fleet
from tests.waits import wait_until

FLEET_FILE = Path(__file__).with_name("fleet_test.yaml")
KEY = "sk-test-acme"
MODEL = "llama-3.1-8b"

pytestmark = pytest.mark.asyncio(loop_scope="module")


@dataclass
class Fleet:
    url: str
    adapters: list[EngineAdapter]
    app: Any

    def instance(self, instance_id: str) -> tuple[EngineAdapter, Instance]:
        for a in self.adapters:
            for i in a.instances:
                if i.instance_id == instance_id:
                    return a, i
        raise KeyError(instance_id)

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=30)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def fleet() -> AsyncIterator[Fleet]:
    async with serve_fleet(load_fleet_file(FLEET_FILE), poll_interval_s=0.2) as f:
        yield Fleet(f.url, f.adapters, f.app)


def long_prompt(topic: str, words: int = 1500) -> str:
    return " ".join(f"{topic} section {i} describes the routing of cached prefixes." for i in range(words // 8))


async def metric(instance: Instance, name: str, **labels: str) -> float:
    async with httpx.AsyncClient() as c:
        text = (await c.get(f"{instance.url}/metrics")).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


async def test_models_lists_ready_models(fleet: Fleet) -> None:
    models = await fleet.client().models.list()
    assert MODEL in [m.id for m in models.data]


async def test_chat_non_stream(fleet: Fleet) -> None:
    r = await fleet.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello to the fleet."}], max_tokens=12)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.usage is not None and r.usage.prompt_tokens > 0
    assert 0 < r.usage.completion_tokens <= 12


async def test_chat_stream_with_usage(fleet: Fleet) -> None:
    stream = await fleet.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Stream a few words."}], max_tokens=20,
        stream=True, stream_options={"include_usage": True})
    text, usage, finish = [], None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(text).strip()
    assert finish in ("stop", "length")
    assert usage is not None and usage.completion_tokens == len([t for t in text if t])


async def test_completions_stream_and_not(fleet: Fleet) -> None:
    client = fleet.client()
    r = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8)
    assert r.choices[0].text and r.usage is not None and r.usage.completion_tokens <= 8
    stream = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, stream=True)
    parts = [c.choices[0].text async for c in stream if c.choices]
    assert "".join(parts) == r.choices[0].text  # deterministic pseudo-words


async def test_repeated_long_prefix_is_cached(fleet: Fleet) -> None:
    client = fleet.client()
    prompt = long_prompt("cache")
    first = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    second = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens > 1000
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert details.cached_tokens > 0.8 * second.usage.prompt_tokens


async def test_tokenpilot_headers_and_exact_cache_index(fleet: Fleet) -> None:
    """TokenPilot (the default router) explains itself in headers, and KV events from the
    workers put its cache index in exact mode."""
    client = fleet.client()
    router = fleet.app.state.tokenfleet.relay.router
    before = {i.instance_id: router.index.entries(i.instance_id) for a in fleet.adapters for i in a.instances}
    prompt = long_prompt("headers")
    first = await client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert float(first.headers["x-tokenfleet-predicted-ttft-ms"]) > 0
    assert first.headers["x-tokenfleet-cached-tokens"] == "0"
    served = first.headers["x-tokenfleet-instance"]
    # the worker's KV events reach the gateway's index asynchronously: wait until it holds every full
    # block of the prompt (tests/fleet_test.yaml: block_size 16), not a fixed 0.3 s
    full_blocks = first.parse().usage.prompt_tokens // 16
    await wait_until(lambda: router.index.entries(served), 5, f"{served}'s KV events to reach the index",
                     ok=lambda n: n >= before[served] + full_blocks)
    second = await client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert second.headers["x-tokenfleet-instance"] == first.headers["x-tokenfleet-instance"]
    predicted_cached = int(second.headers["x-tokenfleet-cached-tokens"])
    usage = second.parse().usage
    assert usage is not None and usage.prompt_tokens_details is not None
    actual_cached = usage.prompt_tokens_details.cached_tokens or 0
    assert predicted_cached > 0.8 * usage.prompt_tokens
    assert abs(predicted_cached - actual_cached) <= 8 * 16  # one index stride
    assert router.index.is_exact(first.headers["x-tokenfleet-instance"], time.monotonic())
    async with httpx.AsyncClient() as c:
        decisions = (await c.get(f"{fleet.url}/debug/decisions?limit=1",
                                 headers={"Authorization": f"Bearer {KEY}"})).json()["decisions"]
    assert decisions[-1]["candidates"] and "predicted_ttft_s" in decisions[-1]["candidates"][0]["detail"]


async def test_client_disconnect_aborts_on_worker(fleet: Fleet) -> None:
    # 8,000 output tokens take this fast worker (time_scale 0.05) a few seconds: the client hangs up
    # right after its first tokens, long before the engine could finish on its own. (Reading a gauge
    # before hanging up raced the request's end: one /metrics fetch took 2.7 s on a loaded machine.)
    body = {"model": MODEL, "prompt": "A very long story:", "max_tokens": 8000, "stream": True,
            "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    finished = "vllm:request_success_total"
    ended = {i.instance_id: (await metric(i, finished, finished_reason="abort"), await metric(i, finished))
             for a in fleet.adapters for i in a.instances}
    async with httpx.AsyncClient(timeout=30) as c:
        async with c.stream("POST", f"{fleet.url}/v1/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            _, instance = fleet.instance(r.headers["x-tokenfleet-instance"])
            lines = r.aiter_lines()
            for _ in range(3):
                await lines.__anext__()
    aborted0, finished0 = ended[instance.instance_id]
    # the engine ends the request as aborted (not at its length limit), and nothing else ended there
    try:
        await wait_until(lambda: metric(instance, finished, finished_reason="abort"), 10,
                         f"{instance.instance_id} to abort the abandoned request", ok=lambda n: n == aborted0 + 1)
    finally:
        by_reason = {k: await metric(instance, finished, finished_reason=k) for k in ("stop", "length", "abort")}
        assert await metric(instance, finished) == finished0 + 1, (ended, by_reason)
    assert await metric(instance, "vllm:num_requests_running") == 0


async def test_killed_worker_requests_still_answered(fleet: Fleet) -> None:
    """Runs last in this module: it leaves the fleet one worker short."""
    from engine_adapters.sim.launcher import SimAdapter

    adapter, victim = next((a, i) for a in fleet.adapters for i in a.instances if i.site == "east")
    assert isinstance(adapter, SimAdapter)
    proc = adapter.process(victim)
    assert proc is not None
    # A dead worker, not its restart (that is tests/test_chaos_supervise.py): unsupervised, it stays dead.
    await adapter.supervisor.release(victim.instance_id)
    os.kill(proc.pid, signal.SIGKILL)
    await proc.wait()
    client = fleet.client()
    served_by = set()
    for n in range(12):
        raw = await client.completions.with_raw_response.create(model=MODEL, prompt=f"question {n}", max_tokens=4)
        served_by.add(raw.headers["x-tokenfleet-instance"])
        assert raw.parse().choices[0].text
    assert victim.instance_id not in served_by
