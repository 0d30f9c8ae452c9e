"""Engine supervision, with real processes: a SIGKILLed sim worker is restarted on its id and port
after a backoff, counted in /metrics, and comes back cold (the gateway forgets the cache it
believed it held); /health says "degraded" while a model has no ready instance and the
planner does not count the dead replica; a worker that keeps dying waits longer each time
(bounded); workers stopped on purpose (remove_instance, a clean exit on SIGTERM, stop) are
not restarted."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_adapters.registry import build_adapters, launch_all, stop_all
from engine_adapters.sim.launcher import SimAdapter
from engine_adapters.supervise import RestartPolicy
from fleetcore.fleet_config import parse_fleet
from gateway.embedded import serve_app

BACKOFF_S = 2.0
SPEC = "llama-3.1-8b"


def fleet() -> Any:
    sim = {"gpu": "H100", "adapter": "sim", "options": {"time_scale": 0.05}}
    return parse_fleet({
        "sites": [{"name": "s1", "region": "r1", "jurisdiction": "x"}],
        "models": [{"name": "alpha", "engine": {"spec": SPEC, "max_model_len": 4096}},
                   {"name": "beta", "engine": {"spec": SPEC, "max_model_len": 4096}}],
        "deployments": [{"site": "s1", "model": "alpha", "instances": 1, **sim},
                        {"site": "s1", "model": "beta", "instances": 1, **sim}],
        "gateway": {"health_interval_s": 0.1, "health_timeout_s": 1.0,
                    "engine_restart_backoff_s": BACKOFF_S, "engine_restart_backoff_max_s": 8.0},
    })


async def until(check: Any, timeout_s: float, what: str, step_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = await check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(step_s)


def restarts_metric(text: str) -> dict[str, float]:
    return {s.labels["instance"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "tokenfleet_engine_restarts_total"}


def _sample(text: str, name: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def prompt(n: int) -> str:
    return f"request {n}: " + " ".join(f"word{k}" for k in range(300))


@pytest.mark.slow
async def test_killed_worker_is_restarted_cold_and_health_tells_the_truth() -> None:
    from gateway.app import create_app

    config = fleet()
    adapters = build_adapters(config)
    await launch_all(adapters)
    alpha = next(a for a in adapters if getattr(a, "model", None) == "alpha")
    assert isinstance(alpha, SimAdapter)
    (inst,) = alpha.instances
    iid = inst.instance_id
    new = None
    try:
        app = create_app(config, adapters)
        ctx = app.state.tokenfleet
        async with serve_app(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as c:
            async def health() -> dict[str, Any]:
                r = await c.get("/health")
                assert r.status_code == 200  # degraded or not: the gateway still serves other models
                return r.json()

            async def complete(model: str, n: int) -> httpx.Response:
                return await c.post("/v1/completions", json={"model": model, "prompt": prompt(n), "max_tokens": 4})

            h = await health()
            assert h["status"] == "ok" and h["models"] == {"alpha": 1, "beta": 1}
            for n in range(3):
                r = await complete("alpha", n)
                assert r.status_code == 200 and r.headers["x-tokenfleet-instance"] == iid
            index = ctx.relay.router.index
            assert index.entries(iid) > 0  # the gateway believes alpha's engine holds these prefixes

            old = alpha.process(inst)
            assert old is not None
            os.kill(old.pid, signal.SIGKILL)
            killed = time.monotonic()

            h = await until(lambda: _degraded(health), 5, "/health to say degraded")
            assert h["unserved_models"] == ["alpha"] and h["models"] == {"alpha": 0, "beta": 1}
            assert ctx.state.placement()[("s1", "alpha")] == 0  # the planner does not count it
            # Meanwhile: the other model is served; the dead one's requests get a clear 503.
            assert (await complete("beta", 100)).status_code == 200
            r = await complete("alpha", 101)
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_ready_instance"

            h = await until(lambda: _ok(health), BACKOFF_S + 20, "the restarted worker to be ready")
            back = time.monotonic() - killed
            assert back >= BACKOFF_S * 0.9, f"restarted after {back:.2f} s, before its backoff"
            assert h["models"] == {"alpha": 1, "beta": 1}
            assert ctx.state.placement()[("s1", "alpha")] == 1
            new = alpha.process(inst)
            assert new is not None and new.pid != old.pid and new.returncode is None
            assert [i.url for i in alpha.instances] == [inst.url]  # same id, same port
            metrics = (await c.get("/metrics")).text
            assert restarts_metric(metrics) == {iid: 1.0}
            # A restarted engine is cold, and the gateway no longer believes otherwise.
            assert index.entries(iid) == 0
            engine = (await c.get(f"{inst.url}/metrics")).text
            assert _sample(engine, "vllm:prefix_cache_queries_total") == 0.0  # nothing served yet

            for n in range(3):
                r = await complete("alpha", 200 + n)
                assert r.status_code == 200 and r.headers["x-tokenfleet-instance"] == iid
    finally:
        await stop_all(adapters)
    assert new is not None and new.returncode is not None  # stop ended the replacement too, for good
    assert alpha.restart_counts() == {iid: 1}


async def _degraded(health: Any) -> dict[str, Any] | None:
    h = await health()
    return h if h["status"] == "degraded" else None


async def _ok(health: Any) -> dict[str, Any] | None:
    h = await health()
    return h if h["status"] == "ok" else None


def _sim(instances: int, policy: RestartPolicy) -> SimAdapter:
    return SimAdapter(id_prefix="s/m", site="s", model="m", version="v1", instances=instances, spec=SPEC,
                      gpu="H100", options={"time_scale": 0.05}, restart=policy)


@pytest.mark.slow
async def test_worker_that_keeps_dying_backs_off_up_to_the_bound() -> None:
    """Its port is taken while it is down, so every replacement dies at start: the waits grow
    0.2, 0.4, 0.8 and stay at the bound; once the port is free it comes back; after it stayed
    up `stable_s`, the next death waits the short backoff again."""
    adapter = _sim(1, RestartPolicy(0.2, 0.8, stable_s=1.0))
    try:
        (inst,) = await adapter.launch()
        host, port = inst.url.removeprefix("http://").rsplit(":", 1)
        proc = adapter.process(inst)
        assert proc is not None
        squatter = socket.socket()
        try:
            os.kill(proc.pid, signal.SIGKILL)
            await proc.wait()
            squatter.bind((host, int(port)))  # the kernel freed the port with the process
            squatter.listen()

            async def attempts() -> int:
                return adapter.restart_counts().get(inst.instance_id, 0) >= 5

            await until(attempts, 60, "five restart attempts")
        finally:
            squatter.close()
        records = [r for r in adapter.supervisor.log if r[1] == inst.instance_id]
        waits = [w for _, _, _, w in records[:5]]
        assert waits == [0.2, 0.4, 0.8, 0.8, 0.8]
        times = [t for t, _, _, _ in records[:5]]
        # Each attempt really came at least its wait after the one before (which failed).
        assert all(b - a >= w for a, b, w in zip(times[:-1], times[1:], waits[1:], strict=True)), (times, waits)

        async def healthy() -> bool:
            return not adapter.down(inst) and await adapter.health(inst)

        await until(healthy, 30, "the worker to come back once its port is free")
        assert [i.url for i in adapter.instances] == [inst.url]
        proc = adapter.process(inst)
        assert proc is not None
        n = adapter.restart_counts()[inst.instance_id]
        # Up for longer than stable_s: the next death is forgiven its history.
        await asyncio.sleep(1.2)  # the condition is elapsed uptime itself
        os.kill(proc.pid, signal.SIGKILL)

        async def restarted() -> bool:
            return adapter.restart_counts()[inst.instance_id] > n

        await until(restarted, 10, "the restart after a stable run")
        assert adapter.supervisor.log[-1][3] == 0.2
        await until(healthy, 30, "the worker to be healthy again")
    finally:
        await adapter.stop()


@pytest.mark.slow
async def test_planned_stops_are_not_restarted() -> None:
    """remove_instance (the planner), a clean exit (an operator's SIGTERM) and stop (shutdown) are
    not crashes; a crash next door is."""
    adapter = _sim(3, RestartPolicy(0.1, 0.2))
    try:
        first, second, third = await adapter.launch()
        crashed, told = adapter.process(second), adapter.process(third)
        assert crashed is not None and told is not None
        os.kill(crashed.pid, signal.SIGKILL)
        os.kill(told.pid, signal.SIGTERM)
        removed = adapter.process(first)
        await adapter.remove_instance(first)
        assert removed is not None and removed.returncode is not None

        async def second_back() -> bool:
            p = adapter.process(second)
            return p is not None and p.pid != crashed.pid and await adapter.health(second)

        await until(second_back, 30, "the crashed worker's restart")
        # The others had many backoffs' time to be (wrongly) restarted; they were not.
        assert adapter.restart_counts() == {second.instance_id: 1}
        assert await told.wait() == 0 and adapter.process(third) is told and adapter.down(third)
        assert adapter.process(first) is None and not await adapter.health(first)
        assert [i.instance_id for i in adapter.instances] == [second.instance_id, third.instance_id]
        last = adapter.process(second)
    finally:
        await adapter.stop()
    assert last is not None and last.returncode is not None
    assert adapter.restart_counts() == {second.instance_id: 1}  # stop was not taken for a crash
