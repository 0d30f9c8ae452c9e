"""A bounded pool that parses and tokenizes large request bodies off the event loop.

Tokenizing a long prompt takes milliseconds per 10 KB; on the event loop that stalls every
other request's relay and the health checks. Bodies above a small size go to `workers`
threads instead. The pool holds at most `workers + queue` bodies (running or waiting);
beyond that a request gets 503 `tokenizer_busy` with Retry-After at once rather than
piling up memory. A request whose tokenization takes longer than `timeout_s` gets 503
`tokenize_timeout`; its thread cannot be interrupted, so its slot stays taken until the
work really ends, which keeps the bound true. Work is bounded anyway: prompts are only
tokenized as far as the context allows (`gateway.requests`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from gateway.errors import overloaded

T = TypeVar("T")

START_TIMEOUT_S = 5.0  # for the worker threads to start (at start-up, once)


class TokenizePool:
    def __init__(self, workers: int, queue: int, timeout_s: float) -> None:
        self.capacity = workers + queue
        self.timeout_s = timeout_s
        self._pending = 0  # bodies accepted and not finished (running or waiting)
        self._lock = threading.Lock()  # work ends on pool threads
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenize")
        # Start the threads now: the executor starts one inside `submit`, on the loop, and
        # `Thread.start` waits for it to run, which behind a busy tokenizer thread holding
        # the GIL held the loop for milliseconds at the first long prompts of a burst. (Each
        # start-up task waits for the others, so none is idle and every submit starts a thread.)
        started = threading.Barrier(workers)
        for work in [self._executor.submit(started.wait, START_TIMEOUT_S) for _ in range(workers)]:
            work.result(START_TIMEOUT_S)

    @property
    def pending(self) -> int:
        return self._pending

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on a pool thread; 503 when the pool is full or it runs too long.

        The deadline covers the wait for a thread too: work still waiting when it passes is
        dropped (never started); work already running keeps its slot until it returns."""
        with self._lock:
            if self._pending >= self.capacity:
                raise overloaded(f"The gateway's tokenizer pool is full ({self.capacity} requests)",
                                 "tokenizer_busy", 1)
            self._pending += 1
        work = self._executor.submit(fn, *args, **kwargs)
        work.add_done_callback(self._finished)
        try:
            # shield: a timed-out (or cancelled) waiter must not mark running work as done
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(work)), self.timeout_s)
        except TimeoutError:
            work.cancel()  # succeeds only while it waits for a thread
            raise overloaded(f"Tokenizing the prompt took longer than {self.timeout_s:g}s",
                             "tokenize_timeout", max(1, math.ceil(self.timeout_s))) from None

    def _finished(self, work: Future[Any]) -> None:
        with self._lock:
            self._pending -= 1

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
