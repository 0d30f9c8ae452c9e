"""Hedged prefill over real simulated workers (gateway.hedge, off by default): an interactive
stream whose instance sends nothing within the hedge delay is sent to a second instance too,
and the first stream with an event is kept, the other aborted."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from engine_adapters.sim.launcher import SimAdapter
from gateway.embedded import ServedFleet, serve_fleet
from tests.paths import REPO
from tests.waits import wait_until

MODEL = "llama-3.1-8b"
KEY = "sk-bench"

pytestmark = pytest.mark.asyncio(loop_scope="module")


def _bench() -> Any:
    """bench/hedge_ttft.py: its fleet is this test's (two engines, hedging after 0.1 s at the least)."""
    spec = importlib.util.spec_from_file_location("hedge_ttft", REPO / "bench" / "hedge_ttft.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def fleet() -> AsyncIterator[ServedFleet]:
    async with serve_fleet(_bench().config(hedge=True), poll_interval_s=0.1) as served:
        state = served.app.state.tokenfleet.state
        await wait_until(lambda: sum(st.up for st in state.states()), 30, "both ready", ok=lambda n: n == 2)
        yield served


async def stream(served: ServedFleet, n: int) -> tuple[str, float, int, int]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"quick question {n}"}], "max_tokens": 20,
            "ignore_eos": True, "stream": True}
    t0 = time.monotonic()
    ttft, tokens, errors = 0.0, 0, 0
    async with httpx.AsyncClient(base_url=served.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as c:
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            iid = r.headers["x-tokenfleet-instance"]
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev: dict[str, Any] = json.loads(line[6:])
                errors += "error" in ev
                if any((ch.get("delta") or {}).get("content") for ch in ev.get("choices") or ()):
                    tokens += 1
                    ttft = ttft or time.monotonic() - t0
    return iid, ttft, tokens, errors


def metric(served: ServedFleet, name: str, **labels: str) -> float:
    text = served.app.state.tokenfleet.metrics.render(per_tenant=True).decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()))


async def test_a_silent_instance_is_hedged_and_the_other_stream_kept(fleet: ServedFleet) -> None:
    (adapter,) = fleet.adapters
    assert isinstance(adapter, SimAdapter)
    frozen, other = adapter.instances
    proc = adapter.process(frozen)
    assert proc is not None
    os.kill(proc.pid, signal.SIGSTOP)  # before any health check can notice: routing still sends it work
    try:
        results = await asyncio.gather(*(stream(fleet, n) for n in range(4)))
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    for iid, ttft, tokens, errors in results:
        assert iid == other.instance_id and tokens == 20 and errors == 0, results
        assert ttft < 2.5, results  # without a hedge: the first-byte deadline (30 s), then a retry
    sent = metric(fleet, "tokenfleet_hedges_total", outcome="sent")
    assert sent >= 1 and metric(fleet, "tokenfleet_hedges_total", outcome="second_won") == sent
    assert metric(fleet, "tokenfleet_hedge_prefill_tokens_total") > 0
    assert metric(fleet, "tokenfleet_retries_total") == 0
    state = fleet.app.state.tokenfleet.state
    await wait_until(lambda: [st.inflight for st in state.states()], 10, "nothing in flight", ok=lambda v: not any(v))
    hedges = [d for d in fleet.app.state.tokenfleet.decisions.last(50) if d["continuation_reason"] == "hedge"]
    assert hedges and all(d["instance"] == other.instance_id and frozen.instance_id in d["excluded"] for d in hedges)
