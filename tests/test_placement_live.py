"""FleetMind's planner in the live gateway: it moves a replica toward demand through the sim
adapter (make-before-break: the new one loads first, the old one drains with its streams
finishing), then rolls the move back when goodput falls, all visible in the admin API and
/metrics; operators switch it to advise-only or off."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from fleetcore.fleet_config import load_fleet_file
from fleetmind.demand import DemandModel
from fleetmind.placement_cycle import CycleSettings, PlacementCycle
from fleetmind.planner import Move, Planner, PlannerConfig
from gateway.fleet_state import FleetState
from gateway.placement import PlacementLoop
from slomax.ledger import GoodputLedger
from gateway.embedded import serve_fleet
from tokenpilot.registry import make_router

FLEET_FILE = Path(__file__).with_name("fleet_planner.yaml")
ADMIN = {"Authorization": "Bearer sk-admin"}
ACME = {"Authorization": "Bearer sk-acme"}
MODEL = "llama-3.1-8b"
LONG_TOKENS = 6000

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gateway() -> AsyncIterator[tuple[str, Any]]:
    async with serve_fleet(load_fleet_file(FLEET_FILE), poll_interval_s=0.1) as f:
        yield f.url, f.app.state.tokenfleet


async def planner(c: httpx.AsyncClient, url: str) -> dict[str, Any]:
    r = await c.get(f"{url}/admin/v1/planner", headers=ADMIN)
    assert r.status_code == 200, r.text
    return r.json()


def replicas(report: dict[str, Any]) -> dict[str, int]:
    return {p["site"]: p["replicas"] for p in report["placement"]}


async def long_stream(c: httpx.AsyncClient, url: str, i: int) -> tuple[int, str]:
    """A stream from site b's region that outlives the moment a b replica starts draining."""
    body = {"model": MODEL, "stream": True, "max_tokens": LONG_TOKENS, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"long story number {i}, please"}]}
    tokens = 0
    async with c.stream("POST", f"{url}/v1/chat/completions", json=body,
                        headers={**ACME, "x-tokenfleet-region": "r-b"}) as r:
        site = r.headers.get("x-tokenfleet-instance", "")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    tokens += 1
        assert r.status_code == 200
    return tokens, site


async def load(c: httpx.AsyncClient, url: str, stop: asyncio.Event, cls: dict[str, str],
               statuses: list[int]) -> None:
    """~10 requests/s from site a's region until `stop`; `cls` may switch the request class."""
    words = " ".join(f"w{k}" for k in range(400))

    async def one(n: int) -> None:
        r = await c.post(f"{url}/v1/chat/completions", headers={**ACME, **cls},
                         json={"model": MODEL, "max_tokens": 16,
                               "messages": [{"role": "user", "content": f"{n} {words}"}]})
        statuses.append(r.status_code)

    tasks, n = [], 0
    while not stop.is_set():
        tasks.append(asyncio.create_task(one(n)))
        n += 1
        await asyncio.sleep(0.1)
    await asyncio.gather(*tasks)


async def wait_for(c: httpx.AsyncClient, url: str, check: Any, timeout_s: float) -> dict[str, Any]:
    t0 = time.monotonic()
    while True:
        rep = await planner(c, url)
        if check(rep):
            return rep
        assert time.monotonic() - t0 < timeout_s, json.dumps(rep, indent=1)
        await asyncio.sleep(0.2)


@pytest.mark.slow
async def test_planner_moves_a_replica_to_demand_then_rolls_back_when_goodput_falls(
        gateway: tuple[str, Any]) -> None:
    url, ctx = gateway
    async with httpx.AsyncClient(timeout=60) as c:
        rep = await planner(c, url)
        assert rep["enabled"] and replicas(rep) == {"a": 1, "b": 2}
        fleet = (await c.get(f"{url}/admin/v1/fleet", headers=ADMIN)).json()
        assert [s["site"] for s in fleet["sites"]] == ["a", "b"]
        assert fleet["sites"][1]["pools"][0]["ready"] == 2

        # Long streams on both b replicas; then demand from a's region only.
        longs = [asyncio.create_task(long_stream(c, url, i)) for i in range(4)]
        stop, cls, statuses = asyncio.Event(), {}, []
        loader = asyncio.create_task(load(c, url, stop, cls, statuses))
        try:
            rep = await wait_for(c, url, lambda r: any(e["kind"] == "apply" for e in r["entries"]), 20)
            applied = next(e for e in rep["entries"] if e["kind"] == "apply")
            assert applied["move"] == f"{MODEL}: b -> a"
            # the admission gate hands the loop its verdict on each request, at the site it ran in
            assert ("a", MODEL) in ctx.placement.core.planner._verdicts
            # The move hurts (every request from now on misses its SLO): the planner must undo it.
            cls["x-tokenfleet-class"] = "tight"
            rep = await wait_for(c, url, lambda r: any(e["kind"] == "rollback" for e in r["entries"]), 20)
        finally:
            stop.set()
            await loader
        kinds = [e["kind"] for e in rep["entries"]]
        assert kinds[:3] == ["plan", "apply", "rollback"], kinds
        rollback = rep["entries"][2]
        assert rollback["move"] == f"{MODEL}: a -> b" and "goodput fell" in rollback["reason"]

        # Both moves carried out, make-before-break, and nothing in flight lost.
        rep = await wait_for(c, url, lambda r: sum(a["kind"] == "stop" for a in r["actions"]) >= 2, 40)
        assert replicas(rep) == {"a": 1, "b": 2}
        steps = [(a["kind"], a["site"]) for a in rep["actions"]]
        assert steps.index(("start", "a")) < steps.index(("ready", "a")) < steps.index(("drain", "b")) \
            < steps.index(("stop", "b")), steps
        assert steps.index(("start", "b")) < steps.index(("ready", "b")) < steps.index(("drain", "a")) \
            < steps.index(("stop", "a")), steps
        drained_b = next(a for a in rep["actions"] if a["kind"] == "drain" and a["site"] == "b")
        results = await asyncio.gather(*longs)
        assert all(tokens == LONG_TOKENS for tokens, _ in results), results
        assert drained_b["instance"] in {iid for _, iid in results}, (drained_b, results)
        assert not drained_b["detail"].startswith("draining with 0"), drained_b
        assert statuses and set(statuses) == {200}, sorted(set(statuses))
        # The gateway follows the adapters: the stopped ones are gone, the new ones serve.
        ids = {st.instance.instance_id for st in ctx.state.states()}
        stopped = {a["instance"] for a in rep["actions"] if a["kind"] == "stop"}
        started = {a["instance"] for a in rep["actions"] if a["kind"] == "start"}
        assert not ids & stopped and started <= ids
        assert all(ctx.state.get(i).ready for i in started)
        metrics = (await c.get(f"{url}/metrics")).text
        assert 'tokenfleet_planner_decisions_total{kind="rollback"} 1.0' in metrics
        assert 'tokenfleet_planner_actions_total{kind="stop"} 2.0' in metrics
        assert f'tokenfleet_replicas{{model="{MODEL}",site="b",state="ready",version="v1"}} 2.0' in metrics
        # The stopped instances' series are gone (their ids are never reused: kept, /metrics grew by
        # them with every move); the drained b replica answered requests, so it had some.
        for iid in stopped:
            assert f'instance="{iid}"' not in metrics, iid


async def test_planner_mode_from_the_admin_api(gateway: tuple[str, Any]) -> None:
    url, ctx = gateway
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.put(f"{url}/admin/v1/planner", headers=ACME, json={"mode": "off"})
        assert r.status_code == 403
        r = await c.put(f"{url}/admin/v1/planner", headers=ADMIN, json={"mode": "sometimes"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "mode"
        r = await c.put(f"{url}/admin/v1/planner", headers=ADMIN, json={"mode": "advise"})
        assert r.status_code == 200 and r.json() == {"mode": "advise"}
        rep = await planner(c, url)
        assert rep["mode"] == "advise" and rep["actions"][-1]["kind"] == "mode"
        assert rep["actions"][-1]["detail"].startswith("auto -> advise by admin:")


async def test_advise_mode_logs_plans_without_carrying_them_out() -> None:
    config = load_fleet_file(FLEET_FILE)
    planner = Planner(config=PlannerConfig(window_s=1, lead_s=0, target_utilisation=0.1, cooldown_s=100))
    clock = [0.0]
    core = PlacementCycle(planner, DemandModel(config), CycleSettings(mode="advise"))
    loop = PlacementLoop(core, FleetState(config, []), make_router("round_robin"), GoodputLedger(), lambda: clock[0])
    for t in range(5):
        clock[0] = float(t)
        planner.record_demand("a", MODEL, 5.0)
        planner.record_served("b", MODEL, 0.0)
        loop.state.placement = lambda: {("a", MODEL): 1, ("b", MODEL): 3}  # type: ignore[method-assign]
        await loop.cycle()
    assert [e.kind for e in planner.log] == ["plan", "advise"]  # then the cooldown: not re-proposed
    assert planner.log[0].move == Move(MODEL, "b", "a", 2) and not loop.actions
