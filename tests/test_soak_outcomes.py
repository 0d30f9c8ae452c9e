"""bench/soak.py's outcome classes against a real loopback server that misbehaves on purpose:
each way of losing a request is named as lost (by kind), each proper answer is not."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from bench.soak import Spec, send

OK_JSON = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "hi", "finish_reason": "length"}]}
ERR = {"error": {"message": "busy", "type": "server_error", "param": None, "code": "queue_timeout"}}


def _sse(*objs: Any) -> bytes:
    return b"".join(b"data: " + (o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n\n" for o in objs)


async def _behave(request: web.Request) -> web.StreamResponse:
    how = request.headers["X-Request-Id"].split("-", 1)[1]
    if how == "ok_json":
        return web.json_response(OK_JSON)
    if how == "rejected":
        return web.json_response(ERR, status=503, headers={"Retry-After": "1"})
    if how == "no_retry_after":
        return web.json_response(ERR, status=503)
    if how == "bare_500":
        return web.Response(status=500, text="Internal Server Error")
    if how == "hang":
        await asyncio.sleep(3600)
    if how == "reset":  # drop the connection without a response
        assert request.transport is not None
        request.transport.close()
        await asyncio.sleep(3600)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    chunk = {"choices": [{"index": 0, "text": "a", "finish_reason": None}]}
    if how == "ok_stream":
        await resp.write(_sse(chunk, b"[DONE]"))
    elif how == "error_event":
        await resp.write(_sse(chunk, ERR, b"[DONE]"))
    elif how == "error_no_done":
        await resp.write(_sse(chunk, ERR))
    elif how == "truncated":
        await resp.write(_sse(chunk))
    elif how == "stall_then_abort":
        await resp.write(_sse(chunk))
        await asyncio.sleep(3600)
    await resp.write_eof()
    return resp


@pytest.fixture
async def server() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/completions", _behave)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


CASES = [  # (behaviour, stream, abort_after_s, expected outcome, expected kind)
    ("ok_json", False, None, "ok", "json"),
    ("ok_stream", True, None, "ok", "stream"),
    ("error_event", True, None, "error_event", "busy"),
    ("rejected", False, None, "rejected", "503 queue_timeout"),
    ("no_retry_after", False, None, "lost", "503_without_retry_after"),
    ("bare_500", False, None, "lost", "5xx_without_error_body"),
    ("error_no_done", True, None, "lost", "error_event_without_done"),
    ("truncated", True, None, "lost", "stream_truncated_without_error_event"),
    ("reset", False, None, "lost", "server_disconnected_waiting"),
    ("hang", False, None, "lost", "client_timeout_waiting"),
    ("stall_then_abort", True, None, "lost", "client_timeout_streaming"),
    ("hang", False, 0.2, "aborted", "queued"),
    ("stall_then_abort", True, 0.3, "aborted", "streaming"),
]


@pytest.mark.parametrize(("how", "stream", "abort", "outcome", "kind"), CASES)
async def test_each_response_gets_its_outcome(server: str, how: str, stream: bool, abort: float | None,
                                              outcome: str, kind: str) -> None:
    spec = Spec(index=0, at_s=0.0, path="/v1/completions", body=b"{}", key="k", region=None,
                stream=stream, abort_after_s=abort, bad=False)
    async with aiohttp.ClientSession() as session:
        # The request id carries the behaviour; send() sets `soak-<index>`, so patch it in.
        r = await send(_Session(session, how), server, spec, timeout_s=1.0)
    assert (r.outcome, r.kind) == (outcome, kind)


class _Session:
    """The client session with the behaviour name as the request id's suffix."""

    def __init__(self, session: aiohttp.ClientSession, how: str) -> None:
        self.session, self.how = session, how

    def post(self, url: str, *, data: bytes, headers: dict[str, str]) -> Any:
        return self.session.post(url, data=data, headers={**headers, "X-Request-Id": f"soak-{self.how}"})
