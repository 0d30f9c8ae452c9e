"""The /v1 lean path as one ASGI callable (gateway.fast_path.FastLane), on a fake ASGI channel.

It does in one coroutine what three layers did (the overload bounds, the body limit, the
route with the app's exception handlers) and wraps no `send`, so what those layers promised is
checked here directly: the body reaches the handler whole, an over-limit body is 413 and never
reaches it, a handler's GatewayError is its OpenAI-style answer and any other error a 500 of
the same shape, a request over a bound is 503 with Retry-After before its body is read, the
`pending` count ends when the handler has returned its response and `inflight` when the
response is over, and an error once the response has started is not answered a second time.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import bad_request, install_handlers
from gateway.fast_path import FastLane
from gateway.overload import Backlog

PATH = "/v1/chat/completions"


class Channel:
    def __init__(self, body: bytes, parts: int = 1) -> None:
        step = max(1, len(body) // parts)
        pieces = [body[i:i + step] for i in range(0, len(body), step)] or [b""]
        self.messages = [{"type": "http.request", "body": p, "more_body": i < len(pieces) - 1}
                         for i, p in enumerate(pieces)]
        self.read = 0
        self.sent: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        if self.read < len(self.messages):
            self.read += 1
            return self.messages[self.read - 1]
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    def status(self) -> int:
        return int(self.sent[0]["status"])

    def headers(self) -> dict[bytes, bytes]:
        return dict(self.sent[0]["headers"])

    def json(self) -> Any:
        return json.loads(b"".join(m.get("body", b"") for m in self.sent[1:]))


def _scope(length: int) -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": PATH, "headers": [(b"content-length", str(length).encode())],
            "query_string": b""}


def _lane(handler: Any, backlog: Backlog, max_body: int = 1000) -> FastLane:
    app = FastAPI()
    install_handlers(app)
    return FastLane(app, {PATH: handler}, backlog, None, max_body)


async def test_the_body_reaches_the_handler_whole_and_the_counts_end_where_they_should() -> None:
    backlog = Backlog(max_inflight=10, max_pending=10, retry_after_s=1)
    seen: dict[str, Any] = {}

    class Checked(Response):
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            seen["during_response"] = (backlog.pending, backlog.inflight)
            await super().__call__(scope, receive, send)

    async def handler(request: Request) -> Response:
        seen["body"] = await request.body()
        seen["in_handler"] = (backlog.pending, backlog.inflight)
        return Checked(b"ok", media_type="text/plain")

    body = b'{"model": "m", "messages": []}'
    ch = Channel(body, parts=3)
    await _lane(handler, backlog)(_scope(len(body)), ch.receive, ch.send)
    assert ch.status() == 200 and seen["body"] == body
    assert seen["in_handler"] == (1, 1) and seen["during_response"] == (0, 1)
    assert (backlog.pending, backlog.inflight) == (0, 0)


@pytest.mark.parametrize("declared", [True, False])
async def test_a_body_over_the_limit_is_413_and_never_reaches_the_handler(declared: bool) -> None:
    backlog = Backlog(max_inflight=10, max_pending=10, retry_after_s=1)
    called = []

    async def handler(request: Request) -> Response:
        called.append(1)
        return Response(b"")

    body = b"x" * 300
    ch = Channel(body, parts=3)
    await _lane(handler, backlog, max_body=200)(_scope(len(body) if declared else 0), ch.receive, ch.send)
    assert ch.status() == 413 and ch.json()["error"]["type"] == "invalid_request_error"
    assert not called and (backlog.pending, backlog.inflight) == (0, 0)


async def test_handler_errors_are_answered_openai_style() -> None:
    backlog = Backlog(max_inflight=10, max_pending=10, retry_after_s=1)

    async def bad(request: Request) -> Response:
        raise bad_request("`messages` is required", param="messages")

    async def bug(request: Request) -> Response:
        raise RuntimeError("a bug")

    ch = Channel(b"{}")
    await _lane(bad, backlog)(_scope(2), ch.receive, ch.send)
    assert ch.status() == 400 and ch.json()["error"]["param"] == "messages"
    ch = Channel(b"{}")
    await _lane(bug, backlog)(_scope(2), ch.receive, ch.send)
    assert ch.status() == 500 and ch.json()["error"]["type"] == "server_error"
    assert (backlog.pending, backlog.inflight) == (0, 0)


async def test_over_a_bound_is_503_with_retry_after_before_the_body_is_read() -> None:
    backlog = Backlog(max_inflight=10, max_pending=2, retry_after_s=3, pending=2, inflight=2)

    async def handler(request: Request) -> Response:
        raise AssertionError("must not run")

    ch = Channel(b"{}")
    await _lane(handler, backlog)(_scope(2), ch.receive, ch.send)
    assert ch.status() == 503 and ch.headers()[b"retry-after"] == b"3"
    assert ch.json()["error"]["code"] == "gateway_overloaded" and ch.read == 0
    assert (backlog.pending, backlog.inflight) == (2, 2)  # the refused request was never counted


async def test_an_error_after_the_response_started_is_not_answered_again() -> None:
    backlog = Backlog(max_inflight=10, max_pending=10, retry_after_s=1)

    class Broken(JSONResponse):
        started = False

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            self.started = True
            await send({"type": "http.response.start", "status": 200, "headers": []})
            raise RuntimeError("mid-response")

    async def handler(request: Request) -> Response:
        return Broken({})

    ch = Channel(b"{}")
    with pytest.raises(RuntimeError):
        await _lane(handler, backlog)(_scope(2), ch.receive, ch.send)
    assert len(ch.sent) == 1  # the start only: no second answer on a started response
    assert (backlog.pending, backlog.inflight) == (0, 0)
