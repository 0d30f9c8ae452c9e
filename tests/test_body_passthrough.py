"""The client's body bytes go upstream as they are only where they say exactly what the gateway
validated and would have sent (`gateway.json_body.sent_as_parsed`, `gateway.relay.upstream_body`).

The oracle is the old behaviour: `upstream_fields` encoded by `json.dumps`. Whatever bytes are
sent, the engine must read exactly that object from them; a body that names a key twice (which
json.loads reads as its last value and another parser may read as its first) is never sent as
the client wrote it."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.auth import Caller
from gateway.json_body import MEMBER_WALK_MAX, parse_json_object, sent_as_parsed
from gateway.relay import upstream_body, upstream_fields
from gateway.requests import parse_request
from tests.conftest import make_config


def _no_repeated_key(raw: bytes) -> bool:
    """The oracle: json.loads' own view of every object's members, in order, repeats included."""
    seen_twice = False

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal seen_twice
        seen_twice |= len({k for k, _ in items}) != len(items)
        return dict(items)
    json.loads(raw, object_pairs_hook=pairs)
    return not seen_twice


def _colon_in_a_string(value: Any) -> bool:
    """Whether any key or string of a parsed body holds a colon (such bodies are re-encoded)."""
    if isinstance(value, dict):
        return any(":" in k or _colon_in_a_string(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_colon_in_a_string(v) for v in value)
    return isinstance(value, str) and ":" in value


def _sendable(raw: bytes) -> bool:
    return _no_repeated_key(raw) and not _colon_in_a_string(json.loads(raw))


# JSON text written by hand, so that objects may repeat keys and strings may hold colons,
# quotes, escapes and non-ASCII text.
_KEYS = st.sampled_from(["a", "b", "model", "a:b", 'q"', "\\", "é", ":"])
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                     st.floats(allow_nan=False, allow_infinity=False),
                     st.text(alphabet=st.sampled_from(list('ab:"\\{}[],é\n ')), max_size=8))


def _dump(value: Any) -> str:
    if isinstance(value, tuple):  # an object as (key, value) pairs, repeats allowed
        return "{" + ", ".join(f"{json.dumps(k)} :{_dump(v)}" for k, v in value) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_dump(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.lists(st.tuples(_KEYS, inner), max_size=4).map(tuple)), max_leaves=20)
_OBJECTS = st.lists(st.tuples(_KEYS, _VALUES), max_size=6).map(tuple)


@settings(max_examples=400, deadline=None)
@given(_OBJECTS)
def test_sent_as_parsed_is_exactly_no_repeated_key_and_no_colon_in_strings(obj: tuple[tuple[str, Any], ...]) -> None:
    raw = _dump(obj).encode()
    body = parse_json_object(raw)
    assert sent_as_parsed(raw, body) == _sendable(raw)


def test_sent_as_parsed_refusals() -> None:
    body = {"model": "m1", "prompt": "x"}
    assert sent_as_parsed(b'{"model":"m1","prompt":"x"}', body)
    assert not sent_as_parsed(b'{"model":"m1","prompt":"a: b"}', {"model": "m1", "prompt": "a: b"})  # re-encoded
    assert not sent_as_parsed(b'{"model":"m0","model":"m1","prompt":"x"}', body)
    assert not sent_as_parsed(b'{"s":{"include_usage":false,"include_usage":true}}', {"s": {"include_usage": True}})
    # not plain UTF-8 beginning with the object: a byte-order mark, UTF-16, leading space
    for raw in (b'\xef\xbb\xbf{"model":"m1","prompt":"x"}', '{"model":"m1","prompt":"x"}'.encode("utf-16"),
                b' {"model":"m1","prompt":"x"}'):
        assert parse_json_object(raw) == body and not sent_as_parsed(raw, body)
    # a walk too long to pay for: re-encoded
    ids = list(range(MEMBER_WALK_MAX + 1))
    assert not sent_as_parsed(json.dumps({"prompt": ids}).encode(), {"prompt": ids})


CALLER = Caller(tenant="dev")


def _parsed(raw: bytes, kind: str = "completion", model_override: str | None = None) -> Any:
    return parse_request(kind, raw, config=make_config(), caller=CALLER, headers={},  # type: ignore[arg-type]
                         request_id="req-1", now=1.0, model_override=model_override)


def _old_body(parsed: Any, served: str, stream: bool | None = None, token_ids: bool = False) -> bytes:
    return json.dumps(upstream_fields(parsed, served, stream, token_ids), separators=(",", ":")).encode()


_FIELDS = st.fixed_dictionaries({}, optional={
    "stream": st.booleans(), "max_tokens": st.integers(1, 64), "temperature": st.sampled_from([0, 0.5, 1.0]),
    "ignore_eos": st.booleans(), "user": st.sampled_from(["u:1", "é", 'q"']),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(), "x": st.just(1)})})


@settings(max_examples=300, deadline=None)
@given(_FIELDS, st.sampled_from(["m1", "m2"]), st.sampled_from([None, True]), st.booleans(), st.booleans(),
       st.sampled_from(["", ' "model": "m0",', ' "stream": false,']),
       st.sampled_from(["the quick brown fox", "the quick: brown fox"]))
def test_upstream_body_reads_as_the_old_one(fields: dict[str, Any], served: str, stream: bool | None,
                                            token_ids: bool, spaced: bool, repeat: str, prompt: str) -> None:
    """Whatever is sent reads as `upstream_fields`; the client's bytes are sent exactly where
    nothing changes and no key repeats."""
    if "stream_options" in fields and not fields.get("stream"):
        fields["stream"] = True  # (stream_options without a stream is a 400)
    text = json.dumps({"model": "m1", "prompt": prompt, **fields},
                      separators=(", ", ": ") if spaced else (",", ":"))
    raw = ("{" + repeat + text[1:]).encode()  # a repeated key comes first: json.loads keeps the later one
    parsed = _parsed(raw)
    got = upstream_body(parsed, served, stream, token_ids)
    want = _old_body(parsed, served, stream, token_ids)
    assert json.loads(got) == json.loads(want)
    streamed = bool(fields.get("stream"))
    as_sent = served == "m1" and not token_ids and (streamed or not stream) and _sendable(raw)
    if as_sent and (not streamed or fields.get("stream_options", {}).get("include_usage") is True):
        assert got is raw
    elif as_sent and streamed and "stream_options" not in fields:  # the usage request appended
        assert got == raw[:-1] + b',"stream_options":{"include_usage":true}}'
    else:
        assert got == want


def test_a_changed_body_is_encoded() -> None:
    raw = b'{"model": "m2", "prompt": "hi", "max_tokens": 2}'
    fallback = _parsed(raw, model_override="m1")  # the fallback's model, written into the parsed body
    assert fallback.raw is None and upstream_body(fallback, "m1") == _old_body(fallback, "m1")
    from fleetcore.fast_replace import replace
    parsed = _parsed(b'{"model": "m1", "prompt": "hi", "max_tokens": 2}')
    assert upstream_body(parsed, "m1") is parsed.raw[1]
    other = replace(parsed, body={**parsed.body, "kv_transfer_params": {"a": 1}})  # as the P/D flow does
    assert json.loads(upstream_body(other, "m1"))["kv_transfer_params"] == {"a": 1}


KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


async def test_the_engine_gets_the_clients_bytes_or_the_encoded_body(keyed_gateway: Any) -> None:
    client, stub = keyed_gateway
    same = b'{"model": "m1", "prompt": "a b", "max_tokens": 2, "stream": true, "stream_options": {"include_usage": true}}'
    forced = b'{"model": "m1", "prompt": "a b", "max_tokens": 2, "stream": true}'
    colon = b'{"model": "m1", "prompt": "a: b", "max_tokens": 2, "stream": true}'
    null = b'{"model": "m1", "prompt": "x", "max_tokens": 2, "stream": true, "stream_options": null} \n'
    twice = b'{"model": "m1", "prompt": "x", "max_tokens": 64, "max_tokens": 2}'
    for raw in (same, forced, null, twice, colon):
        r = await client.post("/v1/completions", content=raw, headers=AUTH)
        assert r.status_code == 200, r.text
    sent = [req["raw"] for req in stub.requests]
    assert sent[0] == same  # nothing to change: as the client wrote it
    assert sent[1] == forced[:-1] + b',"stream_options":{"include_usage":true}}'  # the usage request appended
    assert json.loads(sent[2])["stream_options"] == {"include_usage": True}  # encoded: the key was there
    assert sent[3] == b'{"model":"m1","prompt":"x","max_tokens":2}'  # the value validated, and only it
    assert json.loads(sent[4]) == {**json.loads(colon), "stream_options": {"include_usage": True}}  # encoded
