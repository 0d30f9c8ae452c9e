"""The relay's upstream HTTP client (`gateway.upstream_http`) against real loopback servers.

Each server is a plain asyncio TCP server whose answer is scripted per test, so that what the
client must survive happens on a real socket: chunked and Content-Length bodies, a stream cut
mid-way, a refused and a never-accepted connect, a pooled connection the server closed, a
client that drops the connection, pool bounds. The server counts connections and sees
disconnects itself.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import pytest

from gateway.relay import _connect_failure
from gateway.upstream_http import (DRAIN_BYTES, ConnectFailed, ConnectTimedOut, Disconnected, PayloadIncomplete,
                                   UpstreamClient)
from tests.waits import wait_until

Answer = Callable[["Request", asyncio.StreamWriter], Awaitable[bool]]  # True: keep the connection


@dataclass
class Request:
    head: bytes
    body: bytes
    conn: int  # which connection (1-based) it came on
    index: int  # which request on that connection (0-based)
    reader: asyncio.StreamReader  # the connection's: an answer may watch for the client leaving


@dataclass
class Upstream:
    """A scripted HTTP/1.1 server: `answer` writes each response."""

    answer: Answer
    port: int = 0
    connections: int = 0
    requests: list[Request] = field(default_factory=list)
    disconnects: int = 0  # connections the client ended (EOF or reset), as the server saw them
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def url(self, path: str = "/v1/completions") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn = self.connections
        index = 0
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.disconnects += 1
                    return
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length)
                req = Request(head, body, conn, index, reader)
                self.requests.append(req)
                index += 1
                self.changed.set()
                try:
                    keep = await self.answer(req, writer)
                except ConnectionError:
                    self.disconnects += 1
                    return
                if not keep:
                    return
        finally:
            writer.close()
            self.changed.set()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Answer], Awaitable[Upstream]]]:
    servers: list[asyncio.Server] = []

    async def start(answer: Answer) -> Upstream:
        up = Upstream(answer)
        srv = await asyncio.start_server(up.handle, "127.0.0.1", 0)
        up.port = srv.sockets[0].getsockname()[1]
        servers.append(srv)
        return up

    yield start
    for srv in servers:
        srv.close()


@pytest.fixture
async def client() -> AsyncIterator[UpstreamClient]:
    c = UpstreamClient(connect_timeout_s=2.0)
    yield c
    await c.close()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENTS = [b'data: {"n": %d}\n\n' % i for i in range(4)] + [b"data: [DONE]\n\n"]


async def sse(req: Request, w: asyncio.StreamWriter, *, terminator_after: asyncio.Event | None = None) -> bool:
    """An engine's stream: head, one chunk per event, and the terminator in a write of its own."""
    w.write(SSE_HEAD)
    for ev in EVENTS:
        w.write(chunk(ev))
        await w.drain()
    if terminator_after is not None:
        await terminator_after.wait()
    w.write(b"0\r\n\r\n")
    await w.drain()
    return True


async def read_stream(resp: object) -> bytes:
    """Read like the relay does: until [DONE] has passed by, then release at once."""
    got = b""
    while b"[DONE]" not in got:
        data = await resp.content.readany()  # type: ignore[attr-defined]
        assert data, "stream ended before [DONE]"
        got += data
    resp.release()  # type: ignore[attr-defined]
    return got


async def test_keepalive_one_connection_for_sequential_streams(serve: Callable[..., Awaitable[Upstream]],
                                                               client: UpstreamClient) -> None:
    # The terminator comes only after the client has let go (released on [DONE]): the connection
    # still goes back to the pool once the rest of the body is read.
    released = asyncio.Event()
    up = await serve(lambda r, w: sse(r, w, terminator_after=released))
    for i in range(10):
        resp = await client.post(up.url(), data=b'{"i": %d}' % i, headers={"Content-Type": "application/json"})
        assert resp.status == 200
        assert resp.headers.get("content-type") == "text/event-stream"
        assert await read_stream(resp) == b"".join(EVENTS)
        released.set()
        await wait_until(lambda: client.idle_count(up.url()), 5, "the connection back in the pool")
        released.clear()
    assert up.connections == 1 and client.connections_opened == 1
    assert [r.index for r in up.requests] == list(range(10))
    assert [r.body for r in up.requests] == [b'{"i": %d}' % i for i in range(10)]
    head = up.requests[0].head.decode()
    assert head.startswith("POST /v1/completions HTTP/1.1\r\n")
    assert f"Host: 127.0.0.1:{up.port}\r\n" in head and "Content-Length: 8\r\n" in head


async def test_content_length_body_and_case_insensitive_headers(serve: Callable[..., Awaitable[Upstream]],
                                                                client: UpstreamClient) -> None:
    body = b'{"choices": []}' * 1000

    async def answer(req: Request, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nX-A: 1\r\nx-a: 2\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body))
        w.write(body[:100])
        await w.drain()
        w.write(body[100:])
        return True

    up = await serve(answer)
    for _ in range(2):
        resp = await client.post(up.url(), data=b"{}", headers={})
        assert resp.status == 400
        assert resp.headers.get("Content-Type") == resp.headers["CONTENT-TYPE"] == "application/json"
        assert "content-length" in resp.headers and resp.headers.get("missing", "d") == "d"
        assert resp.headers.get("x-a") == "1, 2"
        assert await resp.read() == body
        assert await resp.content.readany() == b""  # at the end: b"", again and again
        resp.release()
    assert up.connections == 1


async def test_chunked_body_read_whole(serve: Callable[..., Awaitable[Upstream]], client: UpstreamClient) -> None:
    up = await serve(sse)
    async with await client.post(up.url(), data=b"{}", headers={}) as resp:
        assert await resp.read() == b"".join(EVENTS)
    assert client.idle_count(up.url()) == 1


async def test_connection_close_and_eof_delimited_body(serve: Callable[..., Awaitable[Upstream]],
                                                       client: UpstreamClient) -> None:
    async def answer(req: Request, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Type: text/plain\r\n\r\n")  # no length
        w.write(b"all of it")
        await w.drain()
        return False

    up = await serve(answer)
    for _ in range(2):
        resp = await client.post(up.url(), data=b"{}", headers={})
        assert await resp.read() == b"all of it"  # its end is the connection's: not an error
        resp.release()
    assert up.connections == 2 and client.idle_count() == 0


async def test_server_closing_mid_stream_is_a_payload_error(serve: Callable[..., Awaitable[Upstream]],
                                                            client: UpstreamClient) -> None:
    async def answer(req: Request, w: asyncio.StreamWriter) -> bool:
        w.write(SSE_HEAD + chunk(EVENTS[0]))
        await w.drain()
        return False  # closed without the terminator: an engine that died

    up = await serve(answer)
    resp = await client.post(up.url(), data=b"{}", headers={})
    assert await resp.content.readany() == EVENTS[0]
    with pytest.raises(PayloadIncomplete) as e:
        await resp.content.readany()
    assert isinstance(e.value, aiohttp.ClientPayloadError)  # what the relay's `except aiohttp.ClientError` holds
    resp.close()
    assert client.idle_count() == 0


async def test_server_closing_before_the_head(serve: Callable[..., Awaitable[Upstream]],
                                              client: UpstreamClient) -> None:
    async def answer(req: Request, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nContent-")  # half a head, then gone
        await w.drain()
        return False

    up = await serve(answer)
    with pytest.raises(Disconnected) as e:
        await client.post(up.url(), data=b"{}", headers={})
    assert isinstance(e.value, aiohttp.ServerDisconnectedError) and not e.value.nothing_received
    assert len(up.requests) == 1  # a fresh connection: never resent


async def test_refused_connect(client: UpstreamClient) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(ConnectFailed) as e:
        await client.post(f"http://127.0.0.1:{port}/v1/completions", data=b"{}", headers={})
    assert isinstance(e.value, aiohttp.ClientConnectionError) and isinstance(e.value.os_error, ConnectionRefusedError)
    assert _connect_failure("a", e.value).public == "engine instance a refused the connection"


async def test_connect_timeout_on_a_server_that_never_accepts() -> None:
    # A listening socket whose accept queue is full: the kernel drops further SYNs, so a connect
    # neither succeeds nor fails until the client gives up.
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    fillers = []
    try:
        for _ in range(8):
            f = socket.socket()
            f.setblocking(False)
            f.connect_ex(("127.0.0.1", port))
            fillers.append(f)
        client = UpstreamClient(connect_timeout_s=0.3)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(ConnectTimedOut) as e:
            await client.post(f"http://127.0.0.1:{port}/v1/completions", data=b"{}", headers={})
        waited = loop.time() - t0
        await client.close()
    finally:
        for f in fillers:
            f.close()
        srv.close()
    assert 0.25 <= waited < 2.0
    assert isinstance(e.value, TimeoutError) and isinstance(e.value, aiohttp.ClientConnectionError)
    assert _connect_failure("a", e.value).kind == "connect_timeout"


async def test_pooled_connection_closed_while_idle(serve: Callable[..., Awaitable[Upstream]],
                                                   client: UpstreamClient) -> None:
    async def answer(req: Request, w: asyncio.StreamWriter) -> bool:
        await sse(req, w)
        return False  # keep-alive as far as the client knows, then the server closes it idle

    up = await serve(answer)
    resp = await client.post(up.url(), data=b"{}", headers={})
    assert await resp.read() == b"".join(EVENTS)
    await wait_until(lambda: up.connections == 1 and client.idle_count() == 0, 5, "the idle connection seen closed")
    resp = await client.post(up.url(), data=b"{}", headers={})
    assert await resp.read() == b"".join(EVENTS)
    assert up.connections == 2


async def test_request_resent_once_when_the_server_closed_it_unread(serve: Callable[..., Awaitable[Upstream]],
                                                                    client: UpstreamClient) -> None:
    # The race aiohttp also covers: the client sends on a pooled connection the server is closing.
    async def answer(req: Request, w: asyncio.StreamWriter) -> bool:
        if req.conn == 1 and req.index == 1:
            return False  # never answered: closed as if the idle close crossed the request
        await sse(req, w)
        return True

    up = await serve(answer)
    for i in range(2):
        resp = await client.post(up.url(), data=b"%d" % i, headers={})
        assert await resp.read() == b"".join(EVENTS)
    assert up.connections == 2
    assert [(r.conn, r.index, r.body) for r in up.requests] == [(1, 0, b"0"), (1, 1, b"1"), (2, 0, b"1")]


async def test_not_resent_once_the_server_answered_anything(serve: Callable[..., Awaitable[Upstream]],
                                                            client: UpstreamClient) -> None:
    async def answer(req: Request, w: asyncio.StreamWriter) -> bool:
        if req.index == 1:
            w.write(b"HTTP/1.1 200")  # the engine started answering: resending could run it twice
            await w.drain()
            return False
        await sse(req, w)
        return True

    up = await serve(answer)
    resp = await client.post(up.url(), data=b"{}", headers={})
    await resp.read()
    with pytest.raises(Disconnected):
        await client.post(up.url(), data=b"{}", headers={})
    assert len(up.requests) == 2 and up.connections == 1


async def test_close_drops_the_connection_and_the_server_sees_it(serve: Callable[..., Awaitable[Upstream]],
                                                                 client: UpstreamClient) -> None:
    never = asyncio.Event()

    async def answer(req: Request, w: asyncio.StreamWriter) -> bool:
        w.write(SSE_HEAD + chunk(EVENTS[0]))
        await w.drain()
        while not never.is_set():  # an engine generating on and on until its client leaves
            w.write(chunk(b": keep-alive\n\n"))
            await w.drain()
            await asyncio.sleep(0.01)
        return True

    up = await serve(answer)
    resp = await client.post(up.url(), data=b"{}", headers={})
    assert (await resp.content.readany()).startswith(EVENTS[0])
    resp.close()
    await wait_until(lambda: up.disconnects, 5, "the server seeing the client's disconnect")
    assert client.idle_count() == 0


async def test_cancelled_wait_for_the_head_drops_the_connection(serve: Callable[..., Awaitable[Upstream]],
                                                                client: UpstreamClient) -> None:
    async def answer(req: Request, w: asyncio.StreamWriter) -> bool:
        assert await req.reader.read() == b""  # a long prefill, until the client goes away
        up.disconnects += 1
        return False

    up = await serve(answer)
    task = asyncio.ensure_future(client.post(up.url(), data=b"{}", headers={}))
    await wait_until(lambda: up.requests, 5, "the request at the server")
    task.cancel()  # what the relay's first-byte deadline does
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: up.disconnects, 5, "the server seeing the client's disconnect")
    assert client.idle_count() == 0
    resp_up = await serve(sse)
    r = await client.post(resp_up.url(), data=b"{}", headers={})
    await r.read()
    assert client.connections_opened == 2


async def test_release_mid_body_past_the_drain_bound_closes(serve: Callable[..., Awaitable[Upstream]],
                                                            client: UpstreamClient) -> None:
    async def answer(req: Request, w: asyncio.StreamWriter) -> bool:
        w.write(SSE_HEAD)
        for _ in range(4 * DRAIN_BYTES // 1024):
            w.write(chunk(b"x" * 1024))
            await w.drain()
        w.write(b"0\r\n\r\n")
        return True

    up = await serve(answer)
    resp = await client.post(up.url(), data=b"{}", headers={})
    await resp.content.readany()
    resp.release()  # let go with most of a large body unread: not worth draining
    await wait_until(lambda: up.disconnects, 5, "the connection closed, not pooled")
    assert client.idle_count() == 0


async def test_idle_pool_is_bounded_and_expires(serve: Callable[..., Awaitable[Upstream]]) -> None:
    client = UpstreamClient(connect_timeout_s=2.0, max_idle_per_host=2, idle_expiry_s=0.3)
    gate = asyncio.Event()

    async def answer(req: Request, w: asyncio.StreamWriter) -> bool:
        await gate.wait()  # hold all five until each has its own connection
        return await sse(req, w)

    up = await serve(answer)
    try:
        posts = [asyncio.ensure_future(client.post(up.url(), data=b"{}", headers={})) for _ in range(5)]
        await wait_until(lambda: len(up.requests), 5, "five requests in flight", ok=lambda n: n == 5)
        gate.set()
        for resp in await asyncio.gather(*posts):
            assert await resp.read() == b"".join(EVENTS)
            resp.release()
        assert up.connections == 5 and client.idle_count() == 2
        await wait_until(lambda: up.disconnects, 5, "the three past the bound closed", ok=lambda n: n >= 3)
        # ... and the two kept are closed once idle past the expiry, by the client
        await wait_until(lambda: up.disconnects, 5, "the idle ones expired", ok=lambda n: n == 5)
        assert client.idle_count() == 0
    finally:
        await client.close()


async def test_backpressure_bounds_what_a_slow_reader_buffers(serve: Callable[..., Awaitable[Upstream]]) -> None:
    limit = 64 * 1024
    client = UpstreamClient(connect_timeout_s=2.0, read_buffer_bytes=limit)
    total = 64 * 1024 * 1024  # more than loopback's socket buffers hold
    sent = 0
    blocked = False  # the server's writes back up: the kernel's buffers are full, nobody reads

    async def answer(req: Request, w: asyncio.StreamWriter) -> bool:
        nonlocal sent, blocked
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        while sent < total:
            w.write(b"y" * 65536)
            sent += 65536
            if w.transport.get_write_buffer_size() > 65536:  # past the default high-water mark
                blocked = True
            await w.drain()
            await asyncio.sleep(0)  # drain() does not yield while the kernel takes it all: let the client run
        return True

    up = await serve(answer)
    try:
        resp = await client.post(up.url(), data=b"{}", headers={})
        await wait_until(lambda: blocked, 10, "the server held back by a reader that does not read")
        assert resp._conn is not None and resp._conn.paused
        assert resp._size <= limit + 256 * 1024, resp._size  # the limit plus at most one read
        assert sent < total, (sent, resp._size)
        got = 0
        while data := await resp.content.readany():
            got += len(data)
        assert got == total
        resp.release()
        assert client.idle_count() == 1
    finally:
        await client.close()


async def test_header_injection_refused(serve: Callable[..., Awaitable[Upstream]], client: UpstreamClient) -> None:
    up = await serve(sse)
    with pytest.raises(ValueError):
        await client.post(up.url(), data=b"{}", headers={"X-Request-Id": "a\r\nX-Evil: 1"})
    assert up.connections == 0


async def test_closed_client_refuses_new_requests() -> None:
    client = UpstreamClient(connect_timeout_s=1.0)
    await client.close()
    with pytest.raises(RuntimeError):
        await client.post("http://127.0.0.1:1/v1/completions", data=b"{}", headers={})


def test_under_uvloop() -> None:
    """`tokenfleet up` runs uvloop (gateway.cli): its transports are not asyncio's classes."""
    import uvloop

    async def scenario() -> tuple[int, int, type[BaseException] | None]:
        async def answer(req: Request, w: asyncio.StreamWriter) -> bool:
            if req.index == 3:
                w.write(SSE_HEAD + chunk(EVENTS[0]))
                await w.drain()
                return False  # cut mid-stream
            return await sse(req, w)

        up = Upstream(answer)
        srv = await asyncio.start_server(up.handle, "127.0.0.1", 0)
        up.port = srv.sockets[0].getsockname()[1]
        client = UpstreamClient(connect_timeout_s=2.0)
        try:
            for _ in range(3):
                resp = await client.post(up.url(), data=b"{}", headers={"Content-Type": "application/json"})
                assert await read_stream(resp) == b"".join(EVENTS)
                await wait_until(lambda: client.idle_count(), 5, "the connection back in the pool")
            resp = await client.post(up.url(), data=b"{}", headers={})
            error = None
            try:
                await resp.read()
            except aiohttp.ClientError as e:
                error = type(e)
            return up.connections, client.connections_opened, error
        finally:
            await client.close()
            srv.close()

    assert uvloop.run(scenario()) == (1, 1, PayloadIncomplete)


async def test_a_body_that_ends_past_the_read_bound_leaves_a_pooled_connection_that_reads(
        serve: Callable[..., Awaitable[Upstream]]) -> None:
    # The body's last bytes arrive with more unread than `read_buffer_bytes`: reading pauses and
    # the body completes in the same read, so the connection goes back to the pool paused. Its
    # reader then took the body, but from a response already finished, and resumed nothing: the
    # next request on the pooled connection never heard its answer (the relay's first-byte
    # deadline, or for a whole answer from a live engine, never).
    limit = 1024
    client = UpstreamClient(connect_timeout_s=2.0, read_buffer_bytes=limit)
    body = b"z" * (4 * limit)

    async def answer(req: Request, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))  # one write, one read
        await w.drain()
        return True

    up = await serve(answer)
    try:
        for _ in range(3):
            resp = await asyncio.wait_for(client.post(up.url(), data=b"{}", headers={}), 5)
            assert await asyncio.wait_for(resp.read(), 5) == body
            resp.release()
        assert up.connections == 1 and client.connections_opened == 1  # the same connection, reading
    finally:
        await client.close()


async def endless(req: Request, w: asyncio.StreamWriter, status: bytes = b"200 OK") -> bool:
    """A body that never ends (chunked, 64 KiB a chunk) until the client goes."""
    w.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    while True:
        w.write(chunk(b"x" * 65536))
        await w.drain()


async def test_read_with_a_limit_stops_an_endless_body(serve: Callable[..., Awaitable[Upstream]],
                                                       client: UpstreamClient) -> None:
    # `read()` without a limit would hold GBs in the seconds a deadline allows; with one it holds
    # at most the limit (plus one read) and raises, or with `truncate` hands back the first bytes
    from gateway.upstream_http import BodyTooLarge

    up = await serve(endless)
    resp = await client.post(up.url(), data=b"{}", headers={})
    with pytest.raises(BodyTooLarge):
        await asyncio.wait_for(resp.read(1 << 20), 10)
    resp.close()
    resp = await client.post(up.url(), data=b"{}", headers={})
    got = await asyncio.wait_for(resp.read(1000, truncate=True), 10)
    resp.close()
    assert got == b"x" * 1000
    await wait_until(lambda: up.disconnects, 10, "both connections closed", ok=lambda n: n == 2)  # never pooled mid-body
