"""Bad input never crashes the gateway: every error is OpenAI-shaped with the right status."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest

from gateway.app import create_app

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hello there"}]
BODY_LIMIT = 64 * 1024


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m1", "messages": MSGS, **fields}


# (id, method, path, headers, body (dict → JSON, bytes → raw), status, type, code, param)
Case = tuple[str, str, str, dict[str, str], Any, int, str, str | None, str | None]
INVALID = "invalid_request_error"
CASES: list[Case] = [
    ("malformed-json", "POST", CHAT, AUTH, b'{"model": "m1", ', 400, INVALID, "invalid_json", None),
    ("non-object-body", "POST", CHAT, AUTH, b"[1, 2]", 400, INVALID, "invalid_json", None),
    ("missing-model", "POST", CHAT, AUTH, {"messages": MSGS}, 400, INVALID, None, "model"),
    ("model-not-string", "POST", CHAT, AUTH, chat(model=7), 400, INVALID, None, "model"),
    ("missing-messages", "POST", CHAT, AUTH, {"model": "m1"}, 400, INVALID, None, "messages"),
    ("empty-messages", "POST", CHAT, AUTH, chat(messages=[]), 400, INVALID, None, "messages"),
    ("message-not-object", "POST", CHAT, AUTH, chat(messages=["hi"]), 400, INVALID, None, "messages[0]"),
    ("bad-role", "POST", CHAT, AUTH, chat(messages=[{"role": "wizard", "content": "hi"}]),
     400, INVALID, None, "messages[0].role"),
    ("bad-content", "POST", CHAT, AUTH, chat(messages=[{"role": "user", "content": 5}]),
     400, INVALID, None, "messages[0].content"),
    ("max-tokens-str", "POST", CHAT, AUTH, chat(max_tokens="x"), 400, INVALID, None, "max_tokens"),
    ("max-tokens-negative", "POST", CHAT, AUTH, chat(max_tokens=-1), 400, INVALID, None, "max_tokens"),
    ("max-tokens-bool", "POST", CHAT, AUTH, chat(max_tokens=True), 400, INVALID, None, "max_tokens"),
    ("stream-str", "POST", CHAT, AUTH, chat(stream="yes"), 400, INVALID, None, "stream"),
    ("n-2", "POST", CHAT, AUTH, chat(n=2), 400, INVALID, None, "n"),
    ("temperature-5", "POST", CHAT, AUTH, chat(temperature=5), 400, INVALID, None, "temperature"),
    ("stream-options-without-stream", "POST", CHAT, AUTH, chat(stream_options={"include_usage": True}),
     400, INVALID, None, "stream_options"),
    ("completion-missing-prompt", "POST", "/v1/completions", AUTH, {"model": "m1"},
     400, INVALID, None, "prompt"),
    ("completion-prompt-int", "POST", "/v1/completions", AUTH, {"model": "m1", "prompt": 5},
     400, INVALID, None, "prompt"),
    ("bad-region", "POST", CHAT, {**AUTH, "x-tokenfleet-region": "mars"}, chat(),
     400, INVALID, None, "x-tokenfleet-region"),
    ("unknown-model", "POST", CHAT, AUTH, chat(model="nope"), 404, INVALID, "model_not_found", "model"),
    ("unknown-version", "POST", CHAT, AUTH, chat(model="m1@v9"), 404, INVALID, "model_not_found", "model"),
    ("context-too-long", "POST", CHAT, AUTH, chat(max_tokens=4096),
     400, INVALID, "context_length_exceeded", "messages"),
    ("prompt-too-long", "POST", "/v1/completions", AUTH, {"model": "m1", "prompt": "word " * 5000},
     400, INVALID, "context_length_exceeded", "prompt"),
    ("no-key", "POST", CHAT, {}, chat(), 401, INVALID, "invalid_api_key", None),
    ("bad-key", "POST", CHAT, {"Authorization": "Bearer sk-wrong"}, chat(), 401, INVALID, "invalid_api_key", None),
    ("models-no-key", "GET", "/v1/models", {}, None, 401, INVALID, "invalid_api_key", None),
    ("unknown-path", "GET", "/v1/nope", AUTH, None, 404, INVALID, "unknown_url", None),
    ("wrong-method", "GET", CHAT, AUTH, None, 405, INVALID, "method_not_allowed", None),
    ("body-too-large", "POST", CHAT, AUTH, chat(pad="x" * (BODY_LIMIT + 1)),
     413, INVALID, "request_too_large", None),
    ("no-ready-instance", "POST", CHAT, AUTH, chat(model="m2"), 503, "server_error", "no_ready_instance", None),
]


@pytest.fixture
async def gateway(stub_upstream: Callable[..., Awaitable[Any]], gateway_server: Callable[[Any], Awaitable[str]],
                  fake_adapter: Any, instance_factory: Any, config_factory: Any) -> AsyncIterator[str]:
    stub = await stub_upstream()
    config = config_factory(tenants=[{"name": "dev", "api_keys": [KEY]}])
    adapter = fake_adapter([instance_factory("i0", stub.url)])
    yield await gateway_server(create_app(config, [adapter], max_body_bytes=BODY_LIMIT))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
async def test_bad_input_gets_openai_error(gateway: str, case: Case) -> None:
    _, method, path, headers, body, status, err_type, code, param = case
    content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    async with httpx.AsyncClient(base_url=gateway, timeout=5) as client:
        r = await client.request(method, path, headers={"Content-Type": "application/json", **headers},
                                 content=content)
        assert r.status_code == status, r.text
        payload = r.json()
        assert set(payload) == {"error"}
        err = payload["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert isinstance(err["message"], str) and err["message"]
        assert "Traceback" not in err["message"]
        assert (err["type"], err["code"], err["param"]) == (err_type, code, param)
        if status == 503:
            assert int(r.headers["retry-after"]) >= 1
        health = await client.get("/health")
        assert health.status_code == 200
        assert health.json()["ready_instances"] == 1


async def test_valid_request_still_served_after_errors(gateway: str) -> None:
    """The matrix's well-formed twin goes through (so the errors above are about the input)."""
    async with httpx.AsyncClient(base_url=gateway, timeout=5) as client:
        r = await client.post(CHAT, headers=AUTH, json=chat(max_tokens=8, ignore_eos=True))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        models = await client.get("/v1/models", headers=AUTH)
        assert [m["id"] for m in models.json()["data"]] == ["m1"]


async def test_internal_error_is_openai_shaped(stub_upstream: Callable[..., Awaitable[Any]],
                                               gateway_server: Callable[[Any], Awaitable[str]],
                                               fake_adapter: Any, instance_factory: Any,
                                               config_factory: Any) -> None:
    """A bug in a policy is a 500 with the usual error body, no stack trace, and nothing leaked."""

    from fleetcore.policies import InstanceRouter

    class BrokenRouter(InstanceRouter):
        name = "broken"

        def route(self, *args: Any) -> Any:
            raise ZeroDivisionError("policy bug")

    stub = await stub_upstream()
    app = create_app(config_factory(), [fake_adapter([instance_factory("i0", stub.url)])],
                     router=BrokenRouter())
    base = await gateway_server(app)
    async with httpx.AsyncClient(base_url=base, timeout=5) as client:
        r = await client.post(CHAT, json=chat())
        assert r.status_code == 500
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("server_error", "internal_error")
        assert "policy bug" not in err["message"] and "Traceback" not in r.text
        assert (await client.get("/health")).status_code == 200
    assert app.state.tokenfleet.state.get("i0").inflight == 0
