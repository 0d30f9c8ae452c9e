"""The relay over real sockets: streaming order, usage stripping, cancellation, retry, mid-stream failure."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from fleetcore.types import RequestOutcome
from gateway.app import create_app
from tokenpilot.baselines import LeastLoaded

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "tell me a story"}]


class RecordingRouter(LeastLoaded):
    """LeastLoaded (ties go to the lowest instance id) that remembers the outcomes it is told."""

    def __init__(self) -> None:
        self.outcomes: list[RequestOutcome] = []

    def observe(self, outcome: RequestOutcome) -> None:
        self.outcomes.append(outcome)


@dataclass
class Gateway:
    url: str
    app: Any
    router: RecordingRouter

    def instance_ready(self, instance_id: str) -> bool:
        return self.app.state.tokenfleet.state.get(instance_id).ready

    def inflight(self, instance_id: str) -> int:
        return self.app.state.tokenfleet.state.get(instance_id).inflight


@pytest.fixture
def start_gateway(gateway_server: Callable[[Any], Awaitable[str]], fake_adapter: Any,
                  instance_factory: Any, config_factory: Any) -> Callable[..., Awaitable[Gateway]]:
    async def start(urls: dict[str, str]) -> Gateway:
        """One ready instance per (id → url), all in site use1; polling too slow to interfere."""
        adapter = fake_adapter([instance_factory(iid, url) for iid, url in urls.items()])
        router = RecordingRouter()
        app = create_app(config_factory(), [adapter], router=router, poll_interval_s=60)
        return Gateway(await gateway_server(app), app, router)
    return start


def sse_events(text: str) -> list[str]:
    """The data payloads of an SSE body, in order."""
    return [e.removeprefix("data: ") for e in text.split("\n\n") if e.strip()]


def contents(events: list[str]) -> list[str]:
    out = []
    for e in events:
        if e != "[DONE]":
            obj = json.loads(e)
            out += [c["delta"]["content"] for c in obj.get("choices", []) if c.get("delta", {}).get("content")]
    return out


async def wait_until(cond: Callable[[], bool], timeout: float = 1.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(0.01)
    return cond()


async def test_stream_relayed_in_order_with_headers(stub_upstream: Any, start_gateway: Any) -> None:
    stub = await stub_upstream(chunks=6, delay_s=0.05)
    gw = await start_gateway({"i0": stub.url})
    body = {"model": "m1", "messages": MSGS, "stream": True, "max_tokens": 6, "ignore_eos": True}
    arrivals: list[float] = []
    text = b""
    async with aiohttp.ClientSession() as s, s.post(gw.url + CHAT, json=body,
                                                    headers={"x-request-id": "trace-1"}) as r:
        assert r.status == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert (r.headers["x-tokenfleet-instance"], r.headers["x-tokenfleet-site"]) == ("i0", "use1")
        assert r.headers["x-request-id"] == "trace-1"
        async for chunk in r.content.iter_any():
            arrivals.append(time.monotonic())
            text += chunk
    events = sse_events(text.decode())
    assert contents(events) == [f" tok{i}" for i in range(6)]
    assert events[-1] == "[DONE]"
    assert not any('"usage": {' in e for e in events), "usage chunk leaked to a client that did not ask"
    assert arrivals[-1] - arrivals[0] > 0.15, "stream was buffered instead of relayed chunk by chunk"
    sent = stub.requests[0]
    assert sent["body"]["stream_options"] == {"include_usage": True}
    assert sent["body"]["ignore_eos"] is True and sent["body"]["model"] == "m1"
    assert sent["headers"]["x-request-id"] == "trace-1"
    assert await wait_until(lambda: len(gw.router.outcomes) == 1)
    out = gw.router.outcomes[0]
    assert out.ok and out.output_tokens == 6 and out.cached_tokens == 16
    # the stub sends its first token at once, then sleeps 0.05 s before each of the other five
    assert out.ttft_s is not None and out.e2e_s is not None and 0 < out.ttft_s < out.e2e_s
    assert out.e2e_s - out.ttft_s >= 5 * 0.05 - 0.01, (out.ttft_s, out.e2e_s)
    assert gw.inflight("i0") == 0


async def test_usage_chunk_kept_when_client_asks(stub_upstream: Any, start_gateway: Any) -> None:
    stub = await stub_upstream(chunks=3, delay_s=0.01)
    gw = await start_gateway({"i0": stub.url})
    body = {"model": "m1", "messages": MSGS, "stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as s, s.post(gw.url + CHAT, json=body) as r:
        events = sse_events((await r.read()).decode())
    usage = json.loads(events[-2])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
    assert events[-1] == "[DONE]"


async def test_non_stream_passthrough(stub_upstream: Any, start_gateway: Any) -> None:
    stub = await stub_upstream(chunks=3, delay_s=0.01)
    gw = await start_gateway({"i0": stub.url})
    body = {"model": "m1", "prompt": "once upon a time", "max_tokens": 3}
    async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/completions", json=body) as r:
        assert r.status == 200
        assert r.headers["x-tokenfleet-instance"] == "i0" and r.headers["x-request-id"]
        answer = await r.json()
    assert answer["choices"][0]["text"] == " tok0 tok1 tok2"
    assert answer["usage"]["completion_tokens"] == 3
    assert "stream_options" not in stub.requests[0]["body"]
    assert await wait_until(lambda: len(gw.router.outcomes) == 1)
    assert gw.router.outcomes[0].output_tokens == 3


async def test_client_disconnect_mid_stream_aborts_upstream(stub_upstream: Any, start_gateway: Any) -> None:
    stub = await stub_upstream(chunks=200, delay_s=0.05)
    gw = await start_gateway({"i0": stub.url})
    body = {"model": "m1", "messages": MSGS, "stream": True}
    async with aiohttp.ClientSession() as s:
        r = await s.post(gw.url + CHAT, json=body)
        assert b"tok0" in await r.content.readuntil(b"\n\n")
        r.close()  # the client walks away mid-stream
        left = time.monotonic()
        await asyncio.wait_for(stub.aborted.wait(), 1.0)
    assert stub.aborts[0] - left < 1.0 and stub.completed == 0
    assert await wait_until(lambda: gw.inflight("i0") == 0)
    assert gw.router.outcomes[-1].cancelled


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_before_first_token_aborts_upstream(stub_upstream: Any, start_gateway: Any,
                                                                    stream: bool) -> None:
    """A client that gives up during a long prefill must free the engine too."""
    stub = await stub_upstream(chunks=2, first_delay_s=10)
    gw = await start_gateway({"i0": stub.url})
    body = {"model": "m1", "messages": MSGS, "stream": stream}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as s:
        with pytest.raises(asyncio.TimeoutError):
            async with s.post(gw.url + CHAT, json=body) as r:
                await r.read()
    await asyncio.wait_for(stub.aborted.wait(), 1.0)
    assert await wait_until(lambda: gw.inflight("i0") == 0)


async def test_refused_connection_retried_elsewhere(stub_upstream: Any, start_gateway: Any,
                                                    refused_url: str) -> None:
    stub = await stub_upstream(chunks=3, delay_s=0.01)
    gw = await start_gateway({"a-dead": refused_url, "b-live": stub.url})
    body = {"model": "m1", "messages": MSGS, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(gw.url + CHAT, json=body) as r:
        assert r.status == 200
        assert r.headers["x-tokenfleet-instance"] == "b-live"
        events = sse_events((await r.read()).decode())
    assert contents(events) == [" tok0", " tok1", " tok2"]
    assert not gw.instance_ready("a-dead") and gw.instance_ready("b-live")
    async with aiohttp.ClientSession() as s:
        health = await (await s.get(gw.url + "/health")).json()
        metrics = await (await s.get(gw.url + "/metrics")).text()
        decisions = await (await s.get(gw.url + "/debug/decisions")).json()
    assert health["ready_instances"] == 1
    assert 'tokenfleet_retries_total{model="m1"} 1.0' in metrics
    assert [d["instance"] for d in decisions["decisions"]] == ["a-dead", "b-live"]
    assert decisions["decisions"][1]["excluded"] == ["a-dead"]
    assert [o.ok for o in gw.router.outcomes] == [False, True]


async def test_5xx_before_first_byte_retried_then_502(stub_upstream: Any, start_gateway: Any) -> None:
    bad1 = await stub_upstream(mode="error500")
    good = await stub_upstream(chunks=2, delay_s=0.01)
    gw = await start_gateway({"a-bad": bad1.url, "b-good": good.url})
    body = {"model": "m1", "messages": MSGS}
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + CHAT, json=body) as r:
            assert r.status == 200 and r.headers["x-tokenfleet-instance"] == "b-good"
        # Both instances failing: one retry only, then an OpenAI-shaped 502.
        bad2 = await stub_upstream(mode="error500")
        gw2 = await start_gateway({"a": bad1.url, "b": bad2.url})
        async with s.post(gw2.url + CHAT, json=body) as r:
            assert r.status == 502
            err = (await r.json())["error"]
    assert err["type"] == "server_error" and err["code"] == "upstream_error" and "engine exploded" in err["message"]
    assert len(bad1.requests) == 2 and len(bad2.requests) == 1


async def test_upstream_4xx_passed_through(stub_upstream: Any, start_gateway: Any) -> None:
    stub = await stub_upstream(mode="bad_request")
    gw = await start_gateway({"i0": stub.url})
    async with aiohttp.ClientSession() as s, s.post(gw.url + CHAT, json={"model": "m1", "messages": MSGS}) as r:
        assert r.status == 400
        assert (await r.json())["error"]["param"] == "logit_bias"
    assert gw.instance_ready("i0") and len(stub.requests) == 1


async def test_failure_mid_stream_ends_with_error_event(stub_upstream: Any, start_gateway: Any) -> None:
    stub = await stub_upstream(mode="fail_midstream", chunks=5, fail_after=2, delay_s=0.02)
    gw = await start_gateway({"i0": stub.url})
    body = {"model": "m1", "messages": MSGS, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(gw.url + CHAT, json=body) as r:
        assert r.status == 200
        events = sse_events((await r.read()).decode())
    assert contents(events[:-2]) == [" tok0", " tok1"]
    err = json.loads(events[-2])["error"]
    assert err["type"] == "server_error" and err["code"] == "upstream_error" and err["message"]
    assert events[-1] == "[DONE]"
    assert await wait_until(lambda: len(gw.router.outcomes) == 1)
    assert not gw.router.outcomes[0].ok and gw.inflight("i0") == 0
    assert not gw.instance_ready("i0"), "an engine that dropped the connection must be taken out"
