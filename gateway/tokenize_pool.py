"""A bounded pool that parses and tokenizes large request bodies off the event loop.

Tokenizing a long prompt takes milliseconds per 10 KB; on the event loop that stalls every
other request's relay and the health checks. Bodies above a small size go to `workers`
threads instead. The pool holds at most `workers + queue` bodies (running or waiting);
beyond that a request gets 503 `tokenizer_busy` with Retry-After at once rather than
piling up memory. A request whose tokenization takes longer than `timeout_s` gets 503
`tokenize_timeout`; its thread cannot be interrupted, so its slot stays taken until the
work really ends, which keeps the bound true. Work is bounded anyway: prompts are only
tokenized as far as the context allows (`gateway.requests`).

The built-in tokenizer (`fleetcore.tokens`, what the simulated engines count with) is Python:
on a pool thread it holds the GIL, and the event loop waits for the GIL whenever it wants it
back (up to the switch interval, after every poll and socket call). A burst of 16 prompts of
32k tokens kept the loop thread waiting ~10 ms of every ~20 ms of a stall for it, with only
~6 ms of its own work (bench/README.md, "Tokenization off the loop"). So a pool thread hands a
long text (`HELPER_MIN_CHARS`) to a helper process of its own (`gateway.tokenize_helper`, started
at its first long text) and waits for the answer without the GIL. Models' own tokenizers (Rust)
release the GIL themselves and stay on the threads. A helper that breaks or does not answer in
time is killed with a warning and that text is tokenized on the thread (slower for the loop,
never a wrong count); another starts with a later long text, at most every `HELPER_RESTART_S`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import select
import subprocess
import sys
import threading
import time
from array import array
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from fleetcore.tokens import encode_upto
from gateway.errors import overloaded
from gateway.tokenize_helper import ANSWER, REQUEST

log = logging.getLogger("tokenfleet.gateway")

T = TypeVar("T")

START_TIMEOUT_S = 5.0  # for the worker threads to start (at start-up, once)
# Texts from this long are tokenized in a helper process (module docstring): below it, sending the
# text and the ids back costs about what the GIL time it saves is worth (~1 ms of tokenizing).
HELPER_MIN_CHARS = 16 * 1024
# After a helper failed, none is started again for this long (its texts are tokenized on the thread).
HELPER_RESTART_S = 10.0
_ROOT = str(Path(__file__).resolve().parent.parent)  # the tree `gateway` is imported from

# What a pool thread knows: its pool's helpers and its own helper process (unset on other threads).
_thread = threading.local()


def builtin_encode_upto(text: str, limit: int) -> list[int]:
    """`fleetcore.tokens.encode_upto`; on a pool thread and for a long text, in its helper process."""
    helpers: TokenizerHelpers | None = getattr(_thread, "helpers", None)
    if helpers is None or len(text) < HELPER_MIN_CHARS:
        return encode_upto(text, limit)
    return helpers.encode_upto(text, limit)


class _HelperProcess:
    """One `gateway.tokenize_helper` process and its two pipes, used by one thread at a time."""

    def __init__(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (_ROOT, env.get("PYTHONPATH"))))
        self.proc = subprocess.Popen([sys.executable, "-m", "gateway.tokenize_helper"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, close_fds=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._to, self._from = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        os.set_blocking(self._to, False)  # every wait is a poll with the deadline's remainder
        os.set_blocking(self._from, False)

    def encode_upto(self, text: str, limit: int, timeout_s: float) -> list[int]:
        deadline = time.monotonic() + timeout_s
        raw = text.encode("utf-8", "surrogatepass")
        self._write(REQUEST.pack(limit, len(raw)), deadline)
        self._write(raw, deadline)
        (count,) = ANSWER.unpack(self._read(ANSWER.size, deadline))
        ids = array("I")
        ids.frombytes(self._read(count * ids.itemsize, deadline))
        return ids.tolist()

    def _wait(self, fd: int, event: int, deadline: float) -> None:
        poller = select.poll()  # (not select(): the gateway's descriptors run past 1024)
        poller.register(fd, event)
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            raise TimeoutError("no answer in time")

    def _write(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            self._wait(self._to, select.POLLOUT, deadline)
            view = view[os.write(self._to, view):]

    def _read(self, n: int, deadline: float) -> bytes:
        parts, got = [], 0
        while got < n:
            self._wait(self._from, select.POLLIN, deadline)
            part = os.read(self._from, n - got)
            if not part:
                raise EOFError("the helper process exited")
            parts.append(part)
            got += len(part)
        return b"".join(parts)

    def end(self) -> None:
        """Kill the process and reap it (killed: at once), leaving the pipes open: a thread may be
        reading them this moment, and a descriptor closed under it could be another's by the time
        it reads. That thread then reads the end of the pipe; the pipes close with their owner."""
        self.proc.kill()
        try:
            self.proc.wait(START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        """`end`, and close the pipes: only by the thread that uses them."""
        self.end()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class TokenizerHelpers:
    """The helper processes of one pool's threads (module docstring): one per thread."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._live: set[_HelperProcess] = set()
        self._failed_at = float("-inf")
        self._closed = False
        self.failures = 0

    def encode_upto(self, text: str, limit: int) -> list[int]:
        """(on a pool thread)"""
        helper: _HelperProcess | None = getattr(_thread, "process", None)
        if helper is None:
            helper = _thread.process = self._start()
            if helper is None:
                return encode_upto(text, limit)
        try:
            return helper.encode_upto(text, limit, self.timeout_s)
        except (OSError, EOFError, TimeoutError, ValueError) as e:
            _thread.process = None
            self._failed(helper, e)
            return encode_upto(text, limit)

    def _start(self) -> _HelperProcess | None:
        with self._lock:
            if self._closed or time.monotonic() - self._failed_at < HELPER_RESTART_S:
                return None
            try:
                helper = _HelperProcess()
            except OSError as e:
                self._failed_at = time.monotonic()
                log.warning("the built-in tokenizer's helper process did not start (%s); long prompts are "
                            "tokenized on the pool's threads for %gs", e, HELPER_RESTART_S)
                return None
            self._live.add(helper)
            return helper

    def _failed(self, helper: _HelperProcess, error: BaseException) -> None:
        with self._lock:
            self._live.discard(helper)
            closed = self._closed
            if not closed:
                self._failed_at = time.monotonic()
                self.failures += 1
        helper.kill()
        if not closed:
            log.warning("the built-in tokenizer's helper process failed (%s: %s); its prompt is tokenized on "
                        "the pool's thread, and no helper starts for %gs", type(error).__name__, error,
                        HELPER_RESTART_S)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            live, self._live = self._live, set()
        for helper in live:
            helper.end()  # (not `kill`: its thread may be using the pipes)


class TokenizePool:
    def __init__(self, workers: int, queue: int, timeout_s: float, *, helper: bool = True) -> None:
        """`helper`: long texts of the built-in tokenizer go to a helper process (module docstring)."""
        self.capacity = workers + queue
        self.timeout_s = timeout_s
        self._pending = 0  # bodies accepted and not finished (running or waiting)
        self._lock = threading.Lock()  # work ends on pool threads
        self.helpers = TokenizerHelpers(timeout_s) if helper else None
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenize",
                                            initializer=_thread.__setattr__, initargs=("helpers", self.helpers))
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
        if self.helpers is not None:
            self.helpers.close()
