"""An engine stream the relay cannot read (an event of a shape no parser expected) ends the client's
stream with an SSE error event and [DONE], a properly ended response: never a cut connection.

Before, the relay's parser raised out of the response: uvicorn dropped the connection mid-body
(the client saw a broken chunked response and no error event), and the dispatch was booked as a
client that left (499). Before the first event it was a 500 rather than a retry elsewhere and a
502. The Responses API's translation of the stream likewise ends with `error` and `response.failed`.
Real gateway on uvicorn over a real aiohttp engine stand-in."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from fleetcore.types import RequestOutcome
from gateway.app import create_app
from gateway.continuation import Continuation
from gateway.slo_log import Finished
from slomax.ledger import Cell

GOOD = {"id": "cmpl-x", "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": " tok0"}, "finish_reason": None}]}
BAD = {"id": "cmpl-x", "object": "chat.completion.chunk", "choices": 5}


@pytest.fixture
async def engine() -> AsyncIterator[Callable[..., Awaitable[str]]]:
    """An engine that streams the given events, each after the first once `go` is set (the client
    has the first: the events reach the gateway in reads of their own), then [DONE] (`done_after_s`
    later: in a read of its own too)."""
    runners: list[web.AppRunner] = []

    async def start(events: list[dict[str, Any]], go: asyncio.Event | None = None, done_after_s: float = 0.0) -> str:
        async def generate(request: web.Request) -> web.StreamResponse:
            if not (await request.json()).get("stream"):
                return web.json_response(events[0])  # a whole answer: the first "event"
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            with contextlib.suppress(ConnectionResetError):  # the gateway may have hung up (and aborted)
                for i, ev in enumerate(events):
                    if i and go is not None:
                        await asyncio.wait_for(go.wait(), 30)
                    await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
                if done_after_s:
                    await asyncio.sleep(done_after_s)
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


# --- what the gateway books: every record says what the client got ---
#
# The client's answer alone was not enough: the Responses API translated the relay's answer after
# the relay had booked it. A whole answer it could not translate reached the client as a 502 but
# the access log, `tokenfleet_requests_total`, the goodput ledger and the router had a success;
# a stream whose chunk it could not translate ended with `response.failed` but was booked as a
# client that left (499), or as a success when [DONE] came in the same read.

class Told:
    """What the policies that learn were told of each attempt (the router's and site chooser's
    feed too: `Relay.observe` hands every listener the same outcome)."""

    def __init__(self) -> None:
        self.outcomes: list[RequestOutcome] = []

    def arrived(self, profile: Any) -> None:
        pass

    def observe(self, outcome: RequestOutcome) -> None:
        self.outcomes.append(outcome)


@dataclass
class Books:
    access: dict[str, Any]  # the request's access log line
    slo_misses: list[Finished]  # the SLO log's missed-SLO listing
    requests: dict[str, float]  # tokenfleet_requests_total by status
    upstream_errors: dict[str, float]  # tokenfleet_upstream_errors_total by kind
    ledger: Cell  # the goodput ledger's totals
    outcomes: list[RequestOutcome]


def _samples(metrics: str, name: str, label: str) -> dict[str, float]:
    return {s.labels[label]: s.value for family in text_string_to_metric_families(metrics)
            for s in family.samples if s.name == name}


async def _books(app: Any, caplog: pytest.LogCaptureFixture, told: Told) -> Books:
    """Once the request's access log line is written (a stream's after its last byte reached the client)."""
    ctx = app.state.tokenfleet
    async with asyncio.timeout(10):
        while not (lines := [r.fields for r in caplog.records if r.name == "tokenfleet.access"]):
            await asyncio.sleep(0.01)
    [access] = lines
    metrics = ctx.metrics.render(per_tenant=True).decode()
    ledger = Cell()
    for cell in ctx.admission.policy.ledger.totals.values():
        ledger.add(cell)
    return Books(access, ctx.telemetry.slo_log.misses(), _samples(metrics, "tokenfleet_requests_total", "status"),
                 _samples(metrics, "tokenfleet_upstream_errors_total", "kind"), ledger, told.outcomes)


def _booked_failed(b: Books, status: str, kind: str) -> None:
    """Booked as the engine's failure, everywhere: not a success, not a client that left."""
    assert (b.access["status"], b.access["outcome"], b.access["slo_met"]) == (status, "failed", False)
    assert [(f.status, f.outcome) for f in b.slo_misses] == [(status, "failed")]
    assert b.requests == {status: 1.0}
    assert b.upstream_errors == {kind: 1.0}
    assert (b.ledger.completed, b.ledger.cancelled, b.ledger.failed) == (0, 0, 1)
    assert [(o.ok, o.cancelled) for o in b.outcomes] == [(False, False)]


async def _watched(gateway_server: Any, fake_adapter: Any, instance_factory: Any, config_factory: Any,
                   url: str, caplog: pytest.LogCaptureFixture) -> tuple[str, Any, Told]:
    caplog.set_level(logging.INFO, logger="tokenfleet.access")
    gw, app = await _gateway(gateway_server, fake_adapter, instance_factory, config_factory, url)
    told = Told()
    app.state.tokenfleet.relay.listeners.append(told)
    return gw, app, told


ODD_USAGE = {"id": "cmpl-x", "object": "chat.completion.chunk", "choices": [],
             "usage": {"prompt_tokens": "many", "completion_tokens": 1}}


async def test_a_chat_stream_the_relay_cannot_read_is_booked_as_the_engines_failure(
        engine: Any, gateway_server: Any, fake_adapter: Any, instance_factory: Any, config_factory: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    """The chat path's booking, which the Responses API's must match."""
    go = asyncio.Event()
    gw, app, told = await _watched(gateway_server, fake_adapter, instance_factory, config_factory,
                                   await engine([GOOD, BAD], go), caplog)
    assert (await _chat(gw, go))[0] == 200
    _booked_failed(await _books(app, caplog, told), "stream_error", "stream_invalid")


@pytest.mark.parametrize("done_after_s", [0.0, 0.5], ids=["done_with_it", "done_later"])
async def test_a_responses_stream_it_cannot_translate_is_booked_as_the_engines_failure(
        engine: Any, gateway_server: Any, fake_adapter: Any, instance_factory: Any, config_factory: Any,
        caplog: pytest.LogCaptureFixture, done_after_s: float) -> None:
    """[DONE] in the read the translation fails on was booked a success (the stream was over);
    [DONE] yet to come, a client that left (499)."""
    go = asyncio.Event()
    gw, app, told = await _watched(gateway_server, fake_adapter, instance_factory, config_factory,
                                   await engine([GOOD, ODD_USAGE], go, done_after_s), caplog)
    body = {"model": "m1", "input": "hi", "max_output_tokens": 4, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(gw + "/v1/responses", json=body) as r:
        got = b""
        async with asyncio.timeout(30):
            while b"response.output_text.delta" not in got:
                got += await r.content.readany()
            go.set()
            got += await r.read()
    assert b"event: response.failed" in got
    _booked_failed(await _books(app, caplog, told), "stream_error", "stream_invalid")


async def test_a_whole_responses_answer_it_cannot_translate_is_booked_as_a_502(
        engine: Any, gateway_server: Any, fake_adapter: Any, instance_factory: Any, config_factory: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    gw, app, told = await _watched(gateway_server, fake_adapter, instance_factory, config_factory,
                                   await engine([{"id": "cmpl-x", "object": "chat.completion", "choices": 5}]), caplog)
    async with aiohttp.ClientSession() as s, s.post(gw + "/v1/responses", json={"model": "m1", "input": "hi"}) as r:
        assert r.status == 502
        assert "engine instance i0" in (await r.json())["error"]["message"]
    _booked_failed(await _books(app, caplog, told), "502", "answer_invalid")


async def test_a_whole_responses_answer_read_as_a_stream_it_cannot_translate_is_booked_as_a_502(
        engine: Any, gateway_server: Any, fake_adapter: Any, instance_factory: Any, config_factory: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    """A whole answer that may be continued is read from the engine as a stream and assembled
    (`Relay._assembled`): its translation fails after the stream's [DONE]."""
    gw, app, told = await _watched(gateway_server, fake_adapter, instance_factory, config_factory,
                                   await engine([GOOD, ODD_USAGE]), caplog)
    _continuable(app)
    async with aiohttp.ClientSession() as s, s.post(gw + "/v1/responses", json={"model": "m1", "input": "hi"}) as r:
        assert r.status == 502
        assert "engine instance i0" in (await r.json())["error"]["message"]
    _booked_failed(await _books(app, caplog, told), "502", "answer_invalid")


def _continuable(app: Any) -> None:
    """Every request may be continued: a whole answer is read from the engine as a stream and
    assembled (`Relay._assembled`), as on a fleet of simulated engines."""
    relay = app.state.tokenfleet.relay
    relay.continuation = lambda parsed: Continuation(parsed, relay.continuation_limits, None)


async def test_a_whole_chat_answer_read_as_a_stream_it_cannot_assemble_is_a_502_booked_as_such(
        engine: Any, gateway_server: Any, fake_adapter: Any, instance_factory: Any, config_factory: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    """Was a 500 "internal error", booked as a success (its dispatch ended at [DONE])."""
    odd_text = {"id": "cmpl-x", "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": 5}, "finish_reason": None}]}
    gw, app, told = await _watched(gateway_server, fake_adapter, instance_factory, config_factory,
                                   await engine([odd_text]), caplog)
    _continuable(app)
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with aiohttp.ClientSession() as s, s.post(gw + "/v1/chat/completions", json=body) as r:
        assert r.status == 502
        error = (await r.json())["error"]
        assert error["code"] == "upstream_error" and "engine instance i0" in error["message"]
    _booked_failed(await _books(app, caplog, told), "502", "answer_invalid")


@pytest.mark.parametrize("read_as_a_stream", [False, True])
async def test_a_whole_responses_answer_is_booked_as_a_success(
        engine: Any, gateway_server: Any, fake_adapter: Any, instance_factory: Any, config_factory: Any,
        caplog: pytest.LogCaptureFixture, read_as_a_stream: bool) -> None:
    usage = {"prompt_tokens": 3, "completion_tokens": 1}
    whole = {"id": "cmpl-x", "object": "chat.completion", "usage": usage,
             "choices": [{"index": 0, "message": {"role": "assistant", "content": " tok0"}, "finish_reason": "stop"}]}
    usage_chunk = {"id": "cmpl-x", "object": "chat.completion.chunk", "choices": [], "usage": usage}
    gw, app, told = await _watched(gateway_server, fake_adapter, instance_factory, config_factory,
                                   await engine([GOOD, usage_chunk] if read_as_a_stream else [whole]), caplog)
    if read_as_a_stream:
        _continuable(app)
    async with aiohttp.ClientSession() as s, s.post(gw + "/v1/responses", json={"model": "m1", "input": "hi"}) as r:
        assert r.status == 200 and r.content_type == "application/json"
        answer = await r.json()
    assert (answer["object"], answer["status"], answer["output"][0]["content"][0]["text"]) == \
        ("response", "completed", " tok0")
    b = await _books(app, caplog, told)
    assert (b.access["status"], b.access["outcome"], b.access["slo_met"]) == ("200", "ok", True)
    assert (b.requests, b.upstream_errors, b.slo_misses) == ({"200": 1.0}, {}, [])
    assert (b.ledger.completed, b.ledger.cancelled, b.ledger.failed) == (1, 0, 0)
    assert [(o.ok, o.cancelled, o.output_tokens) for o in b.outcomes] == [(True, False, 1)]


# --- the Responses stream books what the chat stream books (these were right; kept so) ---

def _stream_request(api: str) -> tuple[str, dict[str, Any]]:
    if api == "chat":
        return "/v1/chat/completions", {"model": "m1", "messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": 4, "stream": True}
    return "/v1/responses", {"model": "m1", "input": "hi", "max_output_tokens": 4, "stream": True}


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_an_engine_error_event_mid_stream_is_booked_as_a_failed_stream(
        engine: Any, gateway_server: Any, fake_adapter: Any, instance_factory: Any, config_factory: Any,
        caplog: pytest.LogCaptureFixture, api: str) -> None:
    go = asyncio.Event()
    gw, app, told = await _watched(gateway_server, fake_adapter, instance_factory, config_factory,
                                   await engine([GOOD, {"error": {"message": "engine blew up"}}], go), caplog)
    path, body = _stream_request(api)
    async with aiohttp.ClientSession() as s, s.post(gw + path, json=body) as r:
        await r.content.readany()
        go.set()
        await r.read()
    b = await _books(app, caplog, told)
    assert (b.access["status"], b.access["outcome"], b.requests) == ("stream_error", "failed", {"stream_error": 1.0})
    assert (b.ledger.completed, b.ledger.cancelled, b.ledger.failed) == (0, 0, 1)
    assert [(o.ok, o.cancelled) for o in b.outcomes] == [(False, False)]
    assert b.upstream_errors == {"stream_error": 1.0}  # the engine's failure, counted as one


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_a_client_that_leaves_mid_stream_is_booked_as_one(
        engine: Any, gateway_server: Any, fake_adapter: Any, instance_factory: Any, config_factory: Any,
        caplog: pytest.LogCaptureFixture, api: str) -> None:
    go = asyncio.Event()
    gw, app, told = await _watched(gateway_server, fake_adapter, instance_factory, config_factory,
                                   await engine([GOOD, GOOD], go), caplog)
    path, body = _stream_request(api)
    async with aiohttp.ClientSession() as s:
        r = await s.post(gw + path, json=body)
        got = b""
        async with asyncio.timeout(30):
            while b"tok0" not in got:
                got += await r.content.readany()
        r.close()  # gone with the engine's second event still to come
        b = await _books(app, caplog, told)
    go.set()
    assert (b.access["status"], b.access["outcome"], b.requests) == ("499", "cancelled", {"499": 1.0})
    assert (b.upstream_errors, b.ledger.completed, b.ledger.cancelled, b.ledger.failed) == ({}, 0, 1, 0)
    assert [(o.ok, o.cancelled) for o in b.outcomes] == [(False, True)]
