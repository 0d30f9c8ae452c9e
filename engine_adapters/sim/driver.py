"""Runs a pure SimEngine in real time under asyncio.

The engine is a clock-free state machine: ``step(now)`` schedules one batch and
says how long it takes in physical (GPU) seconds. This driver supplies the
clock. Engine time is the physics clock; wall time follows it scaled by
``time_scale`` (wall seconds per physical second, 0.05 = 20x faster).

While the engine is continuously busy, each step starts exactly where the
previous one ended (engine time is never stretched by sleep jitter) and the
driver sleeps until that step's *absolute* wall deadline, so a late wake-up is
absorbed by a shorter next sleep instead of accumulating. When the engine goes
idle and work arrives, engine time jumps forward to the wall clock.

Per-request outputs are delivered through `RequestStream` (an async iterator of
`TokenUpdate`); KV cache events are published as vLLM-shaped batches to bounded
subscriber queues that drop their oldest batch rather than slow the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from .engine import RequestEvent, SimEngine, SimRequest
from .kv_cache import KVEvent

log = logging.getLogger(__name__)

# If wall time falls this far (wall seconds) behind the engine clock (an
# overloaded host), resynchronise instead of sprinting to catch up.
_MAX_WALL_LAG_S = 0.25
# Poll interval when the engine has work but cannot schedule any (should not happen).
_STALL_POLL_S = 0.01


@dataclass(frozen=True, slots=True)
class TokenUpdate:
    """What one engine step did for one request, at engine time ``time``."""

    new_tokens: int
    first_token: bool
    finished: bool
    cached_tokens: int
    time: float = 0.0
    preempted: bool = False


@dataclass(frozen=True, slots=True)
class KVBatch:
    """One published batch of KV events (vLLM KVEventBatch shape in `to_json`)."""

    seq: int
    ts: float
    events: list[dict[str, Any]]
    gap: bool = False  # True when this subscriber dropped batches just before this one

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"seq": self.seq, "ts": self.ts, "events": self.events}
        if self.gap:
            out["gap"] = True
        return out


class DriverObserver(Protocol):
    """Request-timing hooks (engine seconds); the worker's metrics implement it."""

    def on_first_token(self, queue_time: float, ttft: float) -> None: ...

    def on_token(self, inter_token_latency: float) -> None: ...

    def on_finished(self, e2e_latency: float, finish_reason: str) -> None: ...


class DriverStopped(RuntimeError):
    """The driver loop is not running; no request can be served."""


class RequestAborted(Exception):
    """Raised by a RequestStream whose request was aborted by someone else (/abort_request)."""


def kv_event_to_json(ev: KVEvent) -> dict[str, Any]:
    """The vLLM KV event dict for one engine KVEvent."""
    if ev.kind == "stored":
        return {
            "type": "BlockStored",
            "block_hashes": list(ev.block_hashes),
            "parent_block_hash": ev.parent_block_hash,
            "block_size": ev.block_size,
            "medium": "GPU",
        }
    if ev.kind == "removed":
        return {"type": "BlockRemoved", "block_hashes": list(ev.block_hashes), "medium": "GPU"}
    return {"type": "AllBlocksCleared"}


class KVSubscription:
    """A bounded queue of KV batches for one consumer.

    A slow consumer loses its oldest batches (never blocks the engine); the next
    batch it reads carries ``gap=True`` so it knows to resynchronise.
    """

    def __init__(self, driver: EngineDriver, maxsize: int) -> None:
        self._driver = driver
        self._buf: deque[KVBatch] = deque()
        self._maxsize = max(1, maxsize)
        self._ready = asyncio.Event()
        self._gap = False
        self.dropped = 0
        self.closed = False

    def _push(self, batch: KVBatch) -> None:
        if len(self._buf) >= self._maxsize:
            self._buf.popleft()
            self._gap = True
            self.dropped += 1
        self._buf.append(batch)
        self._ready.set()

    async def get(self) -> KVBatch:
        """Next batch; raises DriverStopped when the subscription or driver closes."""
        while not self._buf:
            if self.closed:
                raise DriverStopped("KV subscription closed")
            self._ready.clear()
            await self._ready.wait()
        batch = self._buf.popleft()
        if self._gap:
            self._gap = False
            batch = KVBatch(batch.seq, batch.ts, batch.events, gap=True)
        return batch

    def close(self) -> None:
        self.closed = True
        self._ready.set()
        self._driver._kv_subs.discard(self)

    def __aiter__(self) -> KVSubscription:
        return self

    async def __anext__(self) -> KVBatch:
        try:
            return await self.get()
        except DriverStopped:
            raise StopAsyncIteration from None


@dataclass(slots=True)
class _Track:
    """Driver-side state of one in-flight request."""

    stream: RequestStream
    arrival: float
    finish_reason: str
    first_time: float | None = None
    last_time: float | None = None


class RequestStream:
    """Async iterator of `TokenUpdate` for one request.

    Leaving it early (break, exception, task cancellation) must end in
    `aclose()` — use ``async with`` — which aborts the request in the engine.
    """

    def __init__(self, driver: EngineDriver, request_id: str, arrival: float) -> None:
        self.request_id = request_id
        self.arrival = arrival
        self._driver = driver
        self._queue: asyncio.Queue[TokenUpdate | BaseException] = asyncio.Queue()
        self.finished = False
        self.aborted = False

    def _put(self, item: TokenUpdate | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenUpdate:
        if self.finished or self.aborted:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.aborted = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def pending(self) -> list[TokenUpdate]:
        """Updates already delivered and not yet read (lets a writer batch them)."""
        out: list[TokenUpdate] = []
        while not self.finished and not self.aborted and not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, BaseException):
                self.aborted = True
                raise item
            out.append(item)
            if item.finished:
                self.finished = True
        return out

    async def aclose(self) -> None:
        """Abort in the engine unless it already finished (idempotent)."""
        if not self.finished and not self.aborted:
            self.aborted = True
            self._driver.abort(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


@dataclass(slots=True)
class DriverStats:
    steps: int = 0
    busy_time: float = 0.0  # engine seconds spent in steps
    resyncs: int = 0
    aborted: int = 0
    kv_batches: int = 0
    # Wall seconds each step's tokens went out after the moment its engine time maps to (the loop
    # woke late: a host whose cores are shared): summed, and the worst. Time in every TTFT and
    # token gap of the step that no model of the engine can predict (bench/ROUTING.md, "i19-arrive").
    late_s: float = 0.0
    late_max_s: float = 0.0


class EngineDriver:
    """Owns a SimEngine and steps it in (scaled) real time on the running loop."""

    def __init__(self, engine: SimEngine, time_scale: float = 1.0,
                 observer: DriverObserver | None = None) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.engine = engine
        self.time_scale = time_scale
        self.observer = observer
        self.stats = DriverStats()
        self._tracks: dict[str, _Track] = {}
        self._kv_subs: set[KVSubscription] = set()
        self._kv_seq = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._wall0 = 0.0
        self._clock = 0.0  # engine time at which the last step ended
        # Arrival time of the request that woke an idle engine: its first step starts
        # exactly then, so loop wake-up latency (magnified by a small time_scale)
        # does not show up as queueing.
        self._wake_at: float | None = None
        # P/D: told when a prefill-only request is done and its KV is held (request id, its
        # prefix-cache hit), before its stream sees the update.
        self.on_prefilled: Callable[[str, int], None] | None = None

    # -- lifecycle ------------------------------------------------------------

    def start(self) -> None:
        if self._task is not None:
            return
        loop = asyncio.get_running_loop()
        self._wall0 = loop.time()
        self._task = loop.create_task(self._run(), name="sim-engine-driver")

    async def stop(self) -> None:
        """Stop stepping; in-flight streams get DriverStopped, subscriptions close."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self._fail_all(DriverStopped("engine driver stopped"))

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    def now(self) -> float:
        """Engine time now: the wall clock mapped into physical seconds."""
        return (asyncio.get_running_loop().time() - self._wall0) / self.time_scale

    # -- requests -------------------------------------------------------------

    def submit(self, request_id: str, prompt_len: int, block_hashes: Sequence[int],
               output_len: int, finish_reason: str = "length", mode: Literal["full", "prefill"] = "full",
               ) -> RequestStream:
        """Queue a request; ValueError if the engine refuses it (too long, duplicate id).

        ``finish_reason`` only labels the success metric when it completes. ``mode="prefill"``:
        prefill only (P/D disaggregation); the stream ends with the first token and the engine
        holds the KV until `release_kv`.
        """
        if not self.alive:
            raise DriverStopped("engine driver is not running")
        arrival = max(self.now(), 0.0)
        idle = not self.engine.has_work()
        self.engine.add_request(SimRequest(request_id, prompt_len, block_hashes, output_len, arrival, mode=mode))
        stream = RequestStream(self, request_id, arrival)
        self._tracks[request_id] = _Track(stream, arrival, finish_reason)
        if idle and self._wake_at is None:
            self._wake_at = arrival
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> bool:
        """Drop a request from the engine; its stream ends. False if unknown/finished."""
        track = self._tracks.pop(request_id, None)
        found = self.engine.abort(request_id)
        if track is not None:
            # Wake a reader blocked on the stream (a no-op if the reader itself aborted).
            track.stream._put(RequestAborted(request_id))
            self.stats.aborted += 1
            if self.observer is not None:
                self.observer.on_finished(max(self._clock, self.now()) - track.arrival, "abort")
        self._publish_kv()
        return found or track is not None

    # -- P/D disaggregation (the engine's prefill-only / decode-only modes) -----

    def receive(self, request_id: str, prompt_len: int, block_hashes: Sequence[int], output_len: int,
                finish_reason: str = "length") -> tuple[RequestStream, int] | None:
        """Reserve blocks for a request another engine prefills (`SimEngine.receive`): its stream
        and the prompt tokens cached here, or None when the blocks cannot be had now. The
        stream's first update comes from `kv_arrived`. ValueError as `submit`."""
        if not self.alive:
            raise DriverStopped("engine driver is not running")
        cached = self.engine.receive(SimRequest(request_id, prompt_len, block_hashes, output_len, self.now()))
        if cached is None:
            return None
        arrival = max(self.now(), 0.0)
        stream = RequestStream(self, request_id, arrival)
        self._tracks[request_id] = _Track(stream, arrival, finish_reason)
        self._publish_kv()
        return stream, cached

    def made_elsewhere(self, request_id: str, cached_tokens: int) -> RequestStream:
        """A stream of one token another engine made (a disaggregated request that asked for
        one output token: the prefill made it, nothing is left to decode here)."""
        t = max(self._clock, self.now())
        stream = RequestStream(self, request_id, t)
        stream._put(TokenUpdate(1, True, True, cached_tokens, t))
        return stream

    def kv_arrived(self, request_id: str, cached_tokens: int) -> None:
        """The KV of a received request is here: its first token goes out now (it was made by
        the prefill engine; `cached_tokens` is that engine's prefix hit) and it decodes next."""
        track = self._tracks.get(request_id)
        if track is None or not self.engine.has_request(request_id):
            return  # aborted meanwhile
        self.engine.kv_arrived(request_id)
        t = max(self._clock, self.now())
        track.first_time = track.last_time = t
        if self.observer is not None:
            self.observer.on_first_token(0.0, max(0.0, t - track.arrival))
        track.stream._put(TokenUpdate(1, True, False, cached_tokens, t))
        self._publish_kv()
        if self._wake_at is None and not self.engine.num_running:
            self._wake_at = t
        self._wake.set()

    def release_kv(self, request_id: str) -> bool:
        """A prefill-only request's KV has been sent (or given up on): free its blocks."""
        ok = self.engine.release_kv(request_id)
        if ok:
            self._publish_kv()
            self._wake.set()  # freed blocks may let a waiting request in
        return ok

    def reset_prefix_cache(self) -> bool:
        ok = self.engine.reset_prefix_cache()
        self._publish_kv()
        return ok

    def in_flight(self) -> list[str]:
        return list(self._tracks)

    # -- KV events ------------------------------------------------------------

    def subscribe_kv(self, maxsize: int = 1024) -> KVSubscription:
        sub = KVSubscription(self, maxsize)
        self._kv_subs.add(sub)
        return sub

    def _publish_kv(self) -> None:
        events = self.engine.drain_kv_events()
        if not events:
            return
        seq = self._kv_seq
        self._kv_seq += 1  # seq counts every batch, heard or not, as vLLM's publisher does
        self.stats.kv_batches += 1
        if not self._kv_subs:
            return
        batch = KVBatch(seq, time.time(), [kv_event_to_json(e) for e in events])
        for sub in list(self._kv_subs):
            sub._push(batch)

    # -- the loop -------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        busy = False  # did the previous iteration end with the engine still busy?
        try:
            while True:
                if not self.engine.has_work():
                    busy = False
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                start = self._step_start(busy)
                res = self.engine.step(start)
                self.stats.steps += 1
                if res.duration <= 0 and not res.events:
                    # Work but nothing schedulable: wait for an abort/new request.
                    busy = False
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), _STALL_POLL_S)
                    except TimeoutError:
                        pass
                    continue
                end = start + res.duration
                self.stats.busy_time += res.duration
                self._clock = end
                deadline = self._wall0 + end * self.time_scale
                delay = deadline - loop.time()
                await asyncio.sleep(delay if delay > 0 else 0)
                late = loop.time() - deadline
                if late > 0:
                    self.stats.late_s += late
                    if late > self.stats.late_max_s:
                        self.stats.late_max_s = late
                self._deliver(res.events, start, end)
                self._publish_kv()
                busy = True
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in the engine: fail loudly, never hang clients
            log.exception("engine driver crashed")
            self._fail_all(DriverStopped(f"engine driver crashed: {exc!r}"))
            raise

    def _step_start(self, busy: bool) -> float:
        """Engine time for the next step: back-to-back while busy, else the wall clock."""
        wall_now = self.now()
        wake_at, self._wake_at = self._wake_at, None
        if busy and wall_now - self._clock <= _MAX_WALL_LAG_S / self.time_scale:
            return self._clock
        if busy:
            self.stats.resyncs += 1
        elif wake_at is not None and wall_now - wake_at <= _MAX_WALL_LAG_S / self.time_scale:
            return max(self._clock, wake_at)
        return max(self._clock, wall_now)

    def _deliver(self, events: list[RequestEvent], start: float, t: float) -> None:
        obs = self.observer
        for ev in events:
            track = self._tracks.get(ev.request_id)
            if track is None:  # aborted while the step ran: its outputs never existed
                continue
            if ev.new_tokens and obs is not None:
                if track.first_time is None:
                    # Queue time = arrival to the start of the step that produced the
                    # first token: the engine does not report admission, so this is
                    # exact unless the prompt was chunked over several steps.
                    obs.on_first_token(max(0.0, start - track.arrival), max(0.0, t - track.arrival))
                elif track.last_time is not None:
                    obs.on_token(t - track.last_time)
            if ev.new_tokens:
                if track.first_time is None:
                    track.first_time = t
                track.last_time = t
            track.stream._put(TokenUpdate(ev.new_tokens, ev.first_token, ev.finished,
                                          ev.cached_tokens, t, ev.preempted))
            if ev.finished:
                del self._tracks[ev.request_id]
                if self.on_prefilled is not None and self.engine.holds(ev.request_id):
                    self.on_prefilled(ev.request_id, ev.cached_tokens)
                if obs is not None:
                    obs.on_finished(t - track.arrival, track.finish_reason)

    def _fail_all(self, exc: BaseException) -> None:
        tracks, self._tracks = self._tracks, {}
        for track in tracks.values():
            track.stream._put(exc)
        for sub in list(self._kv_subs):
            sub.close()
