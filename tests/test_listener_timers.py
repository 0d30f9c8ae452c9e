"""The listener's header and body deadlines are armed only for a request still arriving.

A request whose head and body come in one read (the usual one) used to arm a header timer at its
first byte (on a kept-alive connection) and a body timer at its headers, both cancelled within the
same read. `GuardedHttpToolsProtocol.data_received` now arms a deadline after the read, only for a
request whose headers or body are still due, its clock starting in that same loop step. Driven here
on the protocol itself with a fake transport (no sockets, no sleeps): which timers are armed, when.
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from fleetcore.fleet_config import GatewaySettings
from gateway.listener import bind_socket, build_listeners, protocol_class


class _Transport:
    def __init__(self, sockname: Any) -> None:
        self.sockname = sockname
        self.writes: list[bytes] = []
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": self.sockname, "peername": ("127.0.0.9", 5555)}.get(name, default)

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def can_write_eof(self) -> bool:
        return False


class _CountingLoop:
    """The running loop, with the listener's deadline timers counted by kind as they are armed."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.armed: list[str] = []

    def call_later(self, delay: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
        name = getattr(callback, "__name__", "")
        if name in ("_header_timeout", "_body_timeout"):
            self.armed.append(name)
        return self._loop.call_later(delay, callback, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loop, name)


async def _app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def _request(body: bytes = b"{}") -> bytes:
    return b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


async def _protocol() -> tuple[Any, _Transport, _CountingLoop]:
    sock = bind_socket("127.0.0.1", 0)
    listeners, _ = build_listeners(GatewaySettings(), sock, None, 4096)
    config = uvicorn.Config(_app, http=protocol_class(listeners), ws="none", lifespan="off", log_level="warning")
    config.load()
    loop = _CountingLoop(asyncio.get_running_loop())
    p = config.http_protocol_class(config, ServerState(), {}, loop)  # type: ignore[call-arg]
    t = _Transport(sock.getsockname())
    p.connection_made(t)
    sock.close()
    return p, t, loop


async def _answered(t: _Transport, n: int) -> None:
    """Until `n` answers were written (the app's task runs on the loop)."""
    async with asyncio.timeout(10):
        while sum(w.count(b"HTTP/1.1 200") for w in t.writes) < n:
            await asyncio.sleep(0)


async def test_a_request_whole_in_one_read_arms_no_deadline() -> None:
    p, t, loop = await _protocol()
    assert loop.armed == ["_header_timeout"]  # the connection's own: it may never send anything
    p.data_received(_request())
    assert p._timer is None
    await _answered(t, 1)
    p.data_received(_request())  # the next one on the kept-alive connection
    await _answered(t, 2)
    assert loop.armed == ["_header_timeout"]  # none more
    p.connection_lost(None)


async def test_a_head_in_two_reads_gets_its_header_deadline_after_the_first() -> None:
    p, t, loop = await _protocol()
    p.data_received(_request())
    await _answered(t, 1)
    raw = _request()
    p.data_received(raw[:10])
    assert loop.armed == ["_header_timeout", "_header_timeout"] and p._timer is not None
    p.data_received(raw[10:])
    assert p._timer is None and loop.armed[-1] == "_header_timeout"
    await _answered(t, 2)
    p.connection_lost(None)


async def test_a_body_still_due_gets_its_body_deadline_and_loses_it_when_complete() -> None:
    p, t, loop = await _protocol()
    raw = _request(b'{"a": 1}')
    p.data_received(raw[:-3])  # the whole head, part of the body
    assert loop.armed == ["_header_timeout", "_body_timeout"] and p._timer is not None
    p.data_received(raw[-3:])
    assert p._timer is None
    await _answered(t, 1)
    p.connection_lost(None)
