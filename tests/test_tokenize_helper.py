"""The built-in tokenizer's helper processes (`gateway.tokenize_pool`, `gateway.tokenize_helper`).

A pool thread hands a long text to a helper process of its own, so the Python tokenizer does not
hold the GIL the event loop needs (tests/test_tokenize_stall.py measures the loop). Here: the
helper's ids are `encode_upto`'s, exactly; it really is the helper that tokenizes; a helper that
dies or hangs costs a warning and a slower count, never a wrong one or a lost request; the pool
closes its helpers; a helper ends when its gateway does."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from fleetcore.tokens import encode_upto
from gateway import tokenize_pool
from gateway.errors import GatewayError
from gateway.tokenize_pool import HELPER_MIN_CHARS, TokenizePool, _HelperProcess, builtin_encode_upto
from tests.test_builtin_tokenizer_cache import _adversarial


def _long_texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        text = ""
        while len(text) < HELPER_MIN_CHARS:
            text += _adversarial(rng)
        texts.append(text + "\ud800 lone surrogate, \u4e2d\u6587, \U0001f600")
    return texts


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the texts tokenized in this process (on the pool's threads) rather than in a helper."""
    calls: list[int] = []

    def local(text: str, limit: int) -> list[int]:
        calls.append(len(text))
        return encode_upto(text, limit)

    monkeypatch.setattr(tokenize_pool, "encode_upto", local)
    return calls


def _helpers(pool: TokenizePool) -> list[_HelperProcess]:
    assert pool.helpers is not None
    return list(pool.helpers._live)


async def _until(what: Callable[[], Any], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "not within the deadline"
        await asyncio.sleep(0.01)


async def test_long_texts_get_the_same_ids_from_the_helper(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy(monkeypatch)
    pool = TokenizePool(workers=1, queue=4, timeout_s=10.0)
    try:
        for text in _long_texts(1, 6):
            n = len(encode_upto(text, 10**9))
            for limit in (0, 1, n // 2, n - 1, n, n + 7):
                assert await pool.run(builtin_encode_upto, text, limit) == encode_upto(text, limit)
        assert calls == []  # every long text was tokenized in the helper
        assert len(_helpers(pool)) == 1  # one helper, for the pool's one thread
        short = "a chat turn, " * 10
        assert await pool.run(builtin_encode_upto, short, 100) == encode_upto(short, 100)
        assert calls == [len(short)]  # a short one is not worth the trip
    finally:
        pool.close()
    assert builtin_encode_upto("x " * HELPER_MIN_CHARS, 5) == encode_upto("x " * HELPER_MIN_CHARS, 5)  # off the pool: here


async def test_a_helper_that_dies_costs_a_warning_not_a_count(monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    calls = _spy(monkeypatch)
    text, other = _long_texts(2, 2)
    pool = TokenizePool(workers=1, queue=4, timeout_s=10.0)
    try:
        assert await pool.run(builtin_encode_upto, text, 10**9) == encode_upto(text, 10**9)
        [helper] = _helpers(pool)
        helper.proc.kill()
        helper.proc.wait(5)
        with caplog.at_level(logging.WARNING, "tokenfleet.gateway"):
            assert await pool.run(builtin_encode_upto, other, 10**9) == encode_upto(other, 10**9)
        assert "helper process failed" in caplog.text
        assert pool.helpers is not None and pool.helpers.failures == 1
        assert calls == [len(other)] and _helpers(pool) == []  # counted on the thread instead
        # no new helper within HELPER_RESTART_S of the failure ...
        assert await pool.run(builtin_encode_upto, text, 10**9) == encode_upto(text, 10**9)
        assert len(calls) == 2 and _helpers(pool) == []
        # ... and one after it
        monkeypatch.setattr(tokenize_pool, "HELPER_RESTART_S", 0.0)
        assert await pool.run(builtin_encode_upto, text, 10**9) == encode_upto(text, 10**9)
        assert len(calls) == 2 and len(_helpers(pool)) == 1
    finally:
        pool.close()


async def test_a_hung_helper_is_killed_and_the_pool_answers_503(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy(monkeypatch)
    text, = _long_texts(3, 1)
    pool = TokenizePool(workers=1, queue=4, timeout_s=1.0)
    try:
        assert await pool.run(builtin_encode_upto, text, 10**9) == encode_upto(text, 10**9)
        [helper] = _helpers(pool)
        os.kill(helper.proc.pid, signal.SIGSTOP)  # alive, never answers
        with pytest.raises(GatewayError) as slow:
            await pool.run(builtin_encode_upto, text, 10**9)
        assert slow.value.status == 503 and slow.value.code == "tokenize_timeout"
        # the thread gives up on the helper at the same deadline, kills it, counts on its own
        await _until(lambda: pool.pending == 0)
        assert helper.proc.poll() is not None and calls == [len(text)]
        assert pool.helpers is not None and pool.helpers.failures == 1
        assert await pool.run(builtin_encode_upto, text, 10**9) == encode_upto(text, 10**9)  # served again
    finally:
        pool.close()


async def test_closing_the_pool_ends_its_helpers() -> None:
    text, = _long_texts(4, 1)
    pool = TokenizePool(workers=2, queue=4, timeout_s=10.0)
    await asyncio.gather(*(pool.run(builtin_encode_upto, text, 10**9) for _ in range(4)))
    helpers = _helpers(pool)
    assert 1 <= len(helpers) <= 2  # one per thread that met a long text
    pool.close()
    for helper in helpers:
        assert helper.proc.wait(5) is not None  # ended and reaped
    assert _helpers(pool) == []


def test_a_helper_ends_when_its_gateway_does() -> None:
    """The gateway's end, however it comes (a kill too), closes the helper's input: it exits."""
    helper = _HelperProcess()
    assert helper.encode_upto("hello there", 100, 10.0) == encode_upto("hello there", 100)
    assert helper.proc.stdin is not None
    helper.proc.stdin.close()
    assert helper.proc.wait(5) == 0
    helper.kill()  # (closes the other pipe)
