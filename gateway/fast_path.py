"""The OpenAI endpoints' lean path: POST /v1/... straight to its handler, past FastAPI's stack.

Every request through FastAPI crosses nine ASGI layers (server errors, FastAPI's telemetry
and body limit, ours, exception middleware, exit stack, router, route wrapper, dependency
solving) before its handler runs: about a tenth of the gateway's CPU per streamed request
(bench/README.md, "Where the time goes"). The /v1 endpoints need none of that — they read
their body themselves and answer errors as `GatewayError` — so `GatewayApp` sends them here:
the overload limit, the body-size limit, the handler, and the app's own exception handlers
(the very functions FastAPI would call, looked up the same way: by the exception's class
and its bases). Everything else — admin, reports, /metrics, /health, /openapi.json, unknown
paths — goes through FastAPI as before; the /v1 routes stay declared there too, for the
OpenAPI document.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

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


class Endpoints:
    """The innermost ASGI app of the fast path: the route's handler, errors as the app answers them."""

    def __init__(self, app: FastAPI, routes: Mapping[str, Endpoint]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            response = await self.routes[scope["path"]](request)
        except Exception as exc:
            response = await self._answer(request, exc)
        try:
            await response(scope, receive, tracked)
        except Exception as exc:
            if started:  # mid-response: nothing left to answer with (as Starlette's ServerErrorMiddleware)
                raise
            await (await self._answer(request, exc))(scope, receive, send)

    async def _answer(self, request: Request, exc: Exception) -> Response:
        handlers = self.app.exception_handlers
        for cls in type(exc).__mro__:
            handler = handlers.get(cls)
            if handler is not None:
                return await handler(request, exc)  # type: ignore[no-any-return, misc]
        raise exc
