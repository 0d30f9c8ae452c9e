"""The /v1 lean lane served straight from the listener's protocol, and a leaner `send` for every request.

A POST /v1 request on the public listener went, per request: uvicorn's `RequestResponseCycle.run_asgi`
-> `ProxyHeadersMiddleware` (a scan of the headers for `x-forwarded-*`) -> `GatewayApp.__call__`
(the route test) -> `FastLane`. The listener (`GuardedHttpToolsProtocol._start_asgi_task`) now makes
the route test itself once the request line and headers are in (`Lane.entry`) and starts `FastLane`
directly in uvicorn's own task. Requests with an `x-forwarded-*` header (behind HAProxy's `option
forwardfor`) still pass through `ProxyHeadersMiddleware` first (a copy of the one uvicorn put in
front of the app, with the same trusted hosts), so `scope["client"]` and `scope["scheme"]` are what
they were. A chain of apps with any other wrapper than that one (uvicorn's message logger at trace
level, an ASGI2 adapter) gets no lane: its behaviour would be skipped (`find_lane`).

Every request on the listener runs on a `LaneCycle`: uvicorn's `RequestResponseCycle`, built by
uvicorn's own code (its fields and `receive` as they are: keep-alive, disconnects, flow control,
pipelining, `Expect: 100-continue`, the listener's deadlines all read and write those), with a
`send` of uvicorn's semantics message for message (errors for messages out of order, the default
headers first, names lower-cased, `content-length` / `transfer-encoding: chunked` / `connection:
close` read from the head, chunked framing otherwise, `connection: close` added when the connection
will not be kept, completion and keep-alive at the last body message, the write paused while the
transport is) and the same bytes, at less cost where uvicorn's was spent (callgrind, a head of 11
headers and a body: ~77 k instructions, ~20 k of it its two regex searches per header, which cost
per byte): the header checks are one pass over all names and one over all values, each a deletion
of the allowed bytes (a table lookup per byte, in C), and a head with no framing header of the
app's (a relayed stream's) is joined without a Python step per header. A head that fails the
checks is checked header by header, as uvicorn does, for the same error and state.
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
    """uvicorn's cycle with a leaner `send` (module docstring): no fields of its own, built by
    uvicorn's own code (`GuardedHttpToolsProtocol.on_headers_complete`)."""

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
            # All names at once and all values at once, joined by a byte allowed where it is put
            # (`-` in a name, a tab in a value), so the joined text holds a forbidden byte iff some
            # part does; tested by deleting every allowed byte (a table lookup a byte, in C) rather
            # than by uvicorn's regex (a character-class match a byte: ~12 k instructions a head).
            if not (b"-".join(names).translate(None, _NAME_OK) or b"\t".join(values).translate(None, _VALUE_OK)):
                # Clean names hold no `:`, so they come apart again where they were joined by one.
                lowered = b":".join(names).lower().split(b":")
                if _FRAMING.isdisjoint(lowered):
                    # The usual head (a relayed stream's): no header that frames the body or the
                    # connection, so it is uvicorn's `name: value` lines, built without a Python
                    # step per header.
                    lines = b"\r\n".join(map(b": ".join, zip(lowered, values)))
                    self.transport.write(b"".join((STATUS_LINE[status], lines, b"\r\n", *self._framing(status, False),
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
        self.transport.write(b"".join(content))

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
            self.transport.write(data)
        else:
            if len(body) > self.expected_content_length:
                raise RuntimeError("Response content longer than Content-Length")
            self.expected_content_length -= len(body)
            self.transport.write(body)
        if not more_body:
            if self.expected_content_length != 0:
                raise RuntimeError("Response content shorter than Content-Length")
            self.response_complete = True
            self.message_event.set()
            if not self.keep_alive:
                self.transport.close()
            self.on_response()


_FRAMING = frozenset((b"content-length", b"transfer-encoding", b"connection"))
# The bytes uvicorn's header checks allow, from its own patterns (whatever its version says):
# `HEADER_RE` / `HEADER_VALUE_RE` match one forbidden byte.
_NAME_OK = bytes(b for b in range(256) if not HEADER_RE.search(bytes((b,))))
_VALUE_OK = bytes(b for b in range(256) if not HEADER_VALUE_RE.search(bytes((b,))))
