"""Schemathesis against the gateway's own /openapi.json: whatever a client sends, no 5xx.

A real gateway (uvicorn on a loopback socket, in a thread of its own) over a stub engine;
every operation of the document gets a bounded number of generated requests (valid and
invalid), sent with a tenant key and with the admin key. The /v1 completions endpoints
declare their bodies and answers, so their status codes and content types must also
conform to the document.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
import uvicorn
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, status_code_conformance

from gateway.app import create_app
from gateway.listener import bind_socket
from tests.conftest import FakeAdapter, StubUpstream, make_config, make_instance

TENANT = "sk-fuzz-tenant"
ADMIN = "sk-fuzz-admin"
EXAMPLES = 8  # per operation and key; the whole module stays well under a minute


class _Server(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # older uvicorn
        pass

    def capture_signals(self) -> Any:  # leave pytest's signal handling alone
        import contextlib
        return contextlib.nullcontext()


@pytest.fixture(scope="module")
def gateway_url() -> Iterator[str]:
    """The gateway and its stub engine, on their own event loop in a thread (schemathesis is sync)."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        stub = StubUpstream(chunks=2, delay_s=0.0)
        runner = web.AppRunner(stub.app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        stub.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        app = create_app(_config(), [FakeAdapter([make_instance("i0", stub.url)])])
        sock = bind_socket("127.0.0.1", 0)  # as production binds: TCP_NODELAY on every connection
        server = _Server(uvicorn.Config(app, lifespan="on", log_level="critical", timeout_graceful_shutdown=1))
        box["server"], box["url"] = server, f"http://127.0.0.1:{sock.getsockname()[1]}"
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        started.set()
        await task
        await runner.cleanup()
        sock.close()

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), name="gateway", daemon=True)
    thread.start()
    assert started.wait(30), "the gateway did not start"
    try:
        yield box["url"]
    finally:
        box["server"].should_exit = True
        thread.join(30)
        loop.close()


def _config() -> Any:
    config = make_config(tenants=[{"name": "fuzz", "api_keys": [TENANT]}])
    return config.model_copy(update={"admin_api_keys": [ADMIN]})


# The document is built at collection time from an app like the served one (schemathesis
# parametrizes before fixtures run); the test below checks the served /openapi.json is the same.
SPEC = create_app(_config(), [FakeAdapter([make_instance("i0", "http://127.0.0.1:9")])]).openapi()
schema = schemathesis.openapi.from_dict(SPEC)


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@pytest.mark.slow
def test_no_request_gets_a_5xx(case: Any, gateway_url: str) -> None:
    declared = case.operation.path.startswith("/v1/") and case.method == "POST"
    checks = [not_a_server_error] + ([status_code_conformance, content_type_conformance] if declared else [])
    for key in (TENANT, ADMIN):
        case.call_and_validate(base_url=gateway_url, headers={"Authorization": f"Bearer {key}"},
                               checks=checks, timeout=30)


# Strings schemathesis rarely makes: lone surrogates (as JSON escapes), NUL, separators, quotes;
# inside bodies that are otherwise mostly valid, so the odd strings reach tokenizers and the relay.
# (joined by hand: st.text() never yields a surrogate)
ODD = st.lists(st.one_of(st.sampled_from(["\ud83d", "\udc00", "\x00", "\u2028", '"', "\\", "a", " "]),
                         st.characters()), max_size=12).map("".join)
VALUE = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | ODD,
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(ODD, c, max_size=3), max_leaves=10)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": ODD})
BODY = st.fixed_dictionaries({"model": st.sampled_from(["m1", "m1@v1"]) | ODD, "max_tokens": st.integers(1, 8)}, optional={
    "messages": st.lists(MESSAGE, min_size=1, max_size=3), "prompt": ODD | st.lists(ODD, min_size=1, max_size=3),
    "stream": st.booleans(), "stop": ODD, "user": ODD, "metadata": st.dictionaries(ODD, VALUE, max_size=2)})
BODY = st.tuples(BODY, st.dictionaries(ODD, VALUE, max_size=1)).map(lambda t: {**t[1], **t[0]})  # odd extra keys


@pytest.mark.slow
@settings(max_examples=80, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]), body=BODY)
def test_odd_bodies_never_get_a_5xx(gateway_url: str, path: str, body: dict[str, Any]) -> None:
    import httpx
    raw = json.dumps(body).encode()  # ensure_ascii: a lone surrogate travels as a \ud83d escape
    r = httpx.post(gateway_url + path, content=raw, timeout=30,
                   headers={"Authorization": f"Bearer {TENANT}", "Content-Type": "application/json"})
    assert r.status_code < 500, (raw[:300], r.text[:300])


def test_the_document_describes_the_completion_bodies(gateway_url: str) -> None:
    import httpx
    spec = httpx.get(f"{gateway_url}/openapi.json", timeout=10).json()
    assert spec == SPEC
    chat = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert chat["required"] == ["model", "messages"] and "max_tokens" in chat["properties"]
    completion = spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert completion["required"] == ["model", "prompt"]
    assert {"/admin/v1/region-policies", "/v1/models", "/metrics"} <= set(spec["paths"])
    docs = httpx.get(f"{gateway_url}/docs", timeout=10)
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
