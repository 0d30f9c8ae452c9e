"""A client that pipelines a second request behind a stream and then goes away gets the stream
aborted on its engine, as any client that leaves (and as one that stops reading, `send_timeout_s`).

uvicorn builds the pipelined request's cycle as its headers arrive and marks only that newest cycle
when the connection is lost (or, in the listener's send timeout, cut off): the request still being
answered was never told, so its stream ran on the engine to its end, relayed into a closed socket,
holding the engine's KV cache all the while. Two requests in one write, then a close, and the
client's cost is nothing; the engine's is a whole generation. The real listener on loopback over a
stub engine that streams slowly."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import pytest

from fleetcore.fleet_config import GatewaySettings
from gateway.listener import Listener

SEND_TIMEOUT_S = 1.0
CHUNKS = 400  # x 0.05 s: a 20 s stream, far longer than the test waits for its abort
SLACK_S = 8.0  # a loaded 2-core CI machine


@pytest.fixture
async def gateway(stub_upstream: Any, stub_gateway: Any) -> tuple[int, Any, Listener]:
    """(port, stub engine, the public listener) of one gateway served by the real listener."""
    stub = await stub_upstream(chunks=CHUNKS, delay_s=0.05)
    listeners: list[Listener] = []
    url, _ = await stub_gateway(stub, listener=GatewaySettings(send_timeout_s=SEND_TIMEOUT_S), listeners=listeners)
    return int(url.rsplit(":", 1)[1]), stub, listeners[0]


def _request(stream: bool) -> bytes:
    body = json.dumps({"model": "m1", "prompt": "hi", "max_tokens": CHUNKS, "stream": stream}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


async def _pipelined(port: int, rcvbuf: int | None = None) -> socket.socket:
    """A connection with a stream and a second request behind it, sent in one write; returns once
    the stream's first bytes are in."""
    loop = asyncio.get_running_loop()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.setblocking(False)
    await loop.sock_connect(s, ("127.0.0.1", port))
    await loop.sock_sendall(s, _request(True) + _request(False))
    async with asyncio.timeout(SLACK_S):
        assert await loop.sock_recv(s, 1024)  # the stream has begun
    return s


async def test_a_client_that_leaves_after_pipelining_gets_its_stream_aborted(
        gateway: tuple[int, Any, Listener]) -> None:
    port, stub, listener = gateway
    s = await _pipelined(port)
    s.close()  # gone, with its stream running and a request queued behind it
    await asyncio.wait_for(stub.aborted.wait(), SLACK_S)  # was: the stream ran on to its end
    assert stub.completed == 0 and len(stub.requests) == 1  # the queued one never started
    async with asyncio.timeout(SLACK_S):
        while listener.open:
            await asyncio.sleep(0.02)


async def test_a_pipelining_client_that_stops_reading_is_cut_off_and_its_stream_aborted(
        gateway: tuple[int, Any, Listener]) -> None:
    port, stub, listener = gateway
    stub.chunks, stub.delay_s = 200_000, 0.0  # as fast as it is read: the send buffer fills
    s = await _pipelined(port, rcvbuf=4096)
    try:
        await asyncio.wait_for(stub.aborted.wait(), SEND_TIMEOUT_S + SLACK_S)  # was: never
        assert listener.closed["send_timeout"] == 1 and stub.completed == 0
    finally:
        s.close()
