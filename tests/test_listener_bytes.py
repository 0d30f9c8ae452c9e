"""The listener answers with the very bytes uvicorn's own protocol would (branch i14-server).

`gateway.listener.GuardedHttpToolsProtocol` adds caps, deadlines and header limits to uvicorn's
httptools protocol, and joins a relayed stream's head to its first events in one write
(`gateway.head_hold`); a leaner server path for /v1 must keep the bytes too. Here one gateway
app (lifespan run once) is served on two sockets at once: by uvicorn's own `HttpToolsProtocol`
and by the listener. The same requests — a streamed completion, a non-streamed one, a bad
request, an unknown path — are sent raw to both, and the raw answers (status line, headers,
chunked framing, body) compared byte for byte, less the Date header and the predicted TTFT's value
(the clock's: the TTFT the header reports counts from the request's arrival, the time parsing it took
included, since i19-arrive).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import uvicorn

from fleetcore.fleet_config import GatewaySettings
from gateway.app import create_app
from gateway.listener import bind_socket, build_listeners, protocol_class

DATE = re.compile(rb"\r\ndate: [^\r]*", re.IGNORECASE)
PREDICTED_TTFT = re.compile(rb"(\r\nx-tokenfleet-predicted-ttft-ms: )[^\r]*", re.IGNORECASE)


def _clockless(raw: bytes) -> bytes:
    """An answer less what the clock sets: the Date header, the predicted TTFT's value (its name kept)."""
    return PREDICTED_TTFT.sub(rb"\1", DATE.sub(b"", raw))


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[no-untyped-def]  # leave pytest's signal handling alone
        yield


async def _raw(port: int, request: bytes) -> bytes:
    """The whole answer to `request` (sent with Connection: close: the server ends it)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        return await asyncio.wait_for(reader.read(-1), 10)
    finally:
        writer.close()


def _post(path: str, body: bytes) -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nX-Request-Id: bytes-1\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body))


@pytest.fixture
async def two_servers(stub_upstream: Any, fake_adapter: Any, instance_factory: Any,
                      config_factory: Any) -> AsyncIterator[tuple[int, int]]:
    """(uvicorn's port, the listener's port), one app behind both."""
    stub = await stub_upstream(chunks=4, delay_s=0.02)
    app = create_app(config_factory(), [fake_adapter([instance_factory("i0", stub.url)])], poll_interval_s=60)
    plain_sock = bind_socket("127.0.0.1", 0)
    server = _Server(uvicorn.Config(app, http="httptools", lifespan="on", log_level="warning",
                                    timeout_graceful_shutdown=1))
    task = asyncio.create_task(server.serve(sockets=[plain_sock]))
    deadline = time.monotonic() + 30
    while not server.started:
        assert not task.done() and time.monotonic() < deadline, "the gateway did not start"
        await asyncio.sleep(0.01)
    guarded_sock = bind_socket("127.0.0.1", 0)
    listeners, _ = build_listeners(GatewaySettings(), guarded_sock, None, 4096)
    config = uvicorn.Config(app, http=protocol_class(listeners), ws="none", lifespan="off", log_level="warning")
    config.load()
    make: Callable[..., Any] = config.http_protocol_class
    loop = asyncio.get_running_loop()
    # the running server's state: the same default headers (server, date) on both
    guarded = await loop.create_server(lambda: make(config, server.server_state, {}, loop), sock=guarded_sock)
    try:
        yield plain_sock.getsockname()[1], guarded_sock.getsockname()[1]
    finally:
        guarded.close()
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 5)
        plain_sock.close()


CASES = {
    "streamed": _post("/v1/chat/completions", json.dumps(
        {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 4,
         "stream_options": {"include_usage": True}}).encode()),
    "whole": _post("/v1/completions", json.dumps({"model": "m1", "prompt": "hi", "max_tokens": 4}).encode()),
    "bad_request": _post("/v1/chat/completions", b'{"model": "m1", "messages": '),
    "unknown_path": b"GET /v1/nothing-here HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n",
}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_the_listener_answers_byte_for_byte_as_uvicorn_does(two_servers: tuple[int, int], case: str) -> None:
    plain, guarded = two_servers
    a = _clockless(await _raw(plain, CASES[case]))
    b = _clockless(await _raw(guarded, CASES[case]))
    assert a.startswith(b"HTTP/1.1 ") and b"\r\n\r\n" in a
    if case == "streamed":  # a relayed stream, chunked, to its end
        assert a.startswith(b"HTTP/1.1 200 ") and b"data: [DONE]" in a and a.endswith(b"0\r\n\r\n")
    elif case == "whole":
        assert a.startswith(b"HTTP/1.1 200 ") and b"content-length: " in a
    else:
        assert a.split(b" ", 2)[1] in (b"400", b"404") and b'"error"' in a
    assert b == a
