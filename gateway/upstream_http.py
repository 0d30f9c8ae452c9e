"""A lean HTTP/1.1 client for the relay's upstream legs: many small streams to a few engines.

What the relay needs of aiohttp, and nothing else (issue 14: aiohttp was ~16% of the gateway's
self time per relayed stream): `UpstreamClient.post(url, data=, headers=)` answers an
`UpstreamResponse` once the response head is in, with `.status`, `.headers` (case-insensitive
`get`), `.content.readany()` (b"" at the end), `.read()`, `.release()` and `.close()`.

- One `asyncio.Protocol` per connection, parsed by `httptools`' C parser (llhttp: chunked
  decoding, keep-alive rules); one `transport.write` per request (head + body).
- A keep-alive pool per (scheme, host, port): at most `max_idle_per_host` idle connections,
  each dropped after `idle_expiry_s` unused (one sweep timer for the whole client). Active
  connections are not capped: every stream holds one, as with aiohttp's `limit=0`.
- A connection goes back to the pool the moment its response's body has fully arrived (the
  reader may still hold the last bytes); `release()` before that lets it read the rest of the
  body in the background, bounded (`DRAIN_BYTES`, `DRAIN_S`), so that a stream released as soon
  as `[DONE]` passed by (the chunked terminator often follows in the next segment) still keeps
  its connection; past either bound it is closed. `close()` drops the connection at once: that
  is what tells an engine to abort.
- Backpressure: past `read_buffer_bytes` unread, the connection stops reading until the
  consumer catches up.
- A pooled connection that the server closed while idle: the request is sent once more on a
  fresh connection, only when nothing of the response had arrived (the server never answered:
  what aiohttp does too).
- Connect has its own deadline (`connect_timeout_s`); reads have none: the relay bounds every
  wait (`gateway.deadlines.UpstreamWatch`), and a cancelled wait for the head drops the
  connection.

Errors are aiohttp's classes (subclassed), so every `except aiohttp.ClientError` and the relay's
classification (`gateway.relay._connect_failure`: refused, timed out, failed) hold unchanged:
`ConnectFailed` (`ClientOSError`, `.os_error`), `ConnectTimedOut` (`ConnectionTimeoutError`, a
`TimeoutError`), `Disconnected` (`ServerDisconnectedError`: closed before the head),
`PayloadIncomplete` (`ClientPayloadError`: closed mid-body), `InvalidResponse`.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Mapping
from types import TracebackType
from typing import Final
from urllib.parse import urlsplit

import aiohttp
import httptools

DRAIN_BYTES: Final = 64 * 1024  # a released body's rest read to keep its connection, at most
DRAIN_S: Final = 1.0  # ... for at most this long
READ_BUFFER_BYTES: Final = 256 * 1024  # unread bytes per response before reading pauses
MAX_IDLE_PER_HOST: Final = 64
IDLE_EXPIRY_S: Final = 30.0  # aiohttp's keepalive_timeout the gateway used (gateway.app)
_URL_CACHE_SIZE: Final = 1024  # distinct upstream URLs parsed once (instances x paths)


class ConnectFailed(aiohttp.ClientOSError):
    """The TCP (or TLS) connect failed; `os_error` says how (refused, unreachable, reset)."""

    def __init__(self, where: str, os_error: OSError) -> None:
        text = f"cannot connect to {where}: {os_error.strerror or os_error}"
        if os_error.errno is None:
            super().__init__(text)
        else:
            super().__init__(os_error.errno, text)
        self.os_error = os_error


class ConnectTimedOut(aiohttp.ConnectionTimeoutError):
    """No connection within `connect_timeout_s` (a TimeoutError too, as aiohttp's)."""


class Disconnected(aiohttp.ServerDisconnectedError):
    """The connection ended before the response head was complete."""

    def __init__(self, message: str, *, nothing_received: bool) -> None:
        super().__init__(message)
        self.nothing_received = nothing_received  # not a byte of the response: safe to resend


class PayloadIncomplete(aiohttp.ClientPayloadError):
    """The connection ended inside a body framed by Content-Length or chunked encoding."""


class InvalidResponse(aiohttp.ClientConnectionError):
    """What the server sent is not an HTTP/1.1 response (the connection is dropped)."""


class Headers(dict[str, str]):
    """Response headers, names lower-cased: `get`, `[]` and `in` ignore case (as aiohttp's
    CIMultiDictProxy). A repeated header's values are joined with ", "."""

    __slots__ = ()

    def get(self, key: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return dict.get(self, key.lower(), default)

    def __getitem__(self, key: str) -> str:
        return dict.__getitem__(self, key.lower())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and dict.__contains__(self, key.lower())


class BodyTooLarge(ValueError):
    """`UpstreamResponse.read(limit)`: the body went past the limit."""


class UpstreamResponse:
    """One response: its head (`status`, `headers`) and a bounded buffer of its body."""

    __slots__ = ("status", "headers", "_conn", "_loop", "_chunks", "_size", "_eof", "_error", "_waiter",
                 "_head", "_framed")

    def __init__(self, conn: _Connection, loop: asyncio.AbstractEventLoop) -> None:
        self.status = 0
        self.headers = Headers()
        self._conn: _Connection | None = conn  # None once the body is in, released or closed
        self._loop = loop
        self._chunks: list[bytes] = []
        self._size = 0
        self._eof = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._head: asyncio.Future[None] = loop.create_future()
        self._framed = True  # Content-Length or chunked: the connection's end is not the body's

    @property
    def content(self) -> UpstreamResponse:
        """aiohttp's `resp.content.readany()`: the body reader is the response itself."""
        return self

    async def readany(self) -> bytes:
        """Everything received and not yet read, waiting for some; b"" once the body is over."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._eof:
                return b""
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self._size = 0
        conn = self._conn
        if conn is not None and conn.paused:
            conn.resume()
        return data

    async def read(self, limit: int | None = None, truncate: bool = False) -> bytes:
        """The rest of the body. `limit`: at most that many bytes are held; past it `BodyTooLarge`,
        or with `truncate` the first `limit` bytes (the rest left unread: the caller closes the
        response, never pools it). An engine that never ends its body must not take the
        gateway's memory in the seconds any caller's deadline allows (GBs over loopback)."""
        parts: list[bytes] = []
        held = 0
        while data := await self.readany():
            parts.append(data)
            held += len(data)
            if limit is not None and held > limit:
                if truncate:
                    return b"".join(parts)[:limit]
                raise BodyTooLarge(f"a body of more than {limit} bytes")
        return b"".join(parts)

    def release(self) -> None:
        """Done with it: the connection goes back to the pool once the body is all in (the rest
        is read in the background, bounded); else, or on any doubt, it is closed."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.drain()
        self._chunks = []

    def close(self) -> None:
        """Drop the connection now (an unfinished stream: how an engine learns to abort)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()
        self._chunks = []

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if exc is None:
            self.release()
        else:
            self.close()

    # --- fed by the connection ---

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        self._wake()

    def _fail(self, error: BaseException) -> None:
        self._conn = None
        if not self._head.done():
            self._head.set_exception(error)
            self._head.exception()  # retrieved here: nobody may be awaiting it any more
        else:
            self._error = error
        self._wake()

    def _finished(self) -> None:
        self._conn = None
        self._eof = True
        self._wake()


class _Connection(asyncio.Protocol):
    """One keep-alive connection; at most one request on it at a time (no pipelining)."""

    __slots__ = ("pool", "key", "transport", "parser", "response", "received", "paused", "closed", "draining",
                 "drained", "idle_since", "_drain_timer", "_bad", "_informational", "_buffer_limit", "_loop")

    def __init__(self, pool: UpstreamClient, key: tuple[str, str, int]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.received = False  # a byte of the current response came
        self.paused = False
        self.closed = False
        self.draining = False
        self.drained = 0
        self.idle_since = 0.0
        self._drain_timer: asyncio.TimerHandle | None = None
        self._bad = False
        self._informational = False  # inside a 1xx interim response: the real one follows
        self._buffer_limit = pool.read_buffer_bytes
        self._loop = pool.loop

    # --- the request ---

    def send(self, head: bytes, body: bytes) -> UpstreamResponse:
        assert self.transport is not None and self.response is None
        resp = self.response = UpstreamResponse(self, self._loop)
        self.received = False
        # One write: the head and a small body joined (a copy is cheaper than a second syscall);
        # a large one as two buffers, sent with one sendmsg where the loop can.
        if len(body) <= 65536:
            self.transport.write(head + body)
        else:
            self.transport.writelines((head, body))
        return resp

    def resume(self) -> None:
        self.paused = False
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def drain(self) -> None:
        """The reader let go before the body was all in: read the rest, within bounds, then pool."""
        if self.closed:
            return
        self.response = None
        self.draining = True
        self.drained = 0
        if self.paused:
            self.resume()
        self._drain_timer = self._loop.call_later(DRAIN_S, self.abort)

    def abort(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None
        resp, self.response = self.response, None
        if resp is not None:
            resp._conn = None
        if self.transport is not None:
            self.transport.abort()

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's TCPTransport is not registered as an asyncio.Transport: no isinstance check)
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.response is None and not self.draining:
            self.abort()  # bytes nobody asked for (an idle connection): not to be trusted
            return
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._lost(InvalidResponse(f"invalid HTTP response: {e}"))
            self.abort()
            return
        if self._bad:
            self.abort()

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        was_closed, self.closed = self.closed, True
        if self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None
        self.draining = False
        if not was_closed:
            what = f" ({type(exc).__name__}: {exc})" if exc is not None else ""
            self._lost(None, what)

    def _lost(self, error: BaseException | None, what: str = "") -> None:
        resp, self.response = self.response, None
        if resp is None:
            return
        if error is None:
            if not resp._head.done():
                error = Disconnected(f"server closed the connection before the response head{what}",
                                     nothing_received=not self.received)
            elif not resp._framed:
                resp._finished()  # a body delimited by the connection's end: this is its end
                return
            else:
                error = PayloadIncomplete(f"server closed the connection mid-body{what}")
        resp._fail(error)

    # --- httptools' callbacks (inside feed_data) ---

    def on_message_begin(self) -> None:
        if self.response is None and not self.draining:
            self._bad = True

    def on_header(self, name: bytes, value: bytes) -> None:
        resp = self.response
        if resp is None:
            return
        k = name.decode("latin-1").lower()
        v = value.decode("latin-1")
        headers = resp.headers
        old = dict.get(headers, k)
        dict.__setitem__(headers, k, v if old is None else f"{old}, {v}")

    def on_headers_complete(self) -> None:
        resp = self.response
        if resp is None:
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # interim (103 Early Hints, an unasked 100): the real head follows
            self._informational = True
            resp.headers = Headers()
            return
        resp.status = status
        h = resp.headers
        resp._framed = (dict.__contains__(h, "content-length") or "chunked" in h.get("transfer-encoding", "").lower()
                        or status in (204, 304))
        resp._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        resp = self.response
        if resp is not None:
            resp._feed(body)
            if resp._size > self._buffer_limit and not self.paused and self.transport is not None:
                self.paused = True
                self.transport.pause_reading()
        elif self.draining:
            self.drained += len(body)
            if self.drained > DRAIN_BYTES:
                self._bad = True  # more than a tail: not worth keeping

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        resp, self.response = self.response, None
        if resp is not None:
            resp._finished()
        if self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None
        self.draining = False
        if self._bad or not self.parser.should_keep_alive():
            self._bad = True  # closed once feed_data returns
            return
        if self.paused:
            # The body's last read took it past the buffer bound (reading paused) and ended it in
            # the same read: nothing of this response is left to read, and its reader, holding a
            # finished response, resumes nothing. Pooled paused, the connection's next request
            # would never hear its answer (a whole answer from a live engine: never at all).
            self.resume()
        self.pool._put(self)


class UpstreamClient:
    """The relay's HTTP session: keep-alive pools per (scheme, host, port), no per-request setup."""

    def __init__(self, connect_timeout_s: float, *, max_idle_per_host: int = MAX_IDLE_PER_HOST,
                 idle_expiry_s: float = IDLE_EXPIRY_S, read_buffer_bytes: int = READ_BUFFER_BYTES,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        if connect_timeout_s <= 0 or max_idle_per_host < 0 or idle_expiry_s <= 0 or read_buffer_bytes <= 0:
            raise ValueError("connect_timeout_s, idle_expiry_s and read_buffer_bytes must be > 0, "
                             "max_idle_per_host >= 0")
        self.loop = asyncio.get_running_loop()
        self.connect_timeout_s = connect_timeout_s
        self.max_idle_per_host = max_idle_per_host
        self.idle_expiry_s = idle_expiry_s
        self.read_buffer_bytes = read_buffer_bytes
        self._ssl = ssl_context
        self._idle: dict[tuple[str, str, int], deque[_Connection]] = {}
        self._urls: dict[str, tuple[tuple[str, str, int], bytes]] = {}
        self._sweep_timer: asyncio.TimerHandle | None = None
        self.closed = False
        self.connections_opened = 0  # for tests and benchmarks: how often the pool missed

    def idle_count(self, url: str | None = None) -> int:
        """Idle pooled connections (to `url`'s host, or all) that are still open."""
        pools = [self._idle.get(self._target(url)[0], deque())] if url is not None else self._idle.values()
        return sum(1 for q in pools for c in q if not c.closed)

    async def post(self, url: str, *, data: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        """POST `data`; the response once its head is in. Host and Content-Length are this
        client's; `headers` must not repeat them."""
        if self.closed:
            raise RuntimeError("the upstream client is closed")
        key, start = self._target(url)
        extra = "".join([f"{k}: {v}\r\n" for k, v in headers.items()])
        # One CR and one LF per header line, or a name/value carried its own (header injection).
        if extra.count("\n") != len(headers) or extra.count("\r") != len(headers):
            raise ValueError("a header name or value holds CR or LF")
        head = start + f"{len(data)}\r\n{extra}\r\n".encode()
        conn = self._take(key)
        reused = conn is not None
        if conn is None:
            conn = await self._connect(key)
        try:
            resp = conn.send(head, data)
            try:
                await resp._head
            except Disconnected as e:
                if not (reused and e.nothing_received):
                    raise
                # The server closed the idle connection as we sent: it never read the request.
                conn = await self._connect(key)
                resp = conn.send(head, data)
                await resp._head
        except BaseException:
            conn.abort()  # cancelled (a deadline, the client left) or failed: never back to the pool
            raise
        return resp

    async def close(self) -> None:
        """Close the idle connections; responses still being read close theirs on release."""
        self.closed = True
        if self._sweep_timer is not None:
            self._sweep_timer.cancel()
            self._sweep_timer = None
        for q in self._idle.values():
            for c in q:
                c.abort()
        self._idle.clear()

    # --- internals ---

    def _target(self, url: str) -> tuple[tuple[str, str, int], bytes]:
        """(pool key, the request line and fixed headers up to Content-Length's value), parsed once."""
        hit = self._urls.get(url)
        if hit is not None:
            return hit
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        port = u.port or (443 if u.scheme == "https" else 80)
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        host = u.netloc.rpartition("@")[2]
        start = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: ".encode()
        if len(self._urls) >= _URL_CACHE_SIZE:
            self._urls.clear()
        hit = self._urls[url] = ((u.scheme, u.hostname, port), start)
        return hit

    def _take(self, key: tuple[str, str, int]) -> _Connection | None:
        q = self._idle.get(key)
        if not q:
            return None
        oldest_ok = self.loop.time() - self.idle_expiry_s
        while q:
            c = q.pop()  # the most recently used: the least likely to have been closed by the server
            if c.closed or c.transport is None or c.transport.is_closing():
                continue
            if c.idle_since < oldest_ok:
                c.abort()
                for older in q:  # everything to its left is older still
                    older.abort()
                q.clear()
                return None
            return c
        return None

    def _put(self, conn: _Connection) -> None:
        if self.closed or conn.closed:
            conn.abort()
            return
        if self.max_idle_per_host == 0:
            conn.abort()
            return
        q = self._idle.get(conn.key)
        if q is None:
            q = self._idle[conn.key] = deque()
        if len(q) >= self.max_idle_per_host:
            q.popleft().abort()  # the bound on idle connections: the oldest goes
        conn.idle_since = self.loop.time()
        q.append(conn)
        if self._sweep_timer is None:
            self._sweep_timer = self.loop.call_later(self.idle_expiry_s, self._sweep)

    def _sweep(self) -> None:
        """Close connections idle past the expiry; re-arm while any are left."""
        self._sweep_timer = None
        oldest_ok = self.loop.time() - self.idle_expiry_s
        for key in list(self._idle):
            q = self._idle[key]
            while q and (q[0].closed or q[0].idle_since < oldest_ok):
                q.popleft().abort()
            if not q:
                del self._idle[key]
        if self._idle and not self.closed:
            self._sweep_timer = self.loop.call_later(self.idle_expiry_s, self._sweep)

    async def _connect(self, key: tuple[str, str, int]) -> _Connection:
        scheme, host, port = key
        ssl_arg: ssl.SSLContext | bool | None = None
        if scheme == "https":
            ssl_arg = self._ssl if self._ssl is not None else True
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await self.loop.create_connection(lambda: _Connection(self, key), host, port, ssl=ssl_arg)
        except TimeoutError:
            raise ConnectTimedOut(f"no connection to {host}:{port} within {self.connect_timeout_s:g} s") from None
        except OSError as e:
            raise ConnectFailed(f"{host}:{port}", e) from None
        self.connections_opened += 1
        return conn
