"""The body-size limit: a body over `max_bytes` is answered 413 before anything parses it.

One reader, `read_limited_body`, for both ways in: `BodySizeLimit` (middleware of the FastAPI
stack: admin, reports) and the /v1 lean path (`gateway.fast_path.FastLane`).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import body_too_large


class BodySizeLimit:
    """Pure ASGI middleware: refuse bodies over `max_bytes` with 413 before anything parses them.

    It buffers the (bounded) body and replays it, so the app and the relay's
    disconnect watch see an ordinary receive channel afterwards.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = await read_limited_body(scope, receive, send, self.max_bytes)
        if body is not None:
            await self.app(scope, _replay(body, receive), send)


async def read_limited_body(scope: Scope, receive: Receive, send: Send, max_bytes: int) -> bytes | None:
    """The request's whole body, or None once it has been answered with 413 (declared or sent
    over `max_bytes`) or the client left while still sending (no one to answer)."""
    if _declared_length(scope) > max_bytes:
        await _reject_too_large(scope, receive, send, max_bytes)
        return None
    message = await receive()
    if message["type"] == "http.disconnect":
        return None
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False) and len(body) <= max_bytes:
        return body  # the usual case: the whole body in one message
    chunks = [body]
    size = len(body)
    while True:
        if size > max_bytes:
            await _reject_too_large(scope, receive, send, max_bytes)
            return None
        if not message.get("more_body", False):
            return b"".join(chunks)
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])


def _declared_length(scope: Scope) -> int:
    """The first `content-length` header's value (0: none, or not a number)."""
    headers = scope.get("headers")
    if not headers:
        return 0
    names = next(zip(*headers))  # looked up in C, not a Python step per header
    if b"content-length" not in names:
        return 0
    try:
        return int(headers[names.index(b"content-length")][1])
    except ValueError:
        return 0


async def _reject_too_large(scope: Scope, receive: Receive, send: Send, max_bytes: int) -> None:
    response = body_too_large(max_bytes).response({"connection": "close"})
    await response(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
