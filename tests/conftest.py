"""Shared fixtures: a stub OpenAI upstream (aiohttp.web) and a gateway served by uvicorn.

Both listen on real sockets on 127.0.0.1, so tests see what a client sees:
chunked SSE, disconnects, refused connections. `FakeAdapter` stands in for an
engine adapter over given instances (the real ones launch processes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from aiohttp import web

from engine_adapters.base import EngineAdapter, Instance, LoadSnapshot
from fleetcore.fleet_config import FleetConfig, parse_fleet
from gateway.listener import bind_socket, build_listeners, protocol_class


@pytest.fixture(scope="session", autouse=True)
def _session_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Gateways under test (in process or `tokenfleet up` subprocesses) keep durable state, such
    as region policy snapshots, in this session's own directory, never in ~/.local/state."""
    import os

    old = os.environ.get("TOKENFLEET_STATE_DIR")
    os.environ["TOKENFLEET_STATE_DIR"] = str(tmp_path_factory.mktemp("tokenfleet-state"))
    yield
    if old is None:
        os.environ.pop("TOKENFLEET_STATE_DIR", None)
    else:
        os.environ["TOKENFLEET_STATE_DIR"] = old


# --- stub upstream ---

@dataclass
class StubUpstream:
    """An OpenAI-compatible engine stand-in that streams slowly and records what happened.

    mode: "ok", "error500" (every request answers 500), "fail_midstream" (drops the
    connection after `fail_after` chunks), "bad_request" (answers an OpenAI 400).
    """

    mode: str = "ok"
    chunks: int = 4
    delay_s: float = 0.05
    first_delay_s: float = 0.0
    fail_after: int = 2
    url: str = ""
    requests: list[dict[str, Any]] = field(default_factory=list)
    aborts: list[float] = field(default_factory=list)  # monotonic time a client disconnect was seen
    completed: int = 0
    aborted: asyncio.Event = field(default_factory=asyncio.Event)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_get("/health", self._health)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()  # (kept: tests of what bytes the gateway sends)
        body = json.loads(raw)
        self.requests.append({"path": request.path, "body": body, "raw": raw,
                              "headers": {k.lower(): v for k, v in request.headers.items()}})
        if self.mode == "error500":
            return web.json_response({"error": {"message": "engine exploded", "type": "server_error"}},
                                     status=500)
        if self.mode == "bad_request":
            return web.json_response({"error": {"message": "bad logit_bias", "type": "invalid_request_error",
                                                 "param": "logit_bias", "code": None}}, status=400)
        chat = request.path.endswith("chat/completions")
        try:
            if body.get("stream"):
                return await self._stream(request, body, chat)
            await asyncio.sleep(self.first_delay_s + self.delay_s * self.chunks)
            self.completed += 1
            return web.json_response(_whole(body, chat, self.chunks))
        except (asyncio.CancelledError, ConnectionResetError):
            self.aborts.append(time.monotonic())
            self.aborted.set()
            raise

    async def _stream(self, request: web.Request, body: dict[str, Any], chat: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(self.first_delay_s)
        for i in range(self.chunks):
            if self.mode == "fail_midstream" and i == self.fail_after:
                assert request.transport is not None
                request.transport.abort()  # an engine crash: no terminating chunk
                return resp
            await resp.write(_sse(_chunk(i, chat)))
            await asyncio.sleep(self.delay_s)
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(_sse({"id": "cmpl-stub", "object": "chunk", "choices": [],
                                   "usage": _usage(self.chunks)}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        self.completed += 1
        return resp


def _sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def _usage(n: int) -> dict[str, Any]:
    return {"prompt_tokens": 20, "completion_tokens": n, "total_tokens": 20 + n,
            "prompt_tokens_details": {"cached_tokens": 16}}


def _chunk(i: int, chat: bool) -> dict[str, Any]:
    text = f" tok{i}"
    choice: dict[str, Any] = ({"index": 0, "delta": {"content": text}, "finish_reason": None} if chat
                              else {"index": 0, "text": text, "finish_reason": None})
    return {"id": "cmpl-stub", "object": "chat.completion.chunk" if chat else "text_completion",
            "choices": [choice], "usage": None}


def _whole(body: dict[str, Any], chat: bool, n: int) -> dict[str, Any]:
    text = "".join(f" tok{i}" for i in range(n))
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
              if chat else {"index": 0, "text": text, "finish_reason": "length"})
    return {"id": "cmpl-stub", "object": "chat.completion" if chat else "text_completion",
            "model": body.get("model"), "choices": [choice], "usage": _usage(n)}


@pytest.fixture
async def stub_upstream() -> AsyncIterator[Callable[..., Awaitable[StubUpstream]]]:
    """Factory: `await stub_upstream(mode="ok", chunks=4, delay_s=0.05)` → a running stub."""
    runners: list[web.AppRunner] = []

    async def start(**options: Any) -> StubUpstream:
        stub = StubUpstream(**options)
        # handler_cancellation: the handler is cancelled the moment its client goes away
        runner = web.AppRunner(stub.app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        stub.url = f"http://127.0.0.1:{port}"
        runners.append(runner)
        return stub

    yield start
    for runner in runners:
        await runner.cleanup()


def _refused_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# --- fake adapter and fleet config ---

class FakeAdapter(EngineAdapter):
    """Fixed instances with a settable ready flag; no processes, no scraping."""

    name = "fake"

    def __init__(self, instances: list[Instance], ready: bool = True) -> None:
        self._instances = list(instances)
        self.ready = {i.instance_id: ready for i in instances}

    @property
    def instances(self) -> list[Instance]:
        return list(self._instances)

    async def launch(self) -> list[Instance]:
        return self.instances

    async def stop(self) -> None:
        return None

    async def health(self, instance: Instance) -> bool:
        return self.ready[instance.instance_id]

    async def snapshot(self, instance: Instance) -> LoadSnapshot:
        return LoadSnapshot(ready=self.ready[instance.instance_id])


def make_instance(instance_id: str, url: str, site: str = "use1", model: str = "m1",
                  version: str = "v1", max_model_len: int = 4096) -> Instance:
    return Instance(instance_id=instance_id, site=site, model=model, version=version, url=url,
                    adapter="fake", max_model_len=max_model_len)


def make_config(tenants: list[dict[str, Any]] | None = None, max_model_len: int = 4096) -> FleetConfig:
    """Two sites, two models (m1 served, m2 not deployed anywhere)."""
    return parse_fleet({
        "sites": [
            {"name": "use1", "region": "us-east", "jurisdiction": "us", "rtt_ms": {"eu-west": 80}},
            {"name": "euw1", "region": "eu-west", "jurisdiction": "eu", "rtt_ms": {"us-east": 80}},
        ],
        "models": [
            {"name": "m1", "versions": ["v1"], "engine": {"spec": "llama-3.1-8b", "max_model_len": max_model_len}},
            {"name": "m2", "engine": {"spec": "llama-3.1-8b"}},
        ],
        "tenants": tenants or [],
    })


# Factories as fixtures, so test modules need not import from conftest.

@pytest.fixture
def refused_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (connections are refused)."""
    return _refused_url()


@pytest.fixture
def fake_adapter() -> type[FakeAdapter]:
    return FakeAdapter


@pytest.fixture
def instance_factory() -> Callable[..., Instance]:
    return make_instance


@pytest.fixture
def config_factory() -> Callable[..., FleetConfig]:
    return make_config


# --- gateway on uvicorn ---

class _TestServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # leave pytest's signal handling alone
        yield


@pytest.fixture
async def gateway_server() -> AsyncIterator[Callable[..., Awaitable[str]]]:
    """Factory: `await gateway_server(app)` → base URL of `app` served by uvicorn on a free port.
    `listener=GatewaySettings(...)`: served by the real client-facing listener of `tokenfleet up`
    (gateway.listener: its deadlines, caps and /v1 lane) with those settings' limits, the
    listeners appended to `listeners` when a list is given (their counts: what it closed, why)."""
    running: list[tuple[uvicorn.Server, asyncio.Task[None], socket.socket]] = []

    async def start(app: Any, listener: Any = None, listeners: list[Any] | None = None) -> str:
        sock = bind_socket("127.0.0.1", 0)  # as production binds: TCP_NODELAY on every connection
        port = sock.getsockname()[1]
        served: dict[str, Any] = {}
        if listener is not None:
            built, _ = build_listeners(listener, sock, None, 4096)
            served = {"http": protocol_class(built), "ws": "none"}  # as `tokenfleet up` serves
            if listeners is not None:
                listeners.extend(built)
        config = uvicorn.Config(app, lifespan="on", log_level="warning", timeout_graceful_shutdown=1, **served)
        server = _TestServer(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        running.append((server, task, sock))
        deadline = time.monotonic() + 30
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("gateway did not start")
            assert time.monotonic() < deadline, "the gateway did not start within 30 s"
            await asyncio.sleep(0.01)
        return f"http://127.0.0.1:{port}"

    yield start
    for server, task, sock in running:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 5)
        sock.close()


# --- a gateway over one stub engine ---

@pytest.fixture
def stub_gateway(gateway_server: Callable[..., Awaitable[str]]) -> Callable[..., Awaitable[tuple[str, Any]]]:
    """Factory: `await stub_gateway(stub, listener=..., listeners=...)` → (base URL, app) of a gateway
    over one instance `i0` (model `m1`) at `stub.url`, served as `gateway_server` serves it."""
    from gateway.app import create_app

    async def start(stub: StubUpstream, **serve: Any) -> tuple[str, Any]:
        app = create_app(make_config(), [FakeAdapter([make_instance("i0", stub.url)])], poll_interval_s=60)
        return await gateway_server(app, **serve), app

    return start


# --- a gateway over one stub engine, with a key ---

KEYED_GATEWAY_KEY = "sk-test"  # the key of tenant `dev` (tests write it out: "Bearer sk-test")


@pytest.fixture
async def keyed_gateway(stub_upstream: Callable[..., Awaitable[StubUpstream]],
                        gateway_server: Callable[[Any], Awaitable[str]]) -> AsyncIterator[tuple[Any, StubUpstream]]:
    """(client, stub): an httpx client of a gateway over one stub instance `i0` serving `m1`, whose
    tenant `dev` has the key `sk-test`; `stub.requests` is what the engine was sent."""
    import httpx  # (only the tests that use this fixture need it)

    from gateway.app import create_app

    stub = await stub_upstream()
    config = make_config(tenants=[{"name": "dev", "api_keys": [KEYED_GATEWAY_KEY]}])
    url = await gateway_server(create_app(config, [FakeAdapter([make_instance("i0", stub.url)])]))
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        yield client, stub
