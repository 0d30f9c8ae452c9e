"""The simulated worker's `n` choices and logprobs: OpenAI shapes, determinism, usage sums."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from engine_adapters.sim.worker import start_worker
from tests.test_sim_worker import post, sse_events

MODEL = "sim-llama"
CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Tell me about choices."}]


@pytest.fixture
async def worker() -> AsyncIterator[str]:
    runner, url = await start_worker(served_model_name=MODEL, time_scale=0.02, instance_id="w-choices")
    try:
        yield url
    finally:
        await runner.cleanup()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        yield s


async def test_n_choices_are_indexed_deterministic_and_summed(worker: str, http: aiohttp.ClientSession) -> None:
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 40, "n": 3}
    status, r = await post(http, worker + CHAT, body)
    assert status == 200
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    texts = [c["message"]["content"] for c in r["choices"]]
    assert len(set(texts)) == 3  # each choice has its own seed
    words = [len(t.split()) for t in texts]
    assert r["usage"]["completion_tokens"] == sum(words)
    _, again = await post(http, worker + CHAT, body)
    assert [c["message"]["content"] for c in again["choices"]] == texts
    _, one = await post(http, worker + CHAT, {**body, "n": 1})
    assert one["choices"][0]["message"]["content"] == texts[0]  # choice 0 is what n=1 answers


async def test_n_choices_stream(worker: str, http: aiohttp.ClientSession) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    async with http.post(worker + "/v1/completions", json=body) as resp:
        events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    parts: dict[int, str] = {0: "", 1: ""}
    finished: set[int] = set()
    for e in events[:-2]:
        (c,) = e["choices"]
        parts[c["index"]] += c["text"]
        if c["finish_reason"]:
            finished.add(c["index"])
    assert finished == {0, 1}
    _, whole = await post(http, worker + "/v1/completions", {**body, "stream": False, "stream_options": None})
    assert [parts[0], parts[1]] == [c["text"] for c in whole["choices"]]
    assert usage["completion_tokens"] == whole["usage"]["completion_tokens"] == sum(
        len(p.split()) for p in parts.values())


def _check_chat_logprobs(lp: dict[str, Any], content: str, top: int) -> None:
    assert lp["refusal"] is None
    tokens = lp["content"]
    assert "".join(t["token"] for t in tokens) == content
    for t in tokens:
        assert t["logprob"] <= 0 and t["bytes"] == list(t["token"].encode())
        tops = t["top_logprobs"]
        assert len(tops) == top
        if top:
            assert tops[0]["token"] == t["token"] and tops[0]["logprob"] == t["logprob"]
            assert [x["logprob"] for x in tops] == sorted((x["logprob"] for x in tops), reverse=True)
            assert len({x["token"] for x in tops}) == top


async def test_chat_logprobs_whole_and_streamed_agree(worker: str, http: aiohttp.ClientSession) -> None:
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 10, "logprobs": True, "top_logprobs": 3}
    _, r = await post(http, worker + CHAT, body)
    choice = r["choices"][0]
    _check_chat_logprobs(choice["logprobs"], choice["message"]["content"], 3)
    async with http.post(worker + CHAT, json={**body, "stream": True}) as resp:
        events = await sse_events(resp)
    streamed = [t for e in events[:-1] for c in e["choices"] if c["logprobs"] for t in c["logprobs"]["content"]]
    assert streamed == choice["logprobs"]["content"]
    _, plain = await post(http, worker + CHAT, {"model": MODEL, "messages": MSGS, "max_tokens": 10})
    assert plain["choices"][0]["logprobs"] is None


async def test_completion_logprobs_shape(worker: str, http: aiohttp.ClientSession) -> None:
    body = {"model": MODEL, "prompt": "Count with me", "max_tokens": 8, "logprobs": 2}
    _, r = await post(http, worker + "/v1/completions", body)
    c = r["choices"][0]
    lp = c["logprobs"]
    assert "".join(lp["tokens"]) == c["text"]
    assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    assert all(len(d) == 2 for d in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])
    async with http.post(worker + "/v1/completions", json={**body, "stream": True}) as resp:
        events = await sse_events(resp)
    offsets = [o for e in events[:-1] for ch in e["choices"] if ch["logprobs"] for o in ch["logprobs"]["text_offset"]]
    assert offsets == lp["text_offset"]


async def test_embedding_worker_serves_only_embeddings(worker: str, http: aiohttp.ClientSession) -> None:
    status, body = await post(http, worker + "/v1/embeddings", {"model": MODEL, "input": "x"})
    assert status == 400 and body["error"]["param"] == "model"  # a chat worker
    runner, url = await start_worker(served_model_name="emb", time_scale=0.02, embedding_dim=32)
    try:
        status, body = await post(http, url + "/v1/embeddings", {"model": "emb", "input": [[1, 2, 3], "hi"],
                                                                  "encoding_format": "float"})
        assert status == 200 and [len(d["embedding"]) for d in body["data"]] == [32, 32]
        assert body["usage"]["prompt_tokens"] > 3  # the token ids plus the text's tokens
        status, body = await post(http, url + CHAT, {"model": "emb", "messages": MSGS})
        assert status == 400 and body["error"]["param"] == "model"
    finally:
        await runner.cleanup()
