"""Health checks with hysteresis, through the live gateway and the fleet file's `gateway:` block:
an engine whose health check misses once or twice stays in service, one that misses
`health_misses_to_unready` times in a row goes out (and comes back on its first good check);
a refused connection takes it out at once; a gateway whose own event loop is blocked (a 2.5 s
`time.sleep` on the loop, as a huge tokenization would) does not blame its engines."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from aiohttp import web

from engine_adapters.registry import build_adapters, launch_all, stop_all
from fleetcore.fleet_config import parse_fleet
from gateway.embedded import serve_app

MODEL = "m"


@dataclass
class Engine:
    """An engine stand-in whose health answers can be made to hang or fail for the next N checks."""

    hang_next: int = 0
    fail_next: int = 0
    hang_s: float = 5.0
    checks: int = 0  # health requests received
    good: int = 0  # answered 200
    url: str = ""

    async def health(self, request: web.Request) -> web.Response:
        self.checks += 1
        if self.hang_next > 0:
            self.hang_next -= 1
            await asyncio.sleep(self.hang_s)
        if self.fail_next > 0:
            self.fail_next -= 1
            return web.Response(status=503, text="overloaded")
        self.good += 1
        return web.Response(text="ok")

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running 0\n")


@pytest.fixture
async def engine() -> AsyncIterator[tuple[Engine, web.AppRunner]]:
    eng = Engine()
    app = web.Application()
    app.router.add_get("/health", eng.health)
    app.router.add_get("/metrics", eng.metrics)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    eng.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield eng, runner
    await runner.cleanup()


def fleet(deployment: dict[str, Any], **gateway: Any) -> Any:
    return parse_fleet({
        "sites": [{"name": "s1", "region": "r1", "jurisdiction": "x"}],
        "models": [{"name": MODEL, "engine": {"spec": "llama-3.1-8b", "max_model_len": 4096}}],
        "deployments": [{"site": "s1", "model": MODEL, **deployment}],
        "gateway": gateway,
    })


async def until(check: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def unready_logs(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "unready" in r.getMessage()]


@pytest.mark.slow
async def test_one_or_two_missed_checks_keep_an_instance_n_take_it_out(engine, caplog) -> None:
    from gateway.app import create_app

    eng, _ = engine
    config = fleet({"adapter": "static", "urls": [eng.url]},
                   health_interval_s=0.05, health_timeout_s=0.3, health_misses_to_unready=3)
    (adapter,) = build_adapters(config)
    await adapter.launch()
    app = create_app(config, [adapter])
    state = app.state.tokenfleet.state
    caplog.set_level(logging.INFO, logger="tokenfleet.gateway")
    try:
        async with serve_app(app) as url, httpx.AsyncClient(base_url=url) as c:
            (st,) = state.states()
            await until(lambda: st.ready, 5, "the instance to be ready")

            async def misses_then_good(hang: int, fail: int) -> list[bool]:
                """Make the next checks miss, then watch until two good ones followed."""
                seen: list[bool] = []
                eng.hang_next, eng.fail_next = hang, fail
                good0 = eng.good
                deadline = time.monotonic() + 10
                while eng.hang_next or eng.fail_next or eng.good < good0 + 2:
                    seen.append(st.ready)
                    assert time.monotonic() < deadline, "the engine was not checked"
                    await asyncio.sleep(0.01)
                return seen

            caplog.clear()
            # Two checks that time out, then two that answer 503: never more than two in a row.
            assert all(await misses_then_good(hang=2, fail=0))
            assert all(await misses_then_good(hang=0, fail=2))
            assert all(await misses_then_good(hang=1, fail=1))
            assert unready_logs(caplog) == []
            h = (await c.get("/health")).json()
            assert h["status"] == "ok" and h["models"] == {MODEL: 1}

            # Three in a row: out; /health says so; the first good check brings it back.
            eng.fail_next = 3
            await until(lambda: not st.ready, 5, "three misses to take the instance out")
            assert eng.fail_next == 0
            h = (await c.get("/health")).json()
            assert h["status"] == "degraded" and h["unserved_models"] == [MODEL]
            await until(lambda: st.ready, 5, "the instance to come back")
            assert (await c.get("/health")).json()["status"] == "ok"
    finally:
        await adapter.stop()


async def test_refused_connection_takes_an_instance_out_at_once(engine) -> None:
    from gateway.app import create_app

    eng, runner = engine
    # So many misses needed that only the immediate path can take it out within the test.
    config = fleet({"adapter": "static", "urls": [eng.url]},
                   health_interval_s=0.05, health_timeout_s=0.3, health_misses_to_unready=1000)
    (adapter,) = build_adapters(config)
    await adapter.launch()
    app = create_app(config, [adapter])
    state = app.state.tokenfleet.state
    try:
        async with serve_app(app):
            (st,) = state.states()
            await until(lambda: st.ready, 5, "the instance to be ready")
            await runner.cleanup()  # nothing listens there any more
            await until(lambda: not st.ready, 5, "a refused connection to take it out")
            assert "refused" in (st.last_error or "")
    finally:
        await adapter.stop()


@pytest.mark.slow
async def test_blocked_event_loop_does_not_empty_the_fleet(caplog) -> None:
    """A real engine process one 0.3 s round trip away, so checks are in flight most of the
    time; the gateway's loop is blocked for 2.5 s (5x the check timeout, and longer than the
adapter's own 2 s probe timeout) twice while one is.
    Even with a single miss enough to take an instance out, none goes out."""
    from gateway.app import create_app

    config = fleet({"adapter": "sim", "instances": 2, "gpu": "H100",
                    "options": {"time_scale": 0.05, "network_rtt_ms": 300}},
                   health_interval_s=0.05, health_timeout_s=0.5, health_misses_to_unready=1)
    adapters = build_adapters(config)
    await launch_all(adapters)
    (adapter,) = adapters
    in_flight = 0
    for name in ("health", "check"):  # count checks in flight, whichever the gateway calls
        original = getattr(adapter, name, None)
        if original is None:
            continue

        async def counted(instance: Any, _original: Any = original) -> bool:
            nonlocal in_flight
            in_flight += 1
            try:
                return await _original(instance)
            finally:
                in_flight -= 1

        setattr(adapter, name, counted)
    app = create_app(config, adapters)
    state = app.state.tokenfleet.state
    caplog.set_level(logging.INFO, logger="tokenfleet.gateway")
    try:
        async with serve_app(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as c:
            await until(lambda: all(st.ready for st in state.states()), 10, "both instances to be ready")
            caplog.clear()
            for _ in range(2):
                await until(lambda: in_flight > 0, 5, "a health check in flight")
                time.sleep(2.5)  # the loop itself is blocked: nothing else runs
                # Let the checks that were in flight end and a newer one of each instance be judged.
                polls = [st.last_poll for st in state.states()]
                await until(lambda: all(st.last_poll != p for st, p in zip(state.states(), polls, strict=True)),
                            5, "a check after the block")
            assert unready_logs(caplog) == []
            assert all(st.ready for st in state.states())
            h = (await c.get("/health")).json()
            assert h["status"] == "ok" and h["ready_instances"] == 2
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200
            assert state.lag.max_lag_s >= 2.4  # the block was seen for what it was
    finally:
        await stop_all(adapters)
