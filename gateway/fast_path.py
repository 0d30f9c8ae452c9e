"""The OpenAI endpoints' lean path: POST /v1/... straight to its handler, past FastAPI's stack.

Every request through FastAPI crosses nine ASGI layers (server errors, FastAPI's telemetry
and body limit, ours, exception middleware, exit stack, router, route wrapper, dependency
solving) before its handler runs: about a tenth of the gateway's CPU per streamed request
(bench/README.md, "Where the time goes"). The /v1 endpoints need none of that — they read
their body themselves and answer errors as `GatewayError` — so `GatewayApp` sends them to
`FastLane`, one ASGI callable that does, in one coroutine, what the overload limit, the
body-size limit and the route would: count the request on the overload bounds (refusing it
with 503 when over one), read the body within its limit (413), call the handler and answer
its errors with the app's own exception handlers (the very functions FastAPI would call,
looked up the same way: by the exception's class and its bases). No `send` is wrapped: the
request leaves the overload backlog's `pending` count when its handler has returned the
response (the relay returns a stream only once its first event is in), which is when that
response starts. Everything else — admin, reports, /metrics, /health, /openapi.json,
unknown paths — goes through FastAPI as before; the /v1 routes stay declared there too, for
the OpenAPI document. Under the gateway's listener (`tokenfleet up`) the protocol starts
`FastLane` itself, past uvicorn's proxy-headers middleware and `GatewayApp.__call__`
(`gateway.lane_cycle`); `GatewayApp` routes the same way under any other ASGI server.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.body_limit import read_limited_body
from gateway.overload import Backlog, refuse

log = logging.getLogger("tokenfleet.gateway")

Endpoint = Callable[[Request], Awaitable[Response]]


class GatewayApp(FastAPI):
    """FastAPI, except that POST requests to a path in `fast_routes` take `fast_stack`."""

    fast_routes: dict[str, Endpoint]
    fast_stack: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and self.fast_stack is not None \
                and scope["path"] in self.fast_routes:
            scope["app"] = self
            await self.fast_stack(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


class LookupHeaders(Headers):
    """Starlette's request headers, looked up in a dict built with them.

    Starlette's `Headers` scans the raw list for every lookup and, through `Mapping.get`, raises
    and catches a KeyError for every header that is absent; a /v1 request asks for about seven
    (request id, key, task type, region, class, trace context), most of them absent. The answers
    are the same: the first value of a name, names compared as the raw (ASGI: lower-case) bytes
    against the asked name in lower case."""

    def __init__(self, *, scope: Scope) -> None:  # as BufferedRequest makes it: from the scope
        super().__init__(scope=scope)
        # Built at once: every /v1 request looks headers up (its id, its key, ...)
        self._by_name = _first_values(self._list)

    def __getitem__(self, key: str) -> str:
        try:
            return self._by_name[key.lower()]
        except KeyError:
            raise KeyError(key) from None

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        return self._by_name.get(key.lower(), default)

    def __contains__(self, key: Any) -> bool:
        return key.lower() in self._by_name


def _first_values(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """{name: its first value}, decoded as latin-1, from a list of raw header pairs. Read
    backwards, so that a name's first value is the one left. Built in C, without a Python step
    per header: names and values each joined by a newline, decoded once and split again; the
    parser lets no newline into a name or a value, and a list with one anyway (not from the
    parser) comes apart into more parts than it has pairs and is read pair by pair instead."""
    if not raw:
        return {}
    names, values = zip(*reversed(raw))
    keys = b"\n".join(names).decode("latin-1").split("\n")
    vals = b"\n".join(values).decode("latin-1").split("\n")
    if len(keys) == len(vals) == len(raw):
        return dict(zip(keys, vals))
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in reversed(raw)}


class BufferedRequest(Request):
    """A Starlette request whose body has been read already (within its limit): `body()` is it,
    and `receive` is the client's channel from here on (what the disconnect watch reads)."""

    def __init__(self, scope: Scope, receive: Receive, body: bytes) -> None:
        super().__init__(scope, receive)
        self._body = body  # Starlette's own cache of the read body: body(), json() and stream() use it
        self._headers = LookupHeaders(scope=scope)  # what `request.headers` returns (Starlette's cache)


class FastLane:
    """The whole ASGI way of a POST /v1 request (module docstring)."""

    def __init__(self, app: FastAPI, routes: Mapping[str, Endpoint], backlog: Backlog,
                 on_refused: Callable[[str], None] | None, max_body_bytes: int) -> None:
        self.app = app
        self.routes = routes
        self.backlog = backlog  # the overload bounds, shared with the FastAPI stack's `OverloadLimit`
        self.on_refused = on_refused  # (which bound) -> None: metrics
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        b = self.backlog
        refused = b.refusal()
        if refused is not None:
            await refuse(b, self.on_refused, scope, receive, send, *refused)
            return
        b.inflight += 1
        b.pending += 1
        pending = True
        try:
            body = await read_limited_body(scope, receive, send, self.max_body_bytes)
            if body is None:
                return  # answered (413), or the client left while sending
            request = BufferedRequest(scope, receive, body)
            try:
                response = await self.routes[scope["path"]](request)
            except Exception as exc:
                response = await self._answer(request, exc)
            b.pending -= 1
            pending = False
            try:
                await response(scope, receive, send)
            except Exception as exc:
                if getattr(response, "started", True):
                    # mid-response (or a response that cannot say): nothing left to answer with,
                    # as Starlette's ServerErrorMiddleware
                    raise
                await (await self._answer(request, exc))(scope, receive, send)
        finally:
            b.inflight -= 1
            if pending:
                b.pending -= 1

    async def _answer(self, request: Request, exc: Exception) -> Response:
        handlers = self.app.exception_handlers
        for cls in type(exc).__mro__:
            handler = handlers.get(cls)
            if handler is not None:
                return await handler(request, exc)  # type: ignore[no-any-return, misc]
        raise exc
