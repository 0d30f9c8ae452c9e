"""The /v1 lean lane served straight from the listener's protocol: no ASGI middleware hop, a leaner `send`.

A POST /v1 request on the public listener went, per request: uvicorn's `RequestResponseCycle.run_asgi`
-> `ProxyHeadersMiddleware` (a scan of the headers for `x-forwarded-*`) -> `GatewayApp.__call__`
(the route test) -> `FastLane`; and every response message through uvicorn's `send`, which checks
each header of the head with two regexes and builds the head header by header. The listener
(`GuardedHttpToolsProtocol._start_asgi_task`) now makes the route test itself once the request line
and headers are in (`Lane.entry`) and starts `FastLane` directly in uvicorn's own task, on a cycle
of this class: uvicorn's `RequestResponseCycle` (built by uvicorn, its fields and `receive` as they
are: keep-alive, disconnects, flow control, pipelining, `Expect: 100-continue`, the listener's
deadlines all read and write those) with

- `send`: uvicorn's semantics message for message (errors for messages out of order, the default
  headers first, names lower-cased, `content-length` / `transfer-encoding: chunked` /
  `connection: close` read from the head, chunked framing otherwise, `connection: close` added
  when the connection will not be kept, completion and keep-alive at the last body message, the
  write paused while the transport is), with the same bytes: its header checks are one search per
  head over the names joined by `-` and one over the values joined by a tab (both allowed where
  they are put, so a forbidden byte is in the joined text exactly when it is in one of the parts),
  not two searches per header (a head that fails them is checked header by header, as uvicorn
  does, for the same error), and a head with no framing header of the app's (`content-length`,
  `transfer-encoding`, `connection`: a relayed stream's) is joined without a Python step per header;
- `hold` / `release` (`gateway.head_hold`'s, for the relay's stream head): the head is kept for
  the write of the first events, here in the cycle itself, without a transport wrapper per
  request.

Requests with an `x-forwarded-*` header (behind HAProxy's `option forwardfor`) still pass through
`ProxyHeadersMiddleware` first (a copy of the one uvicorn put in front of the app, with the same
trusted hosts), so `scope["client"]` and `scope["scheme"]` are what they were. A chain of apps
with any other wrapper than that one (uvicorn's message logger at trace level, an ASGI2 adapter)
gets no lane: its behaviour would be skipped (`find_lane`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Scope
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    RequestResponseCycle,
)
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from gateway.fast_path import GatewayApp

FORWARDED_PREFIX = b"x-forwarded-"


@dataclass(frozen=True, slots=True)
class Lane:
    """Where a POST to one of `routes` goes, past the ASGI chain: `direct`, or `proxied` (the same
    lane behind uvicorn's proxy-headers middleware) when the request has `x-forwarded-*` headers."""

    app: GatewayApp
    routes: frozenset[str]
    direct: ASGIApp
    proxied: ASGIApp | None  # None: no ProxyHeadersMiddleware in front of the app

    def entry(self, scope: Scope) -> ASGIApp | None:
        """The app to run for this request instead of the whole chain, or None (not the lane's)."""
        if scope["method"] != "POST" or scope["path"] not in self.routes:
            return None
        scope["app"] = self.app  # what GatewayApp.__call__ sets on its way to the lane
        if self.proxied is not None and scope["headers"]:
            # ProxyHeadersMiddleware acts only on `x-forwarded-*` headers (names are lower case in a
            # scope): looked for in the names joined by a newline (which no name holds), in C. A
            # match inside a name sends the request the proxied way: slower, never wrong.
            if b"\n".join(next(zip(*scope["headers"]))).find(FORWARDED_PREFIX) >= 0:
                return self.proxied
        return self.direct


def find_lane(app: ASGIApp) -> Lane | None:
    """The lane of `app` as uvicorn loaded it: a GatewayApp with a fast stack, behind nothing or
    behind uvicorn's ProxyHeadersMiddleware only; otherwise None (every request takes the chain)."""
    proxy: ProxyHeadersMiddleware | None = None
    if type(app) is ProxyHeadersMiddleware:
        proxy, app = app, app.app
    if not isinstance(app, GatewayApp) or app.fast_stack is None:
        return None
    direct = app.fast_stack
    proxied = None
    if proxy is not None:
        proxied = copy.copy(proxy)  # the same trusted hosts, the lane behind it
        proxied.app = direct
    return Lane(app, frozenset(app.fast_routes), direct, proxied)


class LaneCycle(RequestResponseCycle):
    """uvicorn's cycle with a leaner `send` and the head hold (module docstring). The listener
    turns a cycle uvicorn built into one (`__class__`, no fields of its own but the two below, which
    start from these class defaults), so that uvicorn's constructor stays the only one."""

    _holding: bool = False  # the next write is kept back (the head), to go with the one after
    _held: bytes | None = None

    # --- the head hold (gateway.head_hold.HeadHold's interface) ---

    def hold(self) -> None:
        self._holding = True

    def release(self) -> None:
        self._holding = False
        held = self._held
        if held is not None:
            self._held = None
            self.transport.write(held)

    def _write(self, data: bytes) -> None:
        held = self._held
        if held is not None:  # the write after the held one: both in one
            data = held + data
            self._held = None
            self._holding = False
        elif self._holding:
            self._held = data
            return
        self.transport.write(data)

    # --- ASGI send ---

    async def send(self, message: Any) -> None:  # uvicorn's send, message for message (module docstring)
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        if not self.response_started:
            if message["type"] != "http.response.start":
                raise RuntimeError(f"Expected ASGI message 'http.response.start', but got '{message['type']}'.")
            self._head(message["status"], message.get("headers", ()))
        elif not self.response_complete:
            if message["type"] != "http.response.body":
                raise RuntimeError(f"Expected ASGI message 'http.response.body', but got '{message['type']}'.")
            self._body(message.get("body", b""), message.get("more_body", False))
        else:
            raise RuntimeError(f"Unexpected ASGI message '{message['type']}' sent, after response already completed.")

    def _head(self, status: int, message_headers: Any) -> None:
        self.response_started = True
        self.waiting_for_100_continue = False
        headers = [*self.default_headers, *message_headers]
        if self.access_log:
            self.access_logger.info('%s - "%s %s HTTP/%s" %d', get_client_addr(self.scope), self.scope["method"],
                                    get_path_with_query_string(self.scope), self.scope["http_version"], status)
        if headers:
            names, values = zip(*headers)
            # One search over all names and one over all values: `-` is a token character and a
            # tab an allowed value byte, so either search finds a forbidden byte iff some part has one.
            if not (HEADER_RE.search(b"-".join(names)) or HEADER_VALUE_RE.search(b"\t".join(values))):
                # Clean names hold no `:`, so they come apart again where they were joined by one.
                lowered = b":".join(names).lower().split(b":")
                if _FRAMING.isdisjoint(lowered):
                    # The usual head (a relayed stream's): no header that frames the body or the
                    # connection, so it is uvicorn's `name: value` lines, built without a Python
                    # step per header.
                    lines = b"\r\n".join(map(b": ".join, zip(lowered, values)))
                    self._write(b"".join((STATUS_LINE[status], lines, b"\r\n", *self._framing(status, False),
                                          b"\r\n")))
                    return
        self._head_by_header(status, headers)

    def _head_by_header(self, status: int, headers: list[Any]) -> None:
        """uvicorn's head, header by header: the checks in turn (so that the same header fails
        first, with the same error and the same state left) and the framing headers read."""
        content = [STATUS_LINE[status]]
        has_connection_close = False
        for name, value in headers:
            if HEADER_RE.search(name):
                raise RuntimeError("Invalid HTTP header name.")
            if HEADER_VALUE_RE.search(value):
                raise RuntimeError("Invalid HTTP header value.")
            name = name.lower()
            if name == b"content-length" and self.chunked_encoding is None:
                self.expected_content_length = int(value.decode())
                self.chunked_encoding = False
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self.expected_content_length = 0
                self.chunked_encoding = True
            elif name == b"connection":
                if b"close" in [token.lower().strip() for token in value.split(b",")]:
                    self.keep_alive = False
                    has_connection_close = True
            content += (name, b": ", value, b"\r\n")
        content += self._framing(status, has_connection_close)
        content.append(b"\r\n")
        self._write(b"".join(content))

    def _framing(self, status: int, has_connection_close: bool) -> tuple[bytes, ...]:
        """The lines uvicorn adds after the app's headers: `connection: close` for a connection
        it will not keep, `transfer-encoding: chunked` for a body of no declared length."""
        close = not self.keep_alive and not has_connection_close
        if self.chunked_encoding is None and self.scope["method"] != "HEAD" and status not in (204, 304):
            self.chunked_encoding = True
            return (b"connection: close\r\ntransfer-encoding: chunked\r\n",) if close else \
                (b"transfer-encoding: chunked\r\n",)
        return (b"connection: close\r\n",) if close else ()

    def _body(self, body: bytes, more_body: bool) -> None:
        if self.scope["method"] == "HEAD":
            self.expected_content_length = 0
        elif self.chunked_encoding:
            if body:
                data = b"%x\r\n%b\r\n" % (len(body), body) if more_body else b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)
            else:
                data = b"" if more_body else b"0\r\n\r\n"
            self._write(data)
        else:
            if len(body) > self.expected_content_length:
                raise RuntimeError("Response content longer than Content-Length")
            self.expected_content_length -= len(body)
            self._write(body)
        if not more_body:
            if self.expected_content_length != 0:
                raise RuntimeError("Response content shorter than Content-Length")
            self.response_complete = True
            self.message_event.set()
            if not self.keep_alive:
                self.release()
                self.transport.close()
            self.on_response()


_FRAMING = frozenset((b"content-length", b"transfer-encoding", b"connection"))
