"""The relayed SSE response, written with direct ASGI sends (gateway.relay.RelayStreamingResponse).

It replaced Starlette's StreamingResponse on the hot path, so what that class did for us is
checked here on a fake ASGI channel: the head (status, media type with charset, no-cache,
no proxy buffering, the relay's own headers and one added after construction, as a model
fallback adds it), one body message per chunk the relay hands on, the chunk that carries
[DONE] closing the body itself (no extra empty message), an empty closing message when the
stream ends otherwise (an error event, a replaced iterator), and the clean-up — upstream
closed, `on_done` called once — however the stream ends, a client that leaves mid-stream
included (its `http.disconnect` ends the write; nothing more is sent).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from gateway.relay import RelayStreamingResponse

WAIT_S = 5.0


class FakeStream:
    """What the response uses of a RelayStream: `iter_bytes`, `d.stats.done`, `close`."""

    def __init__(self, chunks: list[bytes], done_after: int | None, hold: asyncio.Event | None = None) -> None:
        self.chunks = chunks
        self.done_after = done_after  # index of the chunk that carries [DONE]; None: the stream never finishes
        self.hold = hold  # the iterator waits on it after the first chunk (an engine that stalls)
        self.d = SimpleNamespace(stats=SimpleNamespace(done=False))
        self.closed = 0
        self.exhausted = False

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        for i, chunk in enumerate(self.chunks):
            if i == self.done_after:
                self.d.stats.done = True
            yield chunk
            if self.hold is not None:
                await self.hold.wait()
        self.exhausted = True

    async def close(self) -> None:
        self.closed += 1


class Channel:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.leave = asyncio.Event()
        self.first_chunk_out = asyncio.Event()  # the head and one body message have been sent

    async def receive(self) -> dict[str, Any]:
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        if len(self.sent) >= 2:
            self.first_chunk_out.set()


def _response(stream: FakeStream) -> tuple[RelayStreamingResponse, list[int]]:
    resp = RelayStreamingResponse(stream, {"x-request-id": "req-1", "x-tokenfleet-instance": "e0"})  # type: ignore[arg-type]
    done: list[int] = []
    resp.on_done = lambda: done.append(1)
    return resp, done


async def test_head_and_one_body_message_per_chunk_the_done_chunk_closing_the_body() -> None:
    stream = FakeStream([b"data: a\n\n", b"data: b\n\n", b"data: [DONE]\n\n"], done_after=2)
    resp, done = _response(stream)
    resp.headers["x-tokenfleet-fallback"] = "m2"  # added after construction, as gateway.aliases does
    ch = Channel()
    await asyncio.wait_for(resp({"type": "http"}, ch.receive, ch.send), WAIT_S)
    start, *body = ch.sent
    assert start["type"] == "http.response.start" and start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"content-type"] == b"text/event-stream; charset=utf-8"
    assert headers[b"cache-control"] == b"no-cache" and headers[b"x-accel-buffering"] == b"no"
    assert headers[b"x-request-id"] == b"req-1" and headers[b"x-tokenfleet-instance"] == b"e0"
    assert headers[b"x-tokenfleet-fallback"] == b"m2"
    assert all(isinstance(k, bytes) and k == k.lower() for k, _ in start["headers"])
    assert [(m["body"], m["more_body"]) for m in body] == [
        (b"data: a\n\n", True), (b"data: b\n\n", True), (b"data: [DONE]\n\n", False)]
    assert stream.exhausted  # run to its end: the relay stream's own clean-up ran
    assert stream.closed == 1 and done == [1] and resp.started


async def test_a_stream_that_ends_without_done_gets_an_empty_closing_message() -> None:
    # the relay's error event at an upstream failure is the last chunk, without stats.done
    stream = FakeStream([b"data: a\n\n", b"data: {\"error\": {}}\n\ndata: [DONE]\n\n"], done_after=None)
    resp, done = _response(stream)
    ch = Channel()
    await asyncio.wait_for(resp({"type": "http"}, ch.receive, ch.send), WAIT_S)
    assert [(m.get("body"), m.get("more_body")) for m in ch.sent[1:]] == [
        (b"data: a\n\n", True), (b"data: {\"error\": {}}\n\ndata: [DONE]\n\n", True), (b"", False)]
    assert stream.closed == 1 and done == [1]


async def test_a_replaced_iterator_is_streamed_to_its_end_then_closed() -> None:
    # the Responses API replaces body_iterator: it may yield after the chat stream's [DONE]
    stream = FakeStream([b"data: [DONE]\n\n"], done_after=0)
    resp, done = _response(stream)

    async def translated() -> AsyncIterator[bytes]:
        async for chunk in stream.iter_bytes():
            yield b"event: x\n" + chunk
        yield b"event: response.completed\n\n"

    resp.body_iterator = translated()
    ch = Channel()
    await asyncio.wait_for(resp({"type": "http"}, ch.receive, ch.send), WAIT_S)
    assert [(m["body"], m["more_body"]) for m in ch.sent[1:]] == [
        (b"event: x\ndata: [DONE]\n\n", True), (b"event: response.completed\n\n", True), (b"", False)]
    assert done == [1]


async def test_a_client_that_leaves_mid_stream_ends_it_and_upstream_is_closed() -> None:
    hold = asyncio.Event()  # never set: the engine sends nothing after the first chunk
    stream = FakeStream([b"data: a\n\n", b"data: b\n\n"], done_after=None, hold=hold)
    resp, done = _response(stream)
    ch = Channel()
    task = asyncio.create_task(resp({"type": "http"}, ch.receive, ch.send))
    await asyncio.wait_for(ch.first_chunk_out.wait(), WAIT_S)
    ch.leave.set()
    await asyncio.wait_for(task, WAIT_S)  # the watch notices the disconnect (after LAZY_WATCH_S)
    assert [m.get("body") for m in ch.sent[1:]] == [b"data: a\n\n"]  # nothing sent after it left
    assert stream.closed == 1 and done == [1]
