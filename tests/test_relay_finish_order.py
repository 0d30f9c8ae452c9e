"""A relayed stream's dispatch finishes after the chunk that carries [DONE] is handed on.

`Dispatch.finish` (metrics, policy feedback, the span) ran before the relay handed the last
chunk to the client; for a short answer read whole in one go, first and last bytes are one
chunk, so all of the bookkeeping sat on the request's TTFT (bench/README.md, "Wakeups and
syscalls per request at 200 req/s"). Now it runs when the consumer asks for the next chunk, or
at `close` when the consumer stopped after the last one, with the relay clock of the moment the
chunk was handed on, and with the same outcome as before: 200, never the client-gone 499.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from gateway.metrics import GatewayMetrics
from gateway.relay import RelayStream


class FakeDispatch:
    """What RelayStream's iteration and close use of a Dispatch once [DONE] is in its first chunk."""

    def __init__(self, clock: list[float], error: str | None = None) -> None:
        self.relay = SimpleNamespace(live=set(), clock=lambda: clock[0], metrics=GatewayMetrics())
        self.stats = SimpleNamespace(done=True, error=error)
        self.iid = "i0"
        self.finished = False
        self.calls: list[dict[str, Any]] = []

    def finish(self, **kw: Any) -> None:  # once, as Dispatch.finish
        if not self.finished:
            self.calls.append(kw)
        self.finished = True


def _stream(clock: list[float], chunk: bytes = b"data: x\n\ndata: [DONE]\n\n", error: str | None = None
            ) -> tuple[RelayStream, FakeDispatch]:
    d = FakeDispatch(clock, error)
    s = RelayStream(d, include_usage=False)  # type: ignore[arg-type]
    s._pending = chunk  # what prefetch read: the whole answer in one read
    return s, d


def test_finish_runs_after_the_last_chunk_is_handed_on_with_the_hand_on_time() -> None:
    async def main() -> None:
        clock = [10.0]
        s, d = _stream(clock)
        it = s.iter_bytes()
        first = await it.__anext__()
        assert first.endswith(b"[DONE]\n\n")
        assert d.calls == []  # the client's write comes first
        clock[0] = 10.5  # the write took time: the outcome keeps the hand-on moment
        try:
            await it.__anext__()
            raise AssertionError("the stream should be over")
        except StopAsyncIteration:
            pass
        assert len(d.calls) == 1
        call = d.calls[0]
        assert call["ok"] is True and call["status"] == "200" and call["at"] == 10.0
        await s.close()
        assert len(d.calls) == 1

    asyncio.run(main())


def test_a_reader_that_stops_after_the_last_chunk_still_finishes_as_answered() -> None:
    async def main() -> None:
        clock = [3.0]
        s, d = _stream(clock)
        it = s.iter_bytes()
        await it.__anext__()
        await it.aclose()  # the consumer let go of the iterator after [DONE]
        assert d.calls == []
        clock[0] = 4.0
        await s.close()
        assert d.calls[0] == {"ok": True, "status": "200", "error": None, "at": 3.0}

    asyncio.run(main())


def test_an_error_event_before_done_finishes_as_a_stream_error() -> None:
    async def main() -> None:
        s, d = _stream([1.0], error="engine said no")
        async for _ in s.iter_bytes():
            pass
        assert d.calls == [{"ok": False, "status": "stream_error", "error": "engine said no", "at": 1.0}]
        # the engine's failure, counted as one (upstream_errors{kind="stream_error"})
        assert d.relay.metrics.upstream_errors.labels("i0", "stream_error")._value.get() == 1.0

    asyncio.run(main())


def test_a_stream_not_done_finishes_at_close_as_client_gone() -> None:
    async def main() -> None:
        s, d = _stream([1.0])
        d.stats.done = False
        s._pending = b"data: x\n\n"
        it = s.iter_bytes()
        await it.__anext__()
        await it.aclose()
        await s.close()
        assert d.calls == [{"ok": False, "status": "499", "error": "client disconnected", "cancelled": True}]

    asyncio.run(main())
