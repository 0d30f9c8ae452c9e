"""The /v1 lane served from the listener's protocol (gateway.lane_cycle).

- `LaneCycle.send` against uvicorn's own `RequestResponseCycle.send`, message for message
  (hypothesis): the same writes, the same errors, the same connection state afterwards;
- that the listener's cycles are LaneCycles, built by uvicorn's constructor;
- `find_lane` / `Lane.entry`: which requests take the lane, and that `x-forwarded-*` requests still
  pass uvicorn's proxy-headers middleware;
- through the real listener: the lane is taken; keep-alive, pipelined requests, `Connection: close`;
  a client that leaves mid-stream still aborts the upstream request.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from fleetcore.fleet_config import GatewaySettings
from gateway.app import create_app
from gateway.lane_cycle import Lane, LaneCycle, find_lane

# --- LaneCycle.send against uvicorn's send ---


class _Transport:
    """What a cycle writes, each write apart, and whether it closed the connection."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


def _cycle(cls: type, method: str, keep_alive: bool) -> tuple[RequestResponseCycle, _Transport, list[int]]:
    t = _Transport()
    done: list[int] = []
    scope = {"type": "http", "method": method, "path": "/v1/completions", "http_version": "1.1", "headers": [],
             "client": ("127.0.0.1", 1), "query_string": b"", "root_path": ""}
    c = cls(scope=scope, transport=t, flow=FlowControl(t),  # type: ignore[arg-type]
                             logger=logging.getLogger("t"), access_logger=logging.getLogger("t.a"), access_log=False,
                             default_headers=[(b"server", b"uvicorn"), (b"date", b"today")],
                             message_event=asyncio.Event(), expect_100_continue=False, keep_alive=keep_alive,
                             on_response=lambda: done.append(1))
    return c, t, done


async def _play(cls: type, method: str, keep_alive: bool, messages: list[dict[str, Any]]) -> tuple[Any, ...]:
    c, t, done = _cycle(cls, method, keep_alive)
    error = None
    for m in messages:
        try:
            await c.send(m)  # type: ignore[arg-type]
        except Exception as e:  # the same exception, same message, at the same message
            error = (type(e).__name__, str(e), messages.index(m))
            break
    return (t.writes, t.closed, len(done), error, c.keep_alive, c.response_started, c.response_complete,
            c.chunked_encoding, c.expected_content_length)


_NAMES = st.sampled_from([b"content-type", b"Content-Type", b"x-request-id", b"content-length", b"Content-Length",
                          b"transfer-encoding", b"connection", b"Connection", b"cache-control", b"bad name",
                          b"bad:name", b"", b"x-\x7f"])
_VALUES = st.sampled_from([b"text/event-stream", b"chunked", b"Chunked", b"gzip", b"close", b"keep-alive",
                           b"Keep-Alive, Close", b" close ", b"0", b"5", b"12", b"abc\tdef", b"bad\r\nvalue",
                           b"nul\x00", b"", b"req-1"])
_BODY = st.sampled_from([b"", b"hello", b"data: x\n\n", b"0123456789ab"])


@st.composite
def _messages(draw: Any) -> list[dict[str, Any]]:
    headers = draw(st.lists(st.tuples(_NAMES, _VALUES), max_size=6))
    start = {"type": "http.response.start", "status": draw(st.sampled_from([200, 204, 304, 400, 503])),
             "headers": headers}
    bodies = [{"type": "http.response.body", "body": draw(_BODY), "more_body": draw(st.booleans())}
              for _ in range(draw(st.integers(0, 4)))]
    msgs = [start, *bodies]
    if draw(st.booleans()):  # a message out of order somewhere
        msgs.insert(draw(st.integers(0, len(msgs))), draw(st.sampled_from(
            [start, {"type": "http.response.body", "body": b"x", "more_body": False}, {"type": "http.other"}])))
    return msgs


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msgs=_messages(), method=st.sampled_from(["POST", "HEAD"]), keep_alive=st.booleans())
def test_lane_send_does_what_uvicorns_send_does(msgs: list[dict[str, Any]], method: str, keep_alive: bool) -> None:
    async def both() -> tuple[Any, Any]:
        return (await _play(RequestResponseCycle, method, keep_alive, msgs),
                await _play(LaneCycle, method, keep_alive, msgs))

    theirs, ours = asyncio.run(both())
    assert ours == theirs


async def test_a_closing_answer_is_written_whole_before_the_close() -> None:
    c, t, done = _cycle(LaneCycle, "POST", False)
    await c.send({"type": "http.response.start", "status": 200, "headers": []})
    await c.send({"type": "http.response.body", "body": b"x", "more_body": False})
    assert t.closed and done == [1]
    assert b"".join(t.writes).endswith(b"connection: close\r\ntransfer-encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n")


# --- which requests take the lane ---


def test_find_lane_and_the_entry(config_factory: Any, fake_adapter: Any, instance_factory: Any) -> None:
    app = create_app(config_factory(), [fake_adapter([instance_factory("i0", "http://127.0.0.1:1")])],
                     poll_interval_s=60)
    assert app.fast_stack is not None
    lane = find_lane(ProxyHeadersMiddleware(app, trusted_hosts="127.0.0.1"))
    assert lane is not None and lane.app is app and lane.direct is app.fast_stack

    def scope(method: str, path: str, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
        return {"type": "http", "method": method, "path": path, "headers": headers, "client": ("127.0.0.1", 5),
                "scheme": "http"}

    s = scope("POST", "/v1/completions", [(b"content-type", b"application/json")])
    assert lane.entry(s) is app.fast_stack and s["app"] is app
    assert lane.entry(scope("GET", "/v1/completions", [])) is None
    assert lane.entry(scope("POST", "/health", [])) is None
    fwd = lane.entry(scope("POST", "/v1/chat/completions", [(b"x-forwarded-for", b"10.1.2.3")]))
    assert isinstance(fwd, ProxyHeadersMiddleware) and fwd.app is app.fast_stack
    # no proxy middleware in front: no `proxied`, every lane request direct
    bare = find_lane(app)
    assert bare is not None and bare.proxied is None
    assert bare.entry(scope("POST", "/v1/completions", [(b"x-forwarded-for", b"10.1.2.3")])) is app.fast_stack
    # an unknown wrapper: no lane (its behaviour would be skipped)
    assert find_lane(_Wrapper(app)) is None


class _Wrapper:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


async def test_forwarded_requests_still_get_the_proxy_headers_rewrite() -> None:
    seen: list[tuple[Any, Any]] = []

    async def fast(scope: Any, receive: Any, send: Any) -> None:
        seen.append((scope["client"], scope["scheme"]))

    from gateway.fast_path import GatewayApp
    app = GatewayApp()
    app.fast_routes = {"/v1/completions": None}  # type: ignore[dict-item]
    app.fast_stack = fast
    lane = find_lane(ProxyHeadersMiddleware(app, trusted_hosts="127.0.0.1"))
    assert lane is not None
    s = {"type": "http", "method": "POST", "path": "/v1/completions", "client": ("127.0.0.1", 5), "scheme": "http",
         "headers": [(b"x-forwarded-for", b"10.1.2.3"), (b"x-forwarded-proto", b"https")]}
    entry = lane.entry(s)
    assert entry is not None
    await entry(s, None, None)
    assert seen == [(("10.1.2.3", 0), "https")]


# --- through the real listener ---


@pytest.fixture
async def gateway(stub_upstream: Any, stub_gateway: Any) -> tuple[int, Any]:
    """(the listener's port, the stub engine): one gateway app served by the listener."""
    stub = await stub_upstream(chunks=20, delay_s=0.05)
    url, _ = await stub_gateway(stub, listener=GatewaySettings())
    return int(url.rsplit(":", 1)[1]), stub


def _post(path: str, body: dict[str, Any], close: bool = False) -> bytes:
    raw = json.dumps(body).encode()
    return (b"POST %s HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s"
            % (path.encode(), b"Connection: close\r\n" if close else b"", len(raw), raw))


_COMPLETION = {"model": "m1", "prompt": "hi", "max_tokens": 3, "stream": True}
_END = b"0\r\n\r\n"


async def _read_answer(reader: asyncio.StreamReader) -> bytes:
    """One chunked answer, head to terminator."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert b"transfer-encoding: chunked" in head.lower(), head
    body = b""
    while not body.endswith(_END):
        body += await asyncio.wait_for(reader.readuntil(b"\r\n"), 10)
    return head + body


async def test_the_lane_serves_keep_alive_pipelined_and_closing_requests(
        gateway: tuple[int, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    port, stub = gateway
    stub.chunks, stub.delay_s = 2, 0.0
    lanes: list[Any] = []
    real = Lane.entry
    monkeypatch.setattr(Lane, "entry", lambda self, scope: (lanes.append(real(self, scope)), lanes[-1])[1])
    heads: list[Any] = []
    real_head = LaneCycle._head
    monkeypatch.setattr(LaneCycle, "_head", lambda self, *a: (heads.append(type(self)), real_head(self, *a))[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(_post("/v1/completions", _COMPLETION))  # keep-alive
        first = await _read_answer(reader)
        assert first.startswith(b"HTTP/1.1 200 ") and b"data: [DONE]" in first
        # two pipelined in one write, answered in order
        writer.write(_post("/v1/completions", {**_COMPLETION, "prompt": "a"})
                     + _post("/v1/chat/completions", {"model": "m1", "messages": [{"role": "user", "content": "b"}],
                                                      "stream": True, "max_tokens": 2}))
        second, third = await _read_answer(reader), await _read_answer(reader)
        assert b'"text_completion"' in second and b'"chat.completion.chunk"' in third
        writer.write(_post("/v1/completions", _COMPLETION, close=True))
        last = await _read_answer(reader)
        assert b"connection: close\r\n" in last
        assert await asyncio.wait_for(reader.read(), 10) == b""  # the server closed it
    finally:
        writer.close()
    assert len(lanes) == 4 and all(e is not None for e in lanes)  # every one of them through the lane
    assert heads == [LaneCycle] * 4  # answered by a LaneCycle's send
    assert [r["path"] for r in stub.requests] == ["/v1/completions", "/v1/completions", "/v1/chat/completions",
                                                  "/v1/completions"]


async def test_other_requests_take_the_asgi_chain(gateway: tuple[int, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    port, _ = gateway
    lanes: list[Any] = []
    real = Lane.entry
    monkeypatch.setattr(Lane, "entry", lambda self, scope: (lanes.append(real(self, scope)), lanes[-1])[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 200 ") and b'"data"' in answer
    assert lanes == [None]  # asked, and not the lane's: the ASGI chain answered


async def test_a_client_that_leaves_mid_stream_aborts_the_upstream(gateway: tuple[int, Any]) -> None:
    port, stub = gateway  # 20 chunks, 50 ms apart: a second of stream
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_post("/v1/completions", {**_COMPLETION, "max_tokens": 20}))
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200 ")
    first = await asyncio.wait_for(reader.readuntil(b"\n\n"), 10)
    assert b"data: " in first
    writer.close()  # gone mid-stream
    await asyncio.wait_for(stub.aborted.wait(), 10)
    assert stub.completed == 0



# --- the lane's header lookups, in C ---

_RAW_NAME = st.sampled_from([b"content-length", b"x-request-id", b"authorization", b"a\nb", b"", b"x\xe9"])
_RAW_VALUE = st.one_of(st.sampled_from([b"12", b"007", b"x", b"", b"1\n2", b"\xff\xfe", b" 5 "]), st.binary(max_size=6))


@settings(max_examples=500, deadline=None)
@given(raw=st.lists(st.tuples(_RAW_NAME, _RAW_VALUE), max_size=8))
def test_header_lookups_answer_as_the_loops_did(raw: list[tuple[bytes, bytes]]) -> None:
    from gateway.body_limit import _declared_length
    from gateway.fast_path import _first_values

    # the comprehension the table was built by (a name's first value kept)
    assert _first_values(raw) == {k.decode("latin-1"): v.decode("latin-1") for k, v in reversed(raw)}

    def declared_by_loop() -> int:  # the loop `_declared_length` was
        for name, value in raw:
            if name == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return 0
        return 0

    assert _declared_length({"headers": raw}) == declared_by_loop()
