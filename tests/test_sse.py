"""fleetcore.sse: the one reading of an OpenAI stream (relay, live bench, bench scripts)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetcore.sse import (
    PlainTokens,
    SSESplitter,
    StreamReader,
    StreamStats,
    carries_token,
    error_message,
    parse_sse_event,
    plain_token_text,
    usage_counts,
    usage_of_body,
)
from fleetcore.sse import _KEY_WORDS, _template_safe  # the template's byte test, pinned below


def ev(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


USAGE = {"prompt_tokens": 812, "completion_tokens": 3, "total_tokens": 815,
         "prompt_tokens_details": {"cached_tokens": 512}}


def read(*events: bytes, step: float = 1.0) -> StreamReader:
    r = StreamReader()
    for i, e in enumerate(events):
        r.feed(e, i * step)
    r.close(len(events) * step)
    return r


# --- splitting -------------------------------------------------------------------------

def test_splitter_cuts_whole_events_at_every_split_point() -> None:
    stream = b'data: {"a": 1}\n\ndata: {"b":\r\n\r\n: keepalive\n\ndata: [DONE]\n\n'
    for cut in range(1, len(stream)):
        sp = SSESplitter()
        events = sp.feed(stream[:cut]) + sp.feed(stream[cut:]) + sp.flush()
        assert b"".join(events) == stream, cut  # the relay passes these bytes on untouched
        assert [parse_sse_event(e).done for e in events] == [False, False, False, True]


def test_splitter_all_three_terminators_and_byte_by_byte() -> None:
    stream = b"data: 1\n\ndata: 2\r\n\r\ndata: 3\r\rdata: 4\n\n"
    sp = SSESplitter()
    events = [e for b in stream for e in sp.feed(bytes([b]))]
    assert events == [b"data: 1\n\n", b"data: 2\r\n\r\n", b"data: 3\r\r", b"data: 4\n\n"]
    assert sp.flush() == []


def test_splitter_flush_keeps_an_unterminated_tail_only_if_it_holds_something() -> None:
    sp = SSESplitter()
    assert sp.feed(b'data: {"x": 1}') == []
    assert sp.flush() == [b'data: {"x": 1}\n\n']
    sp.feed(b"\n")
    assert sp.flush() == []


_BIG = 70_000  # longer than the splitter's `_LONG`: such an event is kept in pieces while it arrives


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3 * _BIG), st.sampled_from([b"\n\n", b"\r\n\r\n", b"\r\r"])),
                min_size=1, max_size=6),
       st.lists(st.sampled_from([1, 2, 3, 5, 4096, _BIG, 3 * _BIG]), min_size=1, max_size=40))
def test_splitter_long_events_in_any_reads_cut_as_one_read_would(events: list[tuple[int, bytes]],
                                                                  reads: list[int]) -> None:
    """Long events (in pieces) and short ones, in reads of any size (the separators' bytes split
    across reads too), cut exactly as the whole stream fed at once."""
    stream = b"".join(b"data: " + b"x y" * (n // 3) + sep for n, sep in events)
    whole = SSESplitter()
    expected = whole.feed(stream) + whole.flush()
    sp, got, i, k = SSESplitter(), [], 0, 0
    while i < len(stream):
        size = reads[k % len(reads)]
        got += sp.feed(stream[i:i + size])
        i, k = i + size, k + 1
    assert got + sp.flush() == expected
    assert b"".join(expected) == stream


def test_splitter_bounds_an_event_that_never_ends() -> None:
    from fleetcore.sse import EventTooLarge

    sp = SSESplitter(max_event_bytes=1_000_000)
    with pytest.raises(EventTooLarge):
        for _ in range(100):
            sp.feed(b"x" * 65536)
    assert sp.feed(b"data: 1\n\n") == [b"data: 1\n\n"]  # what it held is dropped; it reads on
    with pytest.raises(EventTooLarge):
        SSESplitter(max_event_bytes=1000).feed(b"data: " + b"y" * 2000)  # in one read too


def test_splitter_time_is_linear_in_a_long_event() -> None:
    """64 MB arriving in 16 KiB reads: re-joined every read, ~128 GB of copying (minutes); in pieces, one join."""
    import time

    sp, chunk = SSESplitter(), b"z" * 16384
    t0 = time.perf_counter()
    for _ in range(4096):
        assert sp.feed(chunk) == []
    [event] = sp.feed(b"\n\n")
    assert len(event) == 4096 * 16384 + 2
    assert time.perf_counter() - t0 < 5.0


# --- one event ---------------------------------------------------------------------------

def test_parse_event_kinds() -> None:
    assert parse_sse_event(b'data: {"a": 1}\n\n').obj == {"a": 1}
    assert parse_sse_event(b'data:{"a": 1}\r\n\r\n').obj == {"a": 1}  # the space is optional
    assert parse_sse_event(b"data: [DONE]\n\n").done
    assert parse_sse_event(b"data: [DONE]\r\r").done
    assert parse_sse_event(b": keepalive\n\n").data is None
    assert parse_sse_event(b"event: ping\n\n").data is None
    # several data lines join with newlines (SSE), here into one JSON document
    multi = parse_sse_event(b'event: message\ndata: {"a":\ndata: 2}\n\n')
    assert multi.obj == {"a": 2} and multi.data == '{"a":\n2}'
    bad = parse_sse_event(b"data: not json\n\n")
    assert bad.obj is None and bad.malformed and not bad.done
    assert parse_sse_event(b"data: [1, 2]\n\n").malformed  # JSON, but not a chunk
    assert not parse_sse_event(b": c\n\n").malformed


@pytest.mark.parametrize("terminator", [b"\n\n", b"\r\n\r\n"])
def test_parse_event_lines_end_only_where_sse_says(terminator: bytes) -> None:
    """Engines send raw UTF-8 in JSON strings (no ensure_ascii): U+2028, U+0085 or a form
    feed inside a token is text, not a line end."""
    text = "a\u2028b\x85c\x0cd\x1ee"
    raw = b"event: message\r\ndata: " + json.dumps({"t": text}, ensure_ascii=False).encode() + terminator
    assert parse_sse_event(raw).obj == {"t": text}
    assert parse_sse_event(ev({"t": text}).replace(b"\\u2028", "\u2028".encode())).obj == {"t": text}


def test_parse_event_survives_invalid_utf8() -> None:
    e = parse_sse_event(b'data: {"t": "\xff"}\n\n')
    assert e.obj == {"t": "\ufffd"}


# --- which chunks count as tokens -------------------------------------------------------------

@pytest.mark.parametrize("choice", [
    {"text": " hi"},                                                  # completions
    {"delta": {"content": " hi"}},                                    # chat
    {"delta": {"reasoning_content": "let me think"}},                 # DeepSeek/SGLang/vLLM reasoning
    {"delta": {"reasoning": "let me think"}},                         # vLLM's newer field name
    {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\""}}]}},
    {"delta": {"function_call": {"arguments": "{"}}},                 # legacy functions API
])
def test_carries_token(choice: dict[str, Any]) -> None:
    assert carries_token(choice)


@pytest.mark.parametrize("choice", [
    {"delta": {"role": "assistant", "content": ""}},  # the role chunk
    {"delta": {}, "finish_reason": "stop"},           # the finish chunk
    {"text": "", "finish_reason": "length"},
    {"delta": {"content": None, "tool_calls": []}},
    {"delta": "not a mapping"},
])
def test_carries_no_token(choice: dict[str, Any]) -> None:
    assert not carries_token(choice)


# --- usage and errors --------------------------------------------------------------------

def test_usage_counts() -> None:
    u = usage_counts(USAGE)
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens) == (812, 3, 512)
    assert usage_counts(None) == usage_counts({}) == usage_counts({"total_tokens": 4})
    assert usage_counts(None).prompt_tokens is None and usage_counts(None).cached_tokens == 0
    # engines without a cache report send null details; a bool is never a count
    odd = usage_counts({"prompt_tokens": True, "completion_tokens": 2, "prompt_tokens_details": None})
    assert (odd.prompt_tokens, odd.completion_tokens, odd.cached_tokens) == (None, 2, 0)


def test_usage_of_body() -> None:
    assert usage_of_body(json.dumps({"choices": [], "usage": USAGE}).encode()) == USAGE
    assert usage_of_body(b"{}") is None
    assert usage_of_body(b"[1]") is None
    assert usage_of_body(b"<html>") is None


def test_error_message() -> None:
    assert error_message({"error": {"message": "boom", "code": "x"}}) == "boom"
    assert error_message({"error": {"code": "x"}}) == "upstream error"
    assert error_message({"error": "plain text"}) == "plain text"
    assert error_message({"error": None}) is None
    assert error_message({"choices": []}) is None


# --- a whole stream ------------------------------------------------------------------------

def test_chat_stream() -> None:
    r = read(ev({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
             ev({"choices": [{"index": 0, "delta": {"content": " a"}}]}),
             b": keep-alive\n\n",
             ev({"choices": [{"index": 0, "delta": {"content": " b"}}]}),
             ev({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
             ev({"choices": [], "usage": USAGE}),
             b"data: [DONE]\n\n")
    st = r.stats
    assert (st.first_token_at, st.last_token_at, st.token_events) == (1.0, 3.0, 2)
    assert st.finish_reason == "stop" and st.done and st.error is None and r.finished
    assert st.output_tokens() == 3  # the engine's completion_tokens win over counted chunks
    assert st.counts().cached_tokens == 512


def test_completions_stream_without_usage_counts_chunks() -> None:
    r = read(ev({"choices": [{"text": " a"}]}), ev({"choices": [{"text": " b", "finish_reason": "length"}]}),
             b"data: [DONE]\n\n")
    assert r.stats.token_events == 2 and r.stats.output_tokens() == 2
    assert r.stats.finish_reason == "length"


def test_reasoning_and_tool_call_stream_has_a_first_token() -> None:
    """The bench used to see no output here: no `content` at all."""
    r = read(ev({"choices": [{"delta": {"role": "assistant"}}]}),
             ev({"choices": [{"delta": {"reasoning_content": "Need the weather."}}]}),
             ev({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                                        "function": {"name": "get_weather", "arguments": ""}}]}}]}),
             ev({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\":1}"}}]}}]}),
             ev({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]}),
             b"data: [DONE]\n\n")
    assert (r.stats.first_token_at, r.stats.last_token_at, r.stats.token_events) == (1.0, 3.0, 3)
    assert r.stats.finish_reason == "tool_calls"


def test_error_event_then_done() -> None:
    """The gateway ends a failed stream with an error event and [DONE]: both are seen."""
    r = read(ev({"choices": [{"delta": {"content": "x"}}]}),
             ev({"error": {"message": "engine died", "type": "server_error", "code": "upstream_error"}}),
             b"data: [DONE]\n\n")
    assert r.stats.error == "engine died" and r.stats.done and r.finished
    assert r.stats.token_events == 1


def test_events_after_done_are_ignored() -> None:
    r = read(b"data: [DONE]\n\n", ev({"choices": [{"delta": {"content": "late"}}]}))
    assert r.stats.done and r.stats.token_events == 0


def test_unparseable_data_is_an_error_for_a_reader() -> None:
    r = read(ev({"choices": [{"delta": {"content": "x"}}]}), b"data: <html>oops\n\n")
    assert r.finished and not r.stats.done
    assert r.stats.error is not None and "unparseable" in r.stats.error


def test_stream_split_across_reads_gives_the_same_stats() -> None:
    whole = b"".join([ev({"choices": [{"delta": {"content": "a"}}]}),
                      ev({"choices": [{"delta": {"reasoning": "b"}}]}),
                      ev({"choices": [], "usage": USAGE}), b"data: [DONE]\n\n"])
    for size in (1, 3, 7, 64, len(whole)):
        r = StreamReader()
        for i in range(0, len(whole), size):
            r.feed(whole[i:i + size], 0.0)
        r.close(0.0)
        assert (r.stats.token_events, r.stats.usage, r.stats.done) == (2, USAGE, True), size


def test_unterminated_last_event_counts_at_close() -> None:
    r = StreamReader()
    r.feed(b'data: {"choices": [{"text": "a"}]}', 1.0)
    assert r.stats.token_events == 0
    r.close(2.0)
    assert r.stats.token_events == 1 and r.stats.first_token_at == 2.0


def test_observe_flags_the_usage_only_chunk() -> None:
    """The relay drops this chunk when the client did not ask for usage itself."""
    st = StreamStats()
    assert st.observe({"choices": [], "usage": USAGE}, 0.0)
    assert not st.observe({"choices": [{"delta": {"content": "a"}}], "usage": USAGE}, 0.0)
    assert not st.observe({"choices": [{"delta": {"content": "a"}}]}, 0.0)
    assert st.usage == USAGE


# --- plain token events read from their bytes (the relay's fast path) ---------------------

HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def _compact(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {**HEAD, "choices": [{"index": 0, "delta": delta if delta is not None else {"content": " tok"},
                                 "logprobs": None, "finish_reason": finish}], **extra}


PLAIN = [  # (event, its text): the shapes nearly every event of a generation has
    (_compact(_chunk()), " tok"),  # vLLM
    (ev(_chunk()), " tok"),  # json.dumps' default separators (SGLang, the simulated worker)
    (_compact(_chunk(usage=None)), " tok"),  # vLLM with continuous usage off but the key present
    (_compact({"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": "ab", "logprobs": None,
                                                                      "finish_reason": None}]}), "ab"),
    (_compact(_chunk({"role": "assistant", "content": "Hi"})), "Hi"),
]
NOT_PLAIN = [  # everything the relay accounts or a continuation rebuilds differently, or any doubt
    _compact(_chunk({"role": "assistant", "content": ""})),  # role only: no token
    _compact(_chunk({"content": None})),
    _compact(_chunk(finish="stop")),
    _compact({**HEAD, "choices": [], "usage": USAGE}),
    _compact(_chunk(usage=USAGE)),
    _compact({"error": {"message": "boom"}}),
    _compact(_chunk({"content": "", "tool_calls": [{"index": 0, "function": {"name": "f"}}]})),
    _compact(_chunk({"content": "x", "reasoning_content": "think"})),
    _compact(_chunk({"content": "line\nbreak"})),  # escaped: json.loads decodes it
    ev(_chunk({"content": "caf\u00e9"})),  # non-ASCII as json.dumps escapes it
    _compact({**HEAD, "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None},
                                  {"index": 1, "delta": {"content": "b"}, "finish_reason": None}]}),  # n = 2
    _compact({**HEAD, "choices": [{"index": 1, "delta": {"content": "b"}, "finish_reason": None}]}),
    _compact(_chunk(logprobs_extra={"content": [{"token": "x"}]})),
    _compact({**HEAD, "choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [5], "finish_reason": None}]}),
    b"data: [DONE]\n\n",
    b": keep-alive\n\n",
    b"data: " + json.dumps(_chunk()).encode() + b"\r\n\r\n",  # CRLF: the full way
    b"event: message\ndata: " + json.dumps(_chunk()).encode() + b"\n\n",
]


@pytest.mark.parametrize("raw,text", PLAIN)
def test_plain_token_event_read_without_json_agrees_with_the_full_parse(raw: bytes, text: str) -> None:
    assert plain_token_text(raw) == text
    ev_ = parse_sse_event(raw)
    assert ev_.obj is not None
    full, fast = StreamStats(), StreamStats()
    assert full.account(ev_, 1.0) is False  # not a usage chunk
    fast.token(1.0)
    assert (full.first_token_at, full.last_token_at, full.token_events, full.usage, full.error,
            full.finish_reason) == (fast.first_token_at, fast.last_token_at, fast.token_events, None, None, None)
    choice = ev_.obj["choices"][0]
    assert (choice.get("text") or choice["delta"]["content"]) == text


@pytest.mark.parametrize("raw", NOT_PLAIN)
def test_anything_but_a_plain_token_event_takes_the_full_parse(raw: bytes) -> None:
    assert plain_token_text(raw) is None


# --- PlainTokens: plain_token_text from a stream's template ---------------------------------

# Texts a template must refuse or pass exactly as plain_token_text does: the key words, quotes,
# escapes, newlines, invalid UTF-8, the empty text, and ordinary pieces.
_WORDS = [b"error", b"usage", b"index", b"content", b"text", b"finish_reason", b"tool_calls", b"token_ids",
          b"function_call", b"reasoning", b"reasoning_content", b"xreasoning", b'"', b"\\", b"\n", b"\xff",
          b"\xc3\xa9", b"", b" tok", b"null", b":", b",", b"}", b"{", b"0", b"ab\"cd", b" the"]
_TEXT_BYTES = st.lists(st.sampled_from(_WORDS) | st.binary(max_size=6), max_size=4).map(b"".join)


def _event_around(text: bytes, shape: int) -> bytes:
    """A token event of one of the engines' shapes with `text` as its raw value bytes."""
    head, tail = [
        (b'data: {"id":"cmpl-9","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"',
         b'","logprobs":null,"finish_reason":null}],"usage":null}\n\n'),
        (b'data: {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", '
         b'"choices": [{"index": 0, "delta": {"content": "', b'"}, "logprobs": null, "finish_reason": null}]}\n\n'),
        (b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":"',
         b'"},"finish_reason":"stop"}]}\n\n'),  # a finish: never plain, whatever the text
    ][shape]
    return head + text + tail


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(_TEXT_BYTES, st.integers(0, 2)), min_size=1, max_size=12))
def test_plain_tokens_answer_as_plain_token_text_on_every_event_of_a_stream(events: list[tuple[bytes, int]]) -> None:
    reader = PlainTokens()
    for text, shape in events:
        raw = _event_around(text, shape)
        assert reader.text(raw) == plain_token_text(raw)


def test_plain_tokens_learn_a_template_and_read_later_events_from_it() -> None:
    reader = PlainTokens()
    first, later = _event_around(b" first", 0), _event_around(b" later", 0)
    assert reader.text(first) == " first"
    assert reader._head and reader._tail  # learned from the first plain event
    assert reader.text(later) == " later"
    for odd in (b"error", b"reasoning more", b"a\\nb", b""):  # the template refuses; the full reading decides
        assert reader.text(_event_around(odd, 0)) == plain_token_text(_event_around(odd, 0))


# --- the byte tests written with `find` / one regex instead of `in` (fleetcore.sse docstring) ---

def _template_safe_reference(text: bytes) -> bool:
    return (b'"' not in text and b"\\" not in text and b"\n" not in text
            and text not in _KEY_WORDS and not text.startswith(b"reasoning"))


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(_WORDS) | st.binary(max_size=6), max_size=4).map(b"".join))
def test_template_safe_is_the_three_in_tests(text: bytes) -> None:
    assert _template_safe(text) is _template_safe_reference(text)


def test_template_safe_refuses_exactly_the_three_scanned_bytes_alone_and_inside() -> None:
    for b in range(256):
        one = bytes([b])
        for text in (one, b"ab" + one, one + b"cd", b"a" + one + b"b"):
            assert _template_safe(text) is _template_safe_reference(text), text


@pytest.mark.parametrize("raw", [
    b'data: {"a":1}\n\n', b'data: {"a":1}\r\n\r\n', b'data: {"a":"x\ry"}\n\n', b'data: {"a":1}\ndata: {"b":2}\n\n',
    b"data: [DONE]\r\r", b"data:{\"a\":1}\n\n",
])
def test_parse_event_single_line_test_with_find(raw: bytes) -> None:
    """The single-data-line shortcut is taken only without CR or LF inside: same event as the
    line-by-line reading."""
    lines = [ln[5:].removeprefix(b" ") for ln in raw.splitlines() if ln.startswith(b"data:")]
    want = b"\n".join(lines).decode()
    got = parse_sse_event(raw)
    assert got.data == want


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(['"content":""', '"content":"x"', '"content": ""', '"text":""', '"text":"y"',
                                 '"role":"assistant"', '"index":0', '"finish_reason":null', '"usage":null']),
                min_size=1, max_size=5))
def test_an_empty_content_is_never_a_plain_token(keys: list[str]) -> None:
    """The early refusal of `"content":""` (the role chunk) answers as the full reading would: no
    event holding it is read as a token, and one holding it only inside another key's text
    (escaped) still goes by the rest of the tests."""
    raw = b'data: {"choices":[{' + ",".join(keys).encode() + b"}]}\n\n"
    got = plain_token_text(raw)
    if '"content":""' in keys:
        assert got is None
    elif keys.count('"content":"x"') + keys.count('"text":"y"') == 1 and '"index":0' in keys \
            and keys.count('"index":0') == 1 and not any(k in keys for k in ('"content": ""', '"text":""')):
        first = next(k for k in keys if k in ('"content":"x"', '"text":"y"'))
        assert got == first[-2]
    assert plain_token_text(_compact(_chunk({"role": "assistant", "content": ""}))) is None
    assert plain_token_text(_compact(_chunk({"content": '"content":""'}))) is None  # escaped: the full way
