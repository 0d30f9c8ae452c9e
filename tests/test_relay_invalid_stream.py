"""An engine stream the relay cannot read (an event of a shape no parser expected) ends the client's
stream with an SSE error event and [DONE], a properly ended response: never a cut connection.

Before, the relay's parser raised out of the response: uvicorn dropped the connection mid-body
(the client saw a broken chunked response and no error event), and the dispatch was booked as a
client that left (499). Before the first event it was a 500 rather than a retry elsewhere and a
502. The Responses API's translation of the stream likewise ends with `error` and `response.failed`.
Real gateway on uvicorn over a real aiohttp engine stand-in."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.app import create_app

GOOD = {"id": "cmpl-x", "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": " tok0"}, "finish_reason": None}]}
BAD = {"id": "cmpl-x", "object": "chat.completion.chunk", "choices": 5}


@pytest.fixture
async def engine() -> AsyncIterator[Callable[..., Awaitable[str]]]:
    """An engine that streams the given events, each after the first once `go` is set (the client
    has the first: the events reach the gateway in reads of their own), then [DONE]."""
    runners: list[web.AppRunner] = []

    async def start(events: list[dict[str, Any]], go: asyncio.Event | None = None) -> str:
        async def generate(request: web.Request) -> web.StreamResponse:
            if not (await request.json()).get("stream"):
                return web.json_response(events[0])  # a whole answer: the first "event"
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i, ev in enumerate(events):
                if i and go is not None:
                    await asyncio.wait_for(go.wait(), 30)
                await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp

        async def health(request: web.Request) -> web.Response:
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_post("/v1/chat/completions", generate)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for r in runners:
        await r.cleanup()


async def _gateway(gateway_server: Any, fake_adapter: Any, instance_factory: Any, config_factory: Any,
                   url: str) -> tuple[str, Any]:
    app = create_app(config_factory(), [fake_adapter([instance_factory("i0", url)])], poll_interval_s=60)
    return await gateway_server(app), app


async def _chat(url: str, go: asyncio.Event | None = None) -> tuple[int, bytes]:
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=body) as r:
        got = b""
        async with asyncio.timeout(30):
            if go is not None and r.status == 200:
                while b"\n\n" not in got:  # the first event, then the engine goes on
                    got += await r.content.readany()
                go.set()
            return r.status, got + await r.read()  # a cut chunked body raises ClientPayloadError here


async def test_an_unreadable_event_mid_stream_ends_it_with_an_error_event(
        engine: Any, gateway_server: Any, fake_adapter: Any, instance_factory: Any, config_factory: Any) -> None:
    go = asyncio.Event()
    gw, app = await _gateway(gateway_server, fake_adapter, instance_factory, config_factory,
                             await engine([GOOD, BAD], go))
    status, body = await _chat(gw, go)
    assert status == 200
    events = [e for e in body.decode().split("\n\n") if e]
    assert json.loads(events[0].removeprefix("data: ")) == GOOD  # what came before is relayed
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert error["code"] == "upstream_error" and "could not relay" in error["message"]
    assert events[2:] == ["data: [DONE]"]
    metrics = app.state.tokenfleet.metrics.render(per_tenant=True).decode()
    assert 'tokenfleet_upstream_errors_total{instance="i0",kind="stream_invalid"} 1.0' in metrics


async def test_an_unreadable_first_event_is_a_502_not_a_500(
        engine: Any, gateway_server: Any, fake_adapter: Any, instance_factory: Any, config_factory: Any) -> None:
    gw, _ = await _gateway(gateway_server, fake_adapter, instance_factory, config_factory, await engine([BAD]))
    status, body = await _chat(gw)
    assert status == 502
    assert json.loads(body)["error"]["code"] == "upstream_error"


async def test_a_responses_stream_ends_with_response_failed_on_a_chunk_it_cannot_translate(
        engine: Any, gateway_server: Any, fake_adapter: Any, instance_factory: Any, config_factory: Any) -> None:
    # The relay reads this usage chunk (it counts what it can); the Responses translation cannot.
    odd_usage = {"id": "cmpl-x", "object": "chat.completion.chunk", "choices": [],
                 "usage": {"prompt_tokens": "many", "completion_tokens": 1}}
    go = asyncio.Event()
    gw, _ = await _gateway(gateway_server, fake_adapter, instance_factory, config_factory,
                           await engine([GOOD, odd_usage], go))
    body = {"model": "m1", "input": "hi", "max_output_tokens": 4, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(gw + "/v1/responses", json=body) as r:
        assert r.status == 200
        got = b""
        async with asyncio.timeout(30):
            while b"response.output_text.delta" not in got:
                got += await r.content.readany()
            go.set()
            got += await r.read()  # a cut chunked body raises ClientPayloadError here
    kinds = [line.removeprefix("event: ") for line in got.decode().splitlines() if line.startswith("event: ")]
    assert kinds[-2:] == ["error", "response.failed"]


async def test_a_whole_responses_answer_it_cannot_translate_is_a_502_not_a_500(
        engine: Any, gateway_server: Any, fake_adapter: Any, instance_factory: Any, config_factory: Any) -> None:
    gw, _ = await _gateway(gateway_server, fake_adapter, instance_factory, config_factory,
                           await engine([{"id": "cmpl-x", "object": "chat.completion", "choices": 5}]))
    async with aiohttp.ClientSession() as s, s.post(gw + "/v1/responses", json={"model": "m1", "input": "hi"}) as r:
        assert r.status == 502
        assert (await r.json())["error"]["code"] == "upstream_error"
