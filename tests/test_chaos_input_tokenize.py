"""Bounded tokenization: the bounds a prompt is refused by before tokenizing, counting that stops
at the context, the bounded pool (503 when full or slow), and an event loop that no large
body stalls."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetcore import tokens
from fleetcore.model_tokenizer import HFTokenizer, max_chars_per_token
from gateway.app import create_app
from gateway.auth import Caller
from gateway.errors import GatewayError
from gateway.requests import parse_request
from gateway.tokenize_pool import TokenizePool

TEXT = st.text(alphabet=st.sampled_from(list("ab Z9.\n\t\u00e9\u4e2d-_ ")) | st.characters(), max_size=400)


@settings(max_examples=300, deadline=None)
@given(TEXT)
def test_builtin_pieces_cover_the_text_and_are_short(text: str) -> None:
    pieces = tokens.split_pieces(text)
    assert "".join(pieces) == text
    assert all(len(p) <= tokens.MAX_PIECE_CHARS for p in pieces)
    assert len(pieces) >= tokens.min_tokens(len(text))
    assert tokens.encode_upto(text, 7) == tokens.encode(text)[:8]


@settings(max_examples=300, deadline=None)
@given(TEXT, st.integers(min_value=-2, max_value=450))
def test_encode_upto_is_the_piece_by_piece_reference_at_every_limit(text: str, limit: int) -> None:
    # encode_upto takes findall when the text is too short to pass the cap, finditer otherwise:
    # both must give the ids of the first limit + 1 pieces, as one token_id call per piece does
    reference = [tokens.token_id(m.group())
                 for m in itertools.islice(tokens._PIECE.finditer(text), max(0, limit) + 1)]
    assert tokens.encode_upto(text, limit) == reference
    assert tokens.encode(text) == [tokens.token_id(p) for p in tokens.split_pieces(text)]


def test_long_words_and_whitespace_runs_split() -> None:
    assert [len(p) for p in tokens.split_pieces("x" * 40)] == [16, 16, 8]
    assert tokens.count_tokens(" " * 100) == 4
    assert tokens.count_tokens("the quick brown fox") == 4  # ordinary text tokenizes as before


# --- real tokenizers ---

def _bpe_dir(d: Path, pre: Any = None, normalizer: Any = None) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre if pre is not None else pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if normalizer is not None:
        tok.normalizer = normalizer
    corpus = ["the fleet routes tokens to the engine " * 20, "aaaaaaaaaaaaaaaa " * 50, "hello world " * 30]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"}))
    return d


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return HFTokenizer(_bpe_dir(tmp_path_factory.mktemp("bpe")))


def test_byte_level_bpe_has_a_bound_from_its_longest_entry(bpe: HFTokenizer) -> None:
    longest = max(len(t.encode()) for t in bpe._tok.get_vocab(with_added_tokens=True))
    assert bpe.max_chars_per_token == longest > 4


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("aaaa helo wrd the fleet\u00e9\U0001F600\n")) | st.characters(
    blacklist_categories=("Cs",)), max_size=300))
def test_the_bound_holds_for_any_text(bpe: HFTokenizer, text: str) -> None:
    assert len(bpe.text_ids(text)) >= bpe.min_tokens(len(text))


def test_tokenizers_that_drop_text_have_no_bound(tmp_path: Path) -> None:
    from tokenizers import normalizers, pre_tokenizers
    whitespace = HFTokenizer(_bpe_dir(tmp_path / "ws", pre=pre_tokenizers.Whitespace()))
    assert whitespace.max_chars_per_token is None and whitespace.min_tokens(10**6) == 0
    lower = HFTokenizer(_bpe_dir(tmp_path / "lower", normalizer=normalizers.Lowercase()))
    assert lower.max_chars_per_token is None
    nfc = HFTokenizer(_bpe_dir(tmp_path / "nfc", normalizer=normalizers.NFC()))
    assert nfc.max_chars_per_token == 3 * HFTokenizer(_bpe_dir(tmp_path / "plain")).max_chars_per_token  # type: ignore[operator]
    assert max_chars_per_token({"model": {"type": "WordLevel"}}) is None
    assert max_chars_per_token({"model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": True, "vocab": {}}}) is None


def test_a_huge_prompt_is_refused_without_running_the_tokenizer(bpe: HFTokenizer, config_factory: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = bpe._tok
    monkeypatch.setattr(bpe, "_tok", type("Spy", (), {
        "encode_batch": lambda self, *a, **k: calls.append(1) or real.encode_batch(*a, **k)})())
    config = config_factory()
    args: dict[str, Any] = dict(config=config, caller=Caller("t"), headers={}, request_id="r", now=0.0,
                                tokenizers={"m1": bpe})
    for kind, body in (("completion", {"model": "m1", "prompt": "hello " * 200_000}),
                       ("chat", {"model": "m1", "messages": [{"role": "user", "content": "hello " * 200_000}]})):
        with pytest.raises(GatewayError) as e:
            parse_request(kind, json.dumps(body).encode(), **args)  # type: ignore[arg-type]
        assert e.value.code == "context_length_exceeded" and "at least" in e.value.message
    assert calls == []
    ok = parse_request("completion", json.dumps({"model": "m1", "prompt": "hello world"}).encode(), **args)
    assert ok.profile.prompt_tokens == len(real.encode("hello world").ids) and calls == [1]


# --- the pool ---

async def test_the_pool_is_bounded_and_times_out() -> None:
    pool = TokenizePool(workers=1, queue=1, timeout_s=0.5)
    release = threading.Event()
    try:
        first = asyncio.create_task(pool.run(release.wait, 10))  # holds the only thread
        second = asyncio.create_task(pool.run(lambda: "queued"))  # waits for it
        await asyncio.sleep(0)
        assert pool.pending == 2
        with pytest.raises(GatewayError) as full:
            await pool.run(lambda: "third")
        assert full.value.status == 503 and full.value.code == "tokenizer_busy"
        assert int(full.value.headers["Retry-After"]) >= 1
        for task in (first, second):
            with pytest.raises(GatewayError) as slow:
                await task
            assert slow.value.status == 503 and slow.value.code == "tokenize_timeout"
        # the waiting one was dropped; the running one keeps its slot until it really ends
        assert pool.pending == 1
        release.set()
        deadline = time.monotonic() + 5
        while pool.pending:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert await pool.run(lambda: 42) == 42
    finally:
        release.set()
        pool.close()


async def test_no_large_body_stalls_the_event_loop(stub_upstream: Any, gateway_server: Any, fake_adapter: Any,
                                                   instance_factory: Any, config_factory: Any) -> None:
    """The loop's longest pause while 8 MB prompts are refused stays short (it was seconds)."""
    stub = await stub_upstream()
    app = create_app(config_factory(), [fake_adapter([instance_factory("i0", stub.url)])])
    url = await gateway_server(app)
    body = json.dumps({"model": "m1", "prompt": "a " * 4_000_000}).encode()
    longest = 0.0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal longest
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            longest = max(longest, now - last)
            last = now

    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        tick = asyncio.create_task(ticker())
        for _ in range(2):
            r = await c.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        done.set()
        await tick
    print(f"\nlongest event-loop pause: {longest * 1000:.1f} ms")
    assert longest < 0.25, f"the event loop stalled for {longest:.3f}s"
