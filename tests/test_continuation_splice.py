"""The continuation request and the splice, without processes: what `gateway.continuation` builds
from a parsed request and what the client sees of a continuation leg."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fleetcore.continuation import ContinuationLimits
from fleetcore.fleet_config import FleetConfig
from fleetcore.prefix import block_hashes
from fleetcore.sse import parse_sse_event
from fleetcore.tokens import encode, render_chat
from gateway.auth import Caller
from gateway.continuation import Continuation, assembled_answer, continuation_tokenizer, static_refusal
from gateway.requests import ParsedRequest, parse_request

MODEL = "llama-3.1-8b"


def config(adapter: str = "sim") -> FleetConfig:
    return FleetConfig.model_validate({
        "sites": [{"name": "east", "region": "us-east", "jurisdiction": "us"}],
        "models": [{"name": MODEL, "engine": {"spec": "llama-3.1-8b", "max_model_len": 8192, "block_size": 16}}],
        "deployments": [{"site": "east", "model": MODEL, "instances": 1, "gpu": "H100", "adapter": adapter}],
    })


def parsed(kind: str, body: dict[str, Any], cfg: FleetConfig | None = None) -> ParsedRequest:
    return parse_request(kind, json.dumps({"model": MODEL, **body}).encode(),  # type: ignore[arg-type]
                         config=cfg or config(), caller=Caller("acme"), headers={}, request_id="req-1", now=0.0)


MESSAGES = [{"role": "user", "content": "tell me about " + "prefix caches and fleets " * 20}]


def test_chat_continuation_is_a_completion_of_prompt_ids_plus_tail() -> None:
    p = parsed("chat", {"messages": MESSAGES, "max_tokens": 100, "min_tokens": 30, "seed": 7, "temperature": 0.5,
                        "stream": True, "ignore_eos": True, "tools": None})
    c = Continuation(p, ContinuationLimits(), None)
    c.sent.observe({"id": "chatcmpl-x", "created": 5, "model": MODEL,
                    "choices": [{"index": 0, "delta": {"content": "alpha beta gamma"}}]})
    assert c.tail_needs_tokenizing  # text without the engine's ids: re-tokenized (off the loop, by resume)
    tail = c.tail_ids()
    assert tail == encode("alpha beta gamma") and len(tail) == 3
    with_ids = Continuation(p, ContinuationLimits(), None)
    with_ids.sent.observe({"choices": [{"index": 0, "delta": {"content": "alpha beta"}, "token_ids": [5, 6]}]})
    assert not with_ids.tail_needs_tokenizing and with_ids.tail_ids() == [5, 6]  # the engine's ids, copied
    leg = c.next_leg(tail)
    body = json.loads(leg.encoded("served-name"))
    prompt = encode(render_chat(MESSAGES))
    assert body["prompt"] == prompt + tail and body["model"] == "served-name"
    assert body["max_tokens"] == 97 and body["min_tokens"] == 27
    assert body["seed"] == 7 and body["temperature"] == 0.5 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert "messages" not in body and "tools" not in body
    # routing sees the original prefix followed by the tail's blocks: a prefix holder hits
    assert leg.profile.block_hashes == tuple(block_hashes(prompt + tail, 16))
    assert leg.profile.block_hashes[:len(p.profile.block_hashes)] == p.profile.block_hashes
    assert leg.profile.prompt_tokens == len(prompt) + 3 and leg.profile.max_tokens == 97
    assert leg.prompt_tokens == len(prompt) + 3 and leg.generated_tokens == 3


def test_splice_keeps_the_id_and_format_and_sums_usage() -> None:
    p = parsed("chat", {"messages": MESSAGES, "max_tokens": 10, "stream": True,
                        "stream_options": {"include_usage": True}})
    c = Continuation(p, ContinuationLimits(), None)
    c.sent.observe({"id": "chatcmpl-x", "created": 5, "model": MODEL,
                    "choices": [{"index": 0, "delta": {"content": "one two"}}]})
    c.done, c.before_tokens, c.reprefill_tokens = 1, 2, p.profile.prompt_tokens + 2
    chunk = {"id": "cmpl-other", "object": "text_completion", "created": 9, "model": "served",
             "choices": [{"index": 0, "text": " three", "logprobs": None, "finish_reason": None}], "usage": None}
    out = parse_sse_event(c.splice(parse_sse_event(b"data: " + json.dumps(chunk).encode() + b"\n\n"), False)).obj
    assert out == {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 5, "model": MODEL,
                   "choices": [{"index": 0, "delta": {"content": " three"}, "logprobs": None,
                                "finish_reason": None}], "usage": None}
    usage_chunk = {"id": "cmpl-other", "choices": [], "usage": {
        "prompt_tokens": 99, "completion_tokens": 8, "total_tokens": 107, "prompt_tokens_details": {"cached_tokens": 64}}}
    ev = parse_sse_event(b"data: " + json.dumps(usage_chunk).encode() + b"\n\n")
    out = parse_sse_event(c.splice(ev, True)).obj
    assert out is not None
    prompt = p.profile.prompt_tokens
    assert out["usage"] == {"prompt_tokens": prompt, "completion_tokens": 10, "total_tokens": prompt + 10,
                            "prompt_tokens_details": {"cached_tokens": min(64, prompt)},
                            "tokenfleet_continuations": 1, "tokenfleet_reprefill_tokens": prompt + 2,
                            "tokenfleet_reprefill_cached_tokens": 64}
    assert c.sent.text == "one two three"


def test_engine_token_ids_are_used_when_every_chunk_carries_them() -> None:
    p = parsed("completion", {"prompt": "hello", "max_tokens": 10, "stream": True})
    c = Continuation(p, ContinuationLimits(), None)
    c.sent.observe({"id": "cmpl-1", "choices": [{"index": 0, "text": " a", "token_ids": [11]}]})
    c.sent.observe({"id": "cmpl-1", "choices": [{"index": 0, "text": " b", "token_ids": [12, 13]}]})
    assert c.tail_ids() == [11, 12, 13]
    c.sent.observe({"id": "cmpl-1", "choices": [{"index": 0, "text": " c"}]})  # one without: re-tokenize
    assert c.tail_ids() == encode(" a b c")


@pytest.mark.parametrize(("kind", "extra", "label"), [
    ("chat", {"n": 2}, "n_gt_1"),
    ("chat", {"logprobs": True}, "logprobs"),
    ("completion", {"logprobs": 0}, "logprobs"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "constrained_decoding"),
    ("chat", {"response_format": {"type": "json_object"}}, "constrained_decoding"),
    ("chat", {"guided_regex": "a+"}, "constrained_decoding"),
    ("completion", {"echo": True}, "echo"),
    ("chat", {"chat_template_kwargs": {"enable_thinking": True}}, "chat_template"),
    ("completion", {"prompt": ["one", "two"]}, "batch"),
    ("chat", {}, None),
    ("chat", {"response_format": {"type": "text"}}, None),
])
def test_who_may_be_continued(kind: str, extra: dict[str, Any], label: str | None) -> None:
    base: dict[str, Any] = {"messages": MESSAGES} if kind == "chat" else {"prompt": "hi"}
    p = parsed(kind, {**base, "max_tokens": 10, **extra})
    assert static_refusal(p, True, ContinuationLimits()) == label
    assert static_refusal(p, True, ContinuationLimits(enabled=False)) == "disabled"


def test_the_builtin_tokenizer_is_trusted_only_for_simulated_engines() -> None:
    assert continuation_tokenizer(config("sim"), MODEL, {}) == (True, None)
    assert continuation_tokenizer(config("vllm"), MODEL, {}) == (False, None)
    p = parsed("chat", {"messages": MESSAGES, "max_tokens": 10}, config("vllm"))
    assert static_refusal(p, False, ContinuationLimits()) == "no_tokenizer"


def test_limits_are_counted_per_request() -> None:
    p = parsed("chat", {"messages": MESSAGES, "max_tokens": 10})
    c = Continuation(p, ContinuationLimits(max_continuations=2, max_reprefill_tokens=p.profile.prompt_tokens + 5), None)
    assert c.refused(3) is None
    assert c.refused(6) == "reprefill_too_long"
    assert c.refused(10) == "budget_spent"
    c.done = 2
    assert c.refused(3) == "limit"
    c.done = 0
    c.sent.observe({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]})
    assert c.refused(3) == "tool_calls"


def test_assembled_answer_of_a_spliced_stream() -> None:
    stream = (b'data: {"id":"chatcmpl-x","object":"chat.completion.chunk","created":5,"model":"m",'
              b'"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
              b'data: {"id":"chatcmpl-x","choices":[{"index":0,"delta":{"content":"a b"}}]}\n\n'
              b'data: {"id":"chatcmpl-x","choices":[{"index":0,"delta":{"content":" c"},"finish_reason":"length"}]}\n\n'
              b'data: {"id":"chatcmpl-x","choices":[],"usage":{"completion_tokens":3}}\n\ndata: [DONE]\n\n')
    answer, error = assembled_answer(stream, chat=True)
    assert error is None and answer == {
        "id": "chatcmpl-x", "object": "chat.completion", "created": 5, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "a b c"}, "logprobs": None,
                     "finish_reason": "length"}], "usage": {"completion_tokens": 3}}
    answer, error = assembled_answer(stream.replace(b"data: [DONE]", b'data: {"error":{"message":"boom"}}'), True)
    assert answer is None and error == {"message": "boom"}


class _Host:
    """What `gateway.resume.continuation_of` reads of the relay."""

    def __init__(self, cfg: FleetConfig, limits: ContinuationLimits | None = None) -> None:
        self.config, self.tokenizers, self.continuation_limits = cfg, {}, limits or ContinuationLimits()


@pytest.mark.parametrize("adapter", ["sim", "vllm"])  # the built-in tokenizer usable, and not
@pytest.mark.parametrize(("kind", "extra"), [
    ("chat", {}), ("chat", {"n": 2}), ("completion", {"echo": True}), ("completion", {"prompt": ["one", "two"]}),
    ("chat", {"chat_template_kwargs": {"x": 1}}), ("completion", {}),
])
@pytest.mark.parametrize("enabled", [True, False])
def test_continuation_state_exactly_when_static_refusal_finds_no_reason(adapter: str, kind: str,
                                                                        extra: dict[str, Any], enabled: bool) -> None:
    """`continuation_of` looks at the tokenizer before the rest (it refuses without one, whatever
    else): a request has continuation state exactly when `static_refusal` gives no reason."""
    from gateway.resume import continuation_of

    cfg = config(adapter)
    base: dict[str, Any] = {"messages": MESSAGES} if kind == "chat" else {"prompt": "hi"}
    p = parsed(kind, {**base, "max_tokens": 10, "stream": True, **extra}, cfg)
    host = _Host(cfg, ContinuationLimits(enabled=enabled))
    usable, _ = continuation_tokenizer(cfg, MODEL, {})
    c = continuation_of(host, p)  # type: ignore[arg-type]
    assert (c is None) == (static_refusal(p, usable, host.continuation_limits) is not None)
    assert c is None or (c.parsed is p and c.engine_ids is False and c.tok is None)
