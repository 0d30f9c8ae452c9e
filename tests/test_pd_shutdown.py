"""The P/D flow's bounds: what its prefill leg may hold, and how long it may outlive the app.

The app's lifespan ends the P/D flow's background work: an SGLang prefill leg still running when
its decode leg's answer was handed over (`PDFlow._after_decode` leaves it in the background, bounded
by its first-byte deadline) is cancelled at shutdown. `PDFlow.close` existed and nothing called it:
such a leg outlived the app it belonged to, its engine connection and in-flight count with it."""

from __future__ import annotations

import asyncio
from typing import Any

from fleetcore.fleet_config import parse_fleet
from gateway.app import create_app
from gateway.embedded import serve_app

FLEET = parse_fleet({
    "sites": [{"name": "use1", "region": "us-east", "jurisdiction": "us"}],
    "models": [{"name": "m1", "versions": ["v1"], "engine": {"spec": "llama-3.1-8b", "max_model_len": 4096}}],
    "deployments": [{"site": "use1", "model": "m1", "adapter": "sim", "instances": 2, "gpu": "H100",
                     "roles": {"prefill": 1, "decode": 1}}],
})


async def test_shutdown_cancels_prefill_legs_left_in_the_background(
        stub_upstream: Any, fake_adapter: Any, instance_factory: Any) -> None:
    stub = await stub_upstream()
    app = create_app(FLEET, [fake_adapter([instance_factory("use1/m1/0", stub.url)])], poll_interval_s=60)
    pd = app.state.tokenfleet.relay.pd
    assert pd is not None  # a P/D fleet under TokenPilot
    async with serve_app(app):
        started = asyncio.Event()

        async def prefill_leg() -> None:  # as `_prefill`: waiting on its engine's answer
            started.set()
            await asyncio.Event().wait()

        leg = asyncio.create_task(prefill_leg())
        pd._background.add(leg)  # where `_after_decode` leaves a leg still running
        await asyncio.wait_for(started.wait(), 10)
    try:
        assert leg.done() and leg.cancelled()  # ended with the app, not left running
    finally:
        leg.cancel()


async def test_a_prefill_answer_past_the_bound_fails_the_leg_not_the_gateways_memory(
        fake_adapter: Any, instance_factory: Any, monkeypatch: Any) -> None:
    # The prefill leg reads its engine's whole answer (one token and the KV's address): it used to
    # read without a bound for as long as its first-byte deadline (GBs over loopback from an engine
    # whose answer never ends). Now it holds at most MAX_EVENT_BYTES, the relay's bound on any one
    # engine answer (made small here), and fails the leg as an unusable answer.
    from types import SimpleNamespace

    import pytest

    import gateway.pd_flow as pd_flow
    from tests.endless_server import endless_body_server

    monkeypatch.setattr(pd_flow, "MAX_EVENT_BYTES", 1 << 20)
    async with endless_body_server() as url:
        app = create_app(FLEET, [fake_adapter([instance_factory("use1/m1/0", url)])], poll_interval_s=60)
        pd = app.state.tokenfleet.relay.pd
        async with serve_app(app):
            parsed = SimpleNamespace(profile=SimpleNamespace(request_id="r1"))
            pre = SimpleNamespace(instance=SimpleNamespace(instance_id="use1/m1/0", url=url), route=None)
            with pytest.raises(pd_flow.PrefillFailed) as failed:
                await asyncio.wait_for(pd._prefill(parsed, "/v1/completions", pre, {"prompt": "x"}), 30)
    assert failed.value.kind == "prefill_answer" and "larger than 1048576 bytes" in failed.value.public
