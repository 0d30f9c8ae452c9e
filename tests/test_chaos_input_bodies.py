"""Bodies that used to become 500s (or cost seconds) get an OpenAI-style 400 naming the problem:
lone UTF-16 surrogates anywhere, nesting past `gateway.max_json_depth` (and 100k-deep input that
blew Python's recursion limit), millions of tiny JSON values, oversized prompts that are refused
from their length with "at least N tokens"."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
CHAT = "/v1/chat/completions"


def _chat(content: str = "hello", model: str = "m1") -> str:
    # hand-written JSON so that escapes reach the gateway exactly as written
    return f'{{"model": "{model}", "messages": [{{"role": "user", "content": "{content}"}}], "max_tokens": 4}}'


async def _error(client: httpx.AsyncClient, body: bytes | str, path: str = CHAT) -> dict[str, Any]:
    r = await client.post(path, content=body, headers=AUTH)
    assert r.status_code == 400, r.text
    assert (await client.get("/health")).status_code == 200
    return r.json()["error"]


@pytest.mark.parametrize("body, param", [
    (_chat(content="hi \\ud83d there"), "messages[0].content"),           # lone high surrogate
    (_chat(content="\\udc00"), "messages[0].content"),                     # lone low surrogate
    (_chat(model="m1\\ud83d"), "model"),                                   # in the model name
    ('{"model": "m1", "prompt": ["ok", "\\ud800"], "max_tokens": 2}', "prompt[1]"),
    ('{"model": "m1", "prompt": "x", "user": "\\udfff", "max_tokens": 2}', "user"),
    ('{"model": "m1", "prompt": "x", "metadata": {"k\\ud83d": 1}, "max_tokens": 2}', "metadata"),
], ids=["content-high", "content-low", "model", "batch-prompt", "user", "object-key"])
async def test_lone_surrogates_are_a_400_naming_where(keyed_gateway: Any, body: str, param: str) -> None:
    client, stub = keyed_gateway
    path = CHAT if '"messages"' in body else "/v1/completions"
    err = await _error(client, body, path)
    assert err["code"] == "invalid_unicode" and err["param"] == param and "surrogate" in err["message"]
    assert stub.requests == []  # nothing reached the engine


async def test_surrogates_as_raw_utf8_bytes_are_a_400(keyed_gateway: Any) -> None:
    client, _ = keyed_gateway
    err = await _error(client, _chat(content="hi ").encode().replace(b"hi ", b"hi \xed\xa0\xbd"))
    assert err["code"] in ("invalid_unicode", "invalid_json")


async def test_a_valid_surrogate_pair_and_non_ascii_text_are_served(keyed_gateway: Any) -> None:
    client, stub = keyed_gateway
    r = await client.post(CHAT, content=_chat(content="emoji \\ud83d\\ude00 and \\ud55c\\uae00 caf\u00e9"), headers=AUTH)
    assert r.status_code == 200, r.text
    assert stub.requests[-1]["body"]["messages"][0]["content"] == "emoji \U0001F600 and \ud55c\uae00 caf\u00e9"


@pytest.mark.parametrize("depth", [65, 5_000, 100_000])
async def test_deep_json_is_a_400(keyed_gateway: Any, depth: int) -> None:
    client, _ = keyed_gateway
    nested = "[" * depth + "]" * depth
    body = f'{{"model": "m1", "prompt": "x", "max_tokens": 2, "extra": {nested}}}'
    err = await _error(client, body, "/v1/completions")
    assert err["code"] == "invalid_json" and "nested more than 64 levels" in err["message"]


async def test_depth_within_the_limit_is_served(keyed_gateway: Any) -> None:
    client, _ = keyed_gateway
    nested = "[" * 60 + "]" * 60
    r = await client.post("/v1/completions", content=f'{{"model": "m1", "prompt": "x", "max_tokens": 2, "extra": {nested}}}',
                          headers=AUTH)
    assert r.status_code == 200, r.text


async def test_millions_of_tiny_values_are_refused_without_parsing(keyed_gateway: Any) -> None:
    client, _ = keyed_gateway
    body = b'{"model": "m1", "prompt": "x", "max_tokens": 2, "extra": [' + b"[]," * 2_500_000 + b"[]]}"
    t = time.monotonic()
    err = await _error(client, body, "/v1/completions")
    assert err["code"] == "invalid_json" and "JSON values" in err["message"]
    assert time.monotonic() - t < 2.0


async def test_a_long_prose_prompt_with_commas_is_not_mistaken_for_many_values(keyed_gateway: Any) -> None:
    """Commas inside strings are text, not structure: the cheap count is checked again without them."""
    client, _ = keyed_gateway
    prompt = "a, " * 300_000  # 300k commas, more than the value cap of this fleet
    r = await client.post("/v1/completions", json={"model": "m1", "prompt": prompt, "max_tokens": 2}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "m1", "prompt": "word " * 50_000, "max_tokens": 8}),
    ("/v1/completions", {"model": "m1", "prompt": ["short", "word " * 50_000], "max_tokens": 8}),
    (CHAT, {"model": "m1", "messages": [{"role": "user", "content": "word " * 2000}] * 5, "max_tokens": 8}),
], ids=["text", "batch", "messages"])
async def test_oversized_prompts_say_at_least(keyed_gateway: Any, path: str, body: dict[str, Any]) -> None:
    client, _ = keyed_gateway
    err = await _error(client, json.dumps(body), path)
    assert err["code"] == "context_length_exceeded" and "at least" in err["message"], err


async def test_counting_stops_exactly_at_the_context_edge(keyed_gateway: Any) -> None:
    """100 prompt tokens + 3996 output fill a 4096 context exactly: served; one more: refused."""
    client, _ = keyed_gateway
    body = {"model": "m1", "prompt": " w" * 100, "max_tokens": 3996}
    r = await client.post("/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    err = await _error(client, json.dumps({**body, "max_tokens": 3997}), "/v1/completions")
    assert err["code"] == "context_length_exceeded" and "at least 4097 tokens" in err["message"], err


def test_surrogate_probe_is_the_three_in_tests() -> None:
    """`_may_hold_surrogate` (written with `find`) answers as the `in` tests it replaced."""
    from gateway.json_body import _may_hold_surrogate

    for raw in (b"", b'{"a":"\\ud83d"}', b'{"a":"\\uD83D"}', b'{"a":"\xed\xa0\x80"}', b'{"a":"\\u00e9"}',
                b'{"a":"ud83d"}', b'{"a":"\\\\ud"}', b"\\u", b"\\ud", b"\\uD", b"\xed", b"plain text", b"\\UD83D"):
        assert _may_hold_surrogate(raw) is (b"\\ud" in raw or b"\\uD" in raw or b"\xed" in raw), raw
