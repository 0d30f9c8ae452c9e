"""A client that stops reading a response is cut off after `send_timeout_s` (gateway.listener's
`BoundedFlow`): its connection closed, its stream aborted on the engine, the close counted. uvicorn
alone waits on the socket's drain for ever, holding the request and the engine's KV behind it.

The real listener on loopback over a stub engine that streams as fast as it is read; the client's
receive buffer is made small so that the gateway's send buffer fills within a few hundred chunks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from typing import Any

import pytest

from fleetcore.fleet_config import GatewaySettings
from gateway.app import create_app
from gateway.listener import Listener

SEND_TIMEOUT_S = 1.0
SLACK_S = 10.0  # a loaded 2-core CI machine
CHUNKS = 200_000  # far more than the buffers on the way hold (~150 bytes each)


@pytest.fixture
async def gateway(stub_upstream: Any, fake_adapter: Any, instance_factory: Any, config_factory: Any,
                  gateway_server: Any) -> tuple[int, Any, Listener]:
    """(port, stub engine, the public listener) of one gateway served by the real listener."""
    stub = await stub_upstream(chunks=CHUNKS, delay_s=0.0)
    instance = instance_factory("i0", stub.url, max_model_len=1_000_000)
    app = create_app(config_factory(max_model_len=1_000_000), [fake_adapter([instance])], poll_interval_s=60)
    listeners: list[Listener] = []
    url = await gateway_server(app, listener=GatewaySettings(send_timeout_s=SEND_TIMEOUT_S), listeners=listeners)
    return int(url.rsplit(":", 1)[1]), stub, listeners[0]


def _request() -> bytes:
    body = json.dumps({"model": "m1", "prompt": "hi", "max_tokens": CHUNKS, "stream": True}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


async def _connect(port: int, rcvbuf: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: the window it advertises
    s.setblocking(False)
    await asyncio.get_running_loop().sock_connect(s, ("127.0.0.1", port))
    await asyncio.get_running_loop().sock_sendall(s, _request())
    return s


async def test_a_client_that_stops_reading_is_cut_off_and_its_stream_aborted(
        gateway: tuple[int, Any, Listener]) -> None:
    port, stub, listener = gateway
    s = await _connect(port, 4096)
    try:
        t0 = time.monotonic()
        # never read: the engine's stream is aborted once the gateway gives the client up
        await asyncio.wait_for(stub.aborted.wait(), SEND_TIMEOUT_S + SLACK_S)
        assert time.monotonic() - t0 >= SEND_TIMEOUT_S * 0.9
        assert listener.closed["send_timeout"] == 1
        assert stub.completed == 0
        # and the connection is gone: what was buffered, then the end (a reset: it was aborted)
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(SLACK_S):
            with contextlib.suppress(ConnectionResetError):
                while await loop.sock_recv(s, 1 << 16):
                    pass
        assert listener.open == 0
    finally:
        s.close()


async def test_a_slow_reader_that_keeps_reading_is_not_cut_off(gateway: tuple[int, Any, Listener]) -> None:
    port, stub, listener = gateway
    stub.chunks = 15_000  # ~2 MB, which the client takes ~32 kB at a time, pausing between reads
    s = await _connect(port, 16384)
    loop = asyncio.get_running_loop()
    got, t0 = b"", time.monotonic()
    try:
        async with asyncio.timeout(60):
            while b"data: [DONE]" not in got[-64:]:
                await asyncio.sleep(0.05)  # far inside the timeout: the gateway's buffer fills meanwhile
                data = await loop.sock_recv(s, 1 << 16)
                assert data, "the gateway closed a client that was reading"
                got += data
    finally:
        s.close()
    # the whole answer took several timeouts: no bound on a response's length, only on a stall
    assert time.monotonic() - t0 > 2 * SEND_TIMEOUT_S
    assert stub.completed == 1 and not stub.aborts
    assert listener.closed["send_timeout"] == 0
