"""The client-facing listener: the deadlines, caps and limits uvicorn does not enforce itself.

uvicorn (httptools protocol) waits forever for a request's headers and body and accepts
every connection the kernel hands it, so a few thousand connections trickling header bytes
(slowloris) hold every file descriptor and `/health` stops answering. Here each listening
socket gets a `Listener` (its caps and live counts) and every connection a
`GuardedHttpToolsProtocol`, which

- refuses a connection over the listener's total or per-client-address cap at once
  (503 with Retry-After, then close) instead of letting it hold a slot;
- closes a connection whose request line and headers have not all arrived within
  `header_timeout_s` (408 once some bytes came, silently when none did);
- closes a connection whose body has not all arrived within `body_timeout_s` of its
  headers (408, OpenAI-style; the app sees `http.disconnect`);
- answers 431 to too many header fields or too many header bytes, before buffering more;
- closes a connection that takes no bytes of a response for `send_timeout_s` (a client that
  stopped reading: uvicorn would wait on the socket's drain for ever, holding the request and
  its engine's KV cache); the app sees `http.disconnect`, so a relayed stream is aborted upstream.

POST /v1 requests on the public listener start the app's lean lane directly, and every response
is written by a leaner `send` of uvicorn's semantics (`gateway.lane_cycle`). Idle keep-alive is
uvicorn's own `timeout_keep_alive`. An optional ops listener (own socket,
own small caps) serves only the operator paths, so a flood on the public port cannot starve
`/health` and `/metrics`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import resource
import socket
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import httptools
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.config import Config
from uvicorn.protocols.http import httptools_impl as _httptools_impl
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from fleetcore.fleet_config import GatewaySettings
from gateway.errors import INVALID_REQUEST, SERVER_ERROR, error_body
from gateway.head_hold import SCOPE_KEY as HEAD_HOLD
from gateway.head_hold import HeadHold
from gateway.lane_cycle import Lane, LaneCycle, find_lane
from gateway.loop_monitor import LoopMonitor, running_on

log = logging.getLogger("tokenfleet.listener")

# What the ops listener serves (exact paths; a trailing slash means "and everything under it").
# /dashboard too: the operators' page belongs where only they reach it (gateway/dashboard.py).
OPS_PATHS = ("/health", "/metrics", "/admin/", "/debug/", "/dashboard", "/dashboard/")
# The ops listener's own caps: a scraper, a load balancer's health checks, an operator's curl.
OPS_MAX_CONNECTIONS = 64
OPS_MAX_CONNECTIONS_PER_CLIENT = 16
# File descriptors kept free of client connections: engine health checks, Redis, the sim
# workers' pipes, log files, tokenizer files. Each client connection may hold one upstream
# connection as well, so a client connection costs two descriptors.
FD_RESERVE = 256
FDS_PER_CONNECTION = 2


@dataclass(frozen=True, slots=True)
class ListenerLimits:
    name: str  # "public" or "ops": the metrics label, and `scope["tokenfleet.listener"]`
    max_connections: int
    max_connections_per_client: int
    header_timeout_s: float
    body_timeout_s: float
    max_header_count: int
    max_header_bytes: int
    send_timeout_s: float  # a response's bytes not taken by the client for this long: closed
    paths: tuple[str, ...] | None = None  # None: every path; else only these (see OPS_PATHS)

    @classmethod
    def public(cls, gw: GatewaySettings) -> ListenerLimits:
        return cls("public", gw.max_connections, min(gw.max_connections_per_client, gw.max_connections),
                   gw.header_timeout_s, gw.body_timeout_s, gw.max_header_count, gw.max_header_bytes,
                   gw.send_timeout_s)

    @classmethod
    def ops(cls, gw: GatewaySettings) -> ListenerLimits:
        return cls("ops", OPS_MAX_CONNECTIONS, OPS_MAX_CONNECTIONS_PER_CLIENT, gw.header_timeout_s,
                   gw.body_timeout_s, gw.max_header_count, gw.max_header_bytes, gw.send_timeout_s, OPS_PATHS)


def bind_socket(host: str, port: int, backlog: int = 2048, reuse_port: bool = False) -> socket.socket:
    """A non-blocking listening TCP socket (IPv6 when `host` is an IPv6 address). `reuse_port`:
    SO_REUSEPORT, so that several worker processes listen on one port and the kernel spreads
    connections over them (`tokenfleet up --workers`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and
    # without it Nagle holds each small SSE event behind the client's delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def raise_fd_limit() -> int:
    """Raise this process's open-file soft limit to its hard limit; return the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else _nr_open()
    if soft == resource.RLIM_INFINITY or target <= soft:
        return soft if soft != resource.RLIM_INFINITY else target
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as e:
        log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, e)
        return soft
    return target


def _nr_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 20


def fit_to_fd_limit(limits: ListenerLimits, nofile: int, reserved: int) -> tuple[ListenerLimits, str | None]:
    """`limits` with max_connections lowered so that its connections (and their upstream
    connections) plus `reserved` descriptors fit under `nofile`; and a warning if it was."""
    room = max(1, (nofile - reserved) // FDS_PER_CONNECTION)
    if limits.max_connections <= room:
        return limits, None
    fitted = replace(limits, max_connections=room,
                     max_connections_per_client=min(limits.max_connections_per_client, room))
    return fitted, (f"gateway.max_connections {limits.max_connections} lowered to {room}: the open-file "
                    f"limit is {nofile} (raise it with `ulimit -Hn` or LimitNOFILE=)")


class BoundedFlow(FlowControl):
    """uvicorn's flow control with a bound on the write side: `drain` (a response's `send` while
    the socket's buffer is over its high-water mark) waits at most `timeout_s` for the client to
    take bytes, then calls `expired` (the protocol closes the connection). uvicorn's own waits for
    ever: a client that stops reading holds its request, and the engine's KV cache behind it, for
    as long as it keeps the connection open. Each drain is one stretch without progress: a client
    that reads slowly but reads is never cut off."""

    def __init__(self, transport: asyncio.Transport, timeout_s: float, expired: Callable[[], None]) -> None:
        super().__init__(transport)
        self._timeout_s = timeout_s
        self._expired = expired

    async def drain(self) -> None:
        writable = self._is_writable_event
        if writable.is_set():
            return
        try:
            await asyncio.wait_for(writable.wait(), self._timeout_s)
        except asyncio.TimeoutError:
            self._expired()


class Listener:
    """One listening socket: its limits and the connections open on it right now."""

    def __init__(self, sock: socket.socket, limits: ListenerLimits) -> None:
        addr = sock.getsockname()
        self.host: str = addr[0]
        self.port: int = addr[1]
        self.limits = limits
        self.open = 0
        # Holds only addresses with a connection open: bounded by max_connections.
        self._per_client: dict[str, int] = {}
        self.closed: Counter[str] = Counter()  # connections refused or closed by us, by reason
        self._wrapped: tuple[ASGIApp, ASGIApp] | None = None
        self._lane: tuple[ASGIApp, Lane | None] | None = None  # (the app, its /v1 lane), found once

    def admit(self, client: str) -> bool:
        if self.open >= self.limits.max_connections:
            self.closed["max_connections"] += 1
            return False
        n = self._per_client.get(client, 0)
        if n >= self.limits.max_connections_per_client:
            self.closed["max_connections_per_client"] += 1
            return False
        self._per_client[client] = n + 1
        self.open += 1
        return True

    def release(self, client: str) -> None:
        self.open -= 1
        n = self._per_client.pop(client) - 1
        if n:
            self._per_client[client] = n

    def lane_for(self, app: ASGIApp) -> Lane | None:
        """The /v1 lane this listener serves `app`'s POST /v1 requests by (`gateway.lane_cycle`):
        none on a listener that serves only some paths (the ops one: /v1 is not among them)."""
        if self.limits.paths is not None:
            return None
        if self._lane is None or self._lane[0] is not app:
            self._lane = (app, find_lane(app))
        return self._lane[1]

    def app_for(self, app: ASGIApp) -> ASGIApp:
        if self.limits.paths is None:
            return app
        if self._wrapped is None or self._wrapped[0] is not app:
            self._wrapped = (app, PathFilter(app, self.limits.paths))
        return self._wrapped[1]


class PathFilter:
    """ASGI: pass only `paths` through (the ops listener); 404 OpenAI-style for the rest."""

    def __init__(self, app: ASGIApp, paths: Sequence[str]) -> None:
        self.app = app
        self.exact = frozenset(p.rstrip("/") for p in paths)
        self.prefixes = tuple(p for p in paths if p.endswith("/"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in self.exact or path.startswith(self.prefixes):
            await self.app(scope, receive, send)
            return
        body = error_body(f"Unknown request URL: {scope.get('method', '')} {path} (this is the ops "
                          f"listener: {', '.join(sorted(self.exact))}).", INVALID_REQUEST, None, "unknown_url")
        await JSONResponse(body, status_code=404)(scope, receive, send)


def client_key(host: str) -> str:
    """What the per-client cap counts by: the IPv4 address, or the /64 of an IPv6 one (a
    single host commonly holds a whole /64 and could rotate through it)."""
    if ":" not in host:
        # Not IPv6 (every IPv6 text has a colon): an IPv4 address or no address at all, and
        # both are counted as they are. Skips the ipaddress parse for each new IPv4 connection.
        return host
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return host


def _find_listener(listeners: Sequence[Listener], sockname: Any) -> Listener:
    """The listener a connection arrived on, from the connection's local address."""
    host, port = (sockname[0], sockname[1]) if isinstance(sockname, tuple) else ("", None)
    same_port = [lst for lst in listeners if lst.port == port]
    if len(same_port) == 1:
        return same_port[0]
    for lst in same_port:
        if lst.host == host:
            return lst
    # Several listeners on one port with wildcard hosts, or no address: the first (public) one.
    return same_port[0] if same_port else listeners[0]


def _error_response(status: int, message: str, code: str, retry_after_s: int | None = None) -> bytes:
    """A complete HTTP/1.1 error response with an OpenAI-style body that closes the connection,
    written straight to the transport (no ASGI cycle exists, or it is being abandoned)."""
    kind = SERVER_ERROR if status >= 500 else INVALID_REQUEST
    body = json.dumps(error_body(message, kind, None, code)).encode()
    head = [STATUS_LINE[status], b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body), b"connection: close\r\n"]
    if retry_after_s is not None:
        head.append(b"retry-after: %d\r\n" % retry_after_s)
    return b"".join([*head, b"\r\n", body])


class _Refused(Exception):
    """Raised inside a parser callback to stop parsing; `_refusal` says what to answer."""


# A refused connection waits this long at most for its client to close after our answer
# (`GuardedHttpToolsProtocol._close_refused`), and this many wait at once at most.
REFUSED_LINGER_S = 1.0
REFUSED_LINGER_MAX = 256


class _Lingering:
    count = 0  # refused connections waiting for their client's close, this process


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with connection caps, read deadlines and header limits.

    `protocol_class` makes a subclass bound to the server's listeners.
    """

    listeners: ClassVar[tuple[Listener, ...]] = ()

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._listener: Listener | None = None  # set once admitted
        self._peer = ""
        self._timer: asyncio.TimerHandle | None = None  # the header or body deadline
        self._in_headers = False  # a request has begun (or the connection is new), headers incomplete
        self._header_bytes = 0  # bytes received during the header phase (whole reads; may overcount)
        # What the request's head may still take (exact: request target plus complete header
        # fields), counted down: one subtraction and one sign test a header (`on_header`)
        self._header_room = 0  # bytes
        self._headers_left = 0  # header fields
        self._read_len = 0
        self._refusal: tuple[int, str, str] | None = None
        self._monitor: LoopMonitor | None = None  # the loop's stall monitor: told when bytes arrive
        self._lingering = False  # refused, answered, waiting for the client's close (`_close_refused`)
        self._lane: Lane | None = None  # the app's /v1 lane on this listener (`_start_asgi_task`)
        self._body_due = False  # a request's headers are in, its body is not (the body deadline's phase)
        # The request whose response is being sent: uvicorn's `self.cycle` is the newest one, which
        # a pipelined request's headers replace while this one is still answered (`_disconnect`).
        self._answering: RequestResponseCycle | None = None

    # --- connection ---

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peer = transport.get_extra_info("peername")
        self._peer = client_key(str(peer[0])) if isinstance(peer, tuple) else ""
        listener = _find_listener(self.listeners, transport.get_extra_info("sockname"))
        if not listener.admit(self._peer):
            # Refused before it costs more than this one write: not in uvicorn's connection set,
            # no parser work, no timer.
            self.transport = transport
            transport.write(_error_response(503, "Too many connections; retry shortly.", "too_many_connections", 1))
            self._close_refused(transport)
            return
        self._listener = listener
        self._lane = listener.lane_for(self.app)
        self.app = listener.app_for(self.app)
        self._monitor = running_on(self.loop)
        if self._monitor is not None:
            self._monitor.poke()
        super().connection_made(transport)
        self.flow = BoundedFlow(transport, listener.limits.send_timeout_s, self._send_timeout)
        # The header clock starts at connect: a connection that sends nothing is closed too.
        self._begin_headers(0)

    def _close_refused(self, transport: asyncio.Transport) -> None:
        """End a refused connection without losing its answer. Closing a socket whose client's
        first bytes are already in its receive buffer makes the kernel send a reset, and a
        reset can destroy the 503 before the client reads it (under a flood, the usual case:
        the accept runs after the client's head arrived). So: the answer, then our FIN
        (`write_eof`), the client's bytes read and dropped (`data_received` ignores a refused
        connection) until it closes (`eof_received`: the transport closes) or
        `REFUSED_LINGER_S` passes. Bounded: past `REFUSED_LINGER_MAX` lingering at once, a
        refusal closes at once, as before."""
        if _Lingering.count >= REFUSED_LINGER_MAX or not transport.can_write_eof():
            transport.close()
            return
        _Lingering.count += 1
        self._lingering = True
        transport.write_eof()
        self._timer = self.loop.call_later(REFUSED_LINGER_S, transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._listener is None:  # refused in connection_made
            if self._lingering:
                self._lingering = False
                _Lingering.count -= 1
                self._cancel_timer()
            return
        self._cancel_timer()
        self._listener.release(self._peer)
        super().connection_lost(exc)
        self._disconnect(self._answering)

    def data_received(self, data: bytes) -> None:
        if self._listener is None or self.parser is None:
            return
        monitor = self._monitor
        if monitor is not None and monitor.idle:  # a request may be starting: measure the loop finely
            monitor.poke()
        self._unset_keepalive_if_required()
        self._read_len = len(data)
        if self._in_headers:
            self._header_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError:
            if self._refusal is not None:
                self._refuse(*self._refusal)
            else:  # counted, not logged: a flood of garbage must not become a flood of log lines
                self._listener.closed["bad_request"] += 1
                self.send_400_response("Invalid HTTP request received.")
            return
        # A header line still arriving is buffered by the parser, whole: bound it here.
        if self._in_headers and self._header_bytes > self._listener.limits.max_header_bytes:
            self._refuse(431, f"Request headers are larger than {self._listener.limits.max_header_bytes} bytes.",
                         "headers_too_large")
            return
        if self._timer is None:
            # A deadline only for a request still arriving after this read (its clock starts
            # now, in the same loop step as its bytes): the usual request, whole in one read,
            # has neither timer armed and cancelled (`_begin_headers`, `on_headers_complete`).
            if self._in_headers:
                self._arm(self._listener.limits.header_timeout_s, self._header_timeout)
            elif self._body_due:
                self._arm(self._listener.limits.body_timeout_s, self._body_timeout)

    # --- parser callbacks ---

    def on_message_begin(self) -> None:
        super().on_message_begin()
        assert self._listener is not None
        self.scope["tokenfleet.listener"] = self._listener.limits.name  # type: ignore[typeddict-unknown-key]
        if not self._in_headers:
            # A later request on a kept-alive connection: its header clock starts with its first byte
            # (armed by `data_received` if its headers are not all in this read).
            # The whole read counts (a pipelined request's tail may precede it): an overcount only.
            self._begin_headers(self._read_len, arm=False)

    def on_url(self, url: bytes) -> None:
        self._count_header_bytes(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        # Once per header of every request: the limits as budgets counted down (no attribute
        # chain to the limits, one test for both) and uvicorn's own `on_header` called as a
        # function, not through `super()` (bench/README.md, "Issue 14: per layer", and "the
        # server side").
        self._headers_left -= 1
        self._header_room -= len(name) + len(value) + 4
        if self._headers_left < 0 or self._header_room < 0:
            limits = self._listener.limits  # type: ignore[union-attr]  (set before the parser runs)
            if self._headers_left < 0:  # the count first, as it was tested first
                self._refusal = (431, f"More than {limits.max_header_count} header fields.", "too_many_headers")
            else:
                self._refusal = (431, f"Request headers are larger than {limits.max_header_bytes} bytes.",
                                 "headers_too_large")
            raise _Refused
        _uvicorn_on_header(self, name, value)

    def on_headers_complete(self) -> None:
        assert self._listener is not None
        self._in_headers = False
        self._cancel_timer()
        cycle = self.cycle
        # uvicorn builds the request's cycle here (`httptools_impl.RequestResponseCycle`, a name
        # looked up in its module at the call): a LaneCycle, uvicorn's cycle with a leaner send
        # (`gateway.lane_cycle`), for this call only. Built by uvicorn's own constructor: a cycle
        # whose class is changed afterwards loses its instances' shared-key dict (every attribute
        # read slower: callgrind, ~10 k instructions a request more, not less).
        _httptools_impl.RequestResponseCycle = LaneCycle
        try:
            super().on_headers_complete()
        finally:
            _httptools_impl.RequestResponseCycle = RequestResponseCycle
        if self.cycle is not cycle and self.cycle is not None:  # this request's: head and first events in one write
            hold = HeadHold(self.transport)
            self.cycle.transport = hold  # type: ignore[assignment]
            self.scope[HEAD_HOLD] = hold  # type: ignore[literal-required]
        # The body deadline: armed by `data_received` if the body is still due after this read.
        self._body_due = True

    def on_message_complete(self) -> None:
        self._body_due = False
        self._cancel_timer()
        super().on_message_complete()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        # uvicorn starts every request's task here (at its headers, or a pipelined one when the
        # one before it is answered). A POST to a /v1 lane route runs the lane itself
        # (`gateway.lane_cycle`), not the app's ASGI chain. `app is self.app`: not uvicorn's own
        # 503 for its concurrency limit.
        lane = self._lane
        if lane is not None and app is self.app:
            entry = lane.entry(cycle.scope)
            if entry is not None:
                app = entry
        self._answering = cycle  # HTTP/1.1 answers in order: the previous one's response is complete
        super()._start_asgi_task(cycle, app)

    def _disconnect(self, cycle: RequestResponseCycle | None) -> None:
        """Tell the request being answered that its client is gone, as uvicorn tells only the newest
        cycle: with a request pipelined behind it, this one's `receive` never heard `http.disconnect`
        (its disconnect watch never fired) and its stream ran on the engine to its end, relayed into
        a closed socket."""
        if cycle is not None and cycle is not self.cycle and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()

    # --- deadlines and refusals ---

    def _begin_headers(self, bytes_so_far: int, arm: bool = True) -> None:
        assert self._listener is not None
        self._in_headers = True
        self._header_bytes = bytes_so_far
        self._header_room = self._listener.limits.max_header_bytes
        self._headers_left = self._listener.limits.max_header_count
        self._cancel_timer()
        if arm:
            self._arm(self._listener.limits.header_timeout_s, self._header_timeout)

    def _count_header_bytes(self, n: int) -> None:
        assert self._listener is not None
        self._header_room -= n
        if self._header_room < 0:
            self._refusal = (431, f"Request headers are larger than {self._listener.limits.max_header_bytes} bytes.",
                             "headers_too_large")
            raise _Refused

    def _arm(self, delay_s: float, callback: Any) -> None:
        self._timer = self.loop.call_later(delay_s, callback)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _header_timeout(self) -> None:
        assert self._listener is not None
        self._timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined request waits behind a response still being sent: not the client's delay.
            self._arm(self._listener.limits.header_timeout_s, self._header_timeout)
            return
        if self._header_bytes:
            self._refuse(408, f"Request headers not received within {self._listener.limits.header_timeout_s:g} s.",
                         "header_timeout")
        else:  # nothing sent at all: nobody to answer
            self._listener.closed["header_timeout"] += 1
            self.transport.close()

    def _body_timeout(self) -> None:
        assert self._listener is not None
        self._timer = None
        if self.flow.read_paused:
            # We stopped reading (the app has not taken the body yet, or a pipelined request
            # waits its turn): the client is not the one late.
            self._arm(self._listener.limits.body_timeout_s, self._body_timeout)
            return
        self._listener.closed["body_timeout"] += 1
        cycle = self.cycle
        if cycle is not None and not cycle.response_started and not cycle.disconnected:
            self.transport.write(_error_response(
                408, f"Request body not received within {self._listener.limits.body_timeout_s:g} s.", "body_timeout"))
        if cycle is not None:
            # The app's receive() returns http.disconnect; anything it sends now is dropped.
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    def _send_timeout(self) -> None:
        """The client took no bytes of a response for `send_timeout_s` (`BoundedFlow`): gone. The
        cycle is marked disconnected now (its `send` drops what follows; the request's disconnect
        watch hears `http.disconnect` and aborts the engine's stream) and the connection aborted:
        a plain close would wait for the unread buffer to drain first, i.e. for ever."""
        assert self._listener is not None
        self._listener.closed["send_timeout"] += 1
        cycle = self.cycle
        if cycle is not None:
            cycle.disconnected = True
            cycle.message_event.set()
        self._disconnect(self._answering)  # the one whose send timed out, when a request is pipelined behind it
        self.transport.abort()

    def _refuse(self, status: int, message: str, code: str) -> None:
        assert self._listener is not None
        self._cancel_timer()
        self._listener.closed[code] += 1
        if self.cycle is None or self.cycle.response_complete:  # never inside another response
            self.transport.write(_error_response(status, message, code))
        self.transport.close()


_uvicorn_on_header = HttpToolsProtocol.on_header  # what `super().on_header` is in GuardedHttpToolsProtocol


def protocol_class(listeners: Sequence[Listener]) -> type[GuardedHttpToolsProtocol]:
    """The protocol for `uvicorn.Config(http=...)`, serving these listeners' sockets."""
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {"listeners": tuple(listeners)})


def build_listeners(gw: GatewaySettings, public: socket.socket, ops: socket.socket | None,
                    nofile: int) -> tuple[list[Listener], str | None]:
    """The public listener (caps fitted under the open-file limit `nofile`) and the ops one."""
    ops_limits = ListenerLimits.ops(gw)
    reserved = FD_RESERVE + (ops_limits.max_connections if ops is not None else 0)
    limits, warning = fit_to_fd_limit(ListenerLimits.public(gw), nofile, reserved)
    listeners = [Listener(public, limits)]
    if ops is not None:
        listeners.append(Listener(ops, ops_limits))
    return listeners, warning


class ListenerCollector(Collector):
    """tokenfleet_client_connections{listener}, tokenfleet_client_connections_closed_total{listener,reason}."""

    def __init__(self, listeners: Sequence[Listener]) -> None:
        self.listeners = listeners

    def collect(self) -> Iterator[Metric]:
        open_ = GaugeMetricFamily("tokenfleet_client_connections", "Client connections open, by listener",
                                  labels=["listener"])
        closed = CounterMetricFamily("tokenfleet_client_connections_closed",
                                     "Client connections the gateway refused or closed, by listener and reason",
                                     labels=["listener", "reason"])
        for lst in self.listeners:
            open_.add_metric([lst.limits.name], lst.open)
            for reason, n in sorted(lst.closed.items()):
                closed.add_metric([lst.limits.name, reason], n)
        yield from (open_, closed)
