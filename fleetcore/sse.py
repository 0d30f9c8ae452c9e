"""Reading an OpenAI-compatible token stream: SSE events, token chunks, usage, errors.

One reading for everyone who watches a stream: the gateway's relay (what it passes on,
what it measures and reports to the policies), the live benchmark (`bench live`) and the
bench scripts. They used to disagree: the benchmark counted only `content` and `text` as
output, so reasoning and tool-call streams had no first token for it.

- `SSESplitter` cuts a byte stream, read in arbitrary pieces, into whole events (each
  keeps its own terminator and its bytes, so a relay can pass them on untouched).
- `parse_sse_event` reads one event's `data:` lines: `[DONE]`, a JSON object, or neither.
- `carries_token`: a choice that holds output — completions `text`, or a chat delta with
  `content`, reasoning (`reasoning_content`, vLLM's newer `reasoning`), `tool_calls` or
  the legacy `function_call`. Role-only and finish-only chunks do not.
- `usage_counts` / `usage_of_body`: prompt, completion and cached prompt tokens
  (`prompt_tokens_details.cached_tokens`) of a usage object or a whole JSON answer.
- `StreamStats` accounts a stream chunk by chunk; `StreamReader` = splitter + parse +
  stats for clients that only watch (benchmarks).

Pure and clock-free: callers pass `now`. The relay calls this once per token event, so
the common case (one `data: {...}` line, LF-terminated) takes a short path.

Bytes are searched with `find`, not `in`: on CPython 3.11 `needle in raw` first tries the
needle as an integer (`65 in raw` asks for a byte value), which for a bytes needle builds,
formats and clears a TypeError every time (~2,000 instructions, ~0.1 us): ~40 such tests a
relayed request made that their whole cost.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

SSE_DONE = b"data: [DONE]\n\n"  # the event that ends every OpenAI stream

# Delta fields that carry generated tokens (role-only and finish-only chunks carry none).
TOKEN_DELTA_KEYS = ("content", "reasoning_content", "reasoning", "tool_calls", "function_call")

_SEPARATORS = (b"\n\n", b"\r\n\r\n", b"\r\r")


# The largest event a splitter holds while it arrives (the engine's prompt logprobs of a long prompt
# can be tens of MB; an engine that never ends an event must not take the gateway's memory).
MAX_EVENT_BYTES = 256 * 1024 * 1024
_LONG = 64 * 1024  # a partial event this long is kept in pieces, not re-joined every read


class EventTooLarge(ValueError):
    """An SSE event grew past the splitter's bound before it ended."""


class SSESplitter:
    """Cuts a byte stream into whole SSE events (each keeps its own terminator, bytes untouched).

    An event that spans many reads is kept as a list of pieces until a read brings a separator
    (only the boundary and the new read are searched): re-joining it every read was quadratic in
    its length. Past `max_event_bytes` without an end: `EventTooLarge`."""

    __slots__ = ("_buf", "_pieces", "_tail", "_held", "max_event_bytes")

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._buf = b""
        self._pieces: list[bytes] = []  # a long partial event's reads after `_buf` (no separator in any)
        self._tail = b""  # the last 3 bytes of `_buf` and `_pieces` (while `_pieces` holds any)
        self._held = 0  # bytes in `_buf` and `_pieces`
        self.max_event_bytes = max_event_bytes

    def feed(self, data: bytes) -> list[bytes]:
        if self._pieces or len(self._buf) >= _LONG:
            return self._feed_long(data)
        return self._cut(self._buf + data if self._buf else data)

    def _cut(self, buf: bytes) -> list[bytes]:
        """The whole events at the head of `buf`; the rest is kept for the next read."""
        events: list[bytes] = []
        start = 0
        if buf.find(b"\r") < 0:  # (`find`, not `in`: module docstring)
            # LF-only streams (vLLM, SGLang, the simulated worker): one separator to look for.
            while (i := buf.find(b"\n\n", start)) >= 0:
                events.append(buf[start:i + 2])
                start = i + 2
        else:
            while (cut := _next_cut(buf, start)) >= 0:
                events.append(buf[start:cut])
                start = cut
        self._buf = rest = buf[start:] if start else buf
        self._held = len(rest)
        if self._held > self.max_event_bytes:
            self._too_large(self._held)
        return events

    def _feed_long(self, data: bytes) -> list[bytes]:
        """`feed` while a long event is arriving: a read that cannot end it (no separator in it or
        across the boundary) is kept as a piece; one that may joins them all, once, and cuts."""
        tail = self._tail if self._pieces else self._buf[-3:]  # the last bytes held, however small the reads
        if not _may_end(data) and not _may_end(tail + data[:3]):
            self._held += len(data)
            if self._held > self.max_event_bytes:
                self._too_large(self._held)
            self._pieces.append(data)
            self._tail = (tail + data)[-3:]
            return []
        buf = b"".join([self._buf, *self._pieces, data])
        self._pieces = []
        return self._cut(buf)

    def _too_large(self, n: int) -> None:
        self._buf, self._pieces, self._held = b"", [], 0
        raise EventTooLarge(f"an SSE event of more than {self.max_event_bytes} bytes ({n} so far)")

    def flush(self) -> list[bytes]:
        """What is left at end of stream, if it holds anything but whitespace."""
        rest = b"".join([self._buf, *self._pieces])
        self._buf, self._pieces, self._held = b"", [], 0
        return [rest + b"\n\n"] if rest.strip() else []


def _may_end(b: bytes) -> bool:
    """Whether `b` holds an event separator."""
    return b.find(b"\n\n") >= 0 or b.find(b"\r\r") >= 0 or b.find(b"\r\n\r\n") >= 0


def _next_cut(buf: bytes, start: int) -> int:
    """End of the first event at or after `start` (past its separator), -1 if none is whole."""
    best = -1
    for sep in _SEPARATORS:
        i = buf.find(sep, start)
        if i >= 0 and (best < 0 or i + len(sep) < best):
            best = i + len(sep)
    return best


class SSEEvent(NamedTuple):
    """One event's data: None when it has no `data:` line (comments, keep-alives, `event:`
    only); `obj` when the data is a JSON object; `done` for the `[DONE]` sentinel.

    A NamedTuple, not a frozen dataclass: one is built per token event on the relay's hot
    path, and a frozen dataclass's __init__ (object.__setattr__ per field) is ~15% slower."""

    data: str | None
    done: bool = False
    obj: dict[str, Any] | None = None

    @property
    def malformed(self) -> bool:
        """Data that is neither [DONE] nor a JSON object: an engine speaking something else."""
        return self.data is not None and not self.done and self.obj is None


_NO_DATA = SSEEvent(None)


def parse_sse_event(raw: bytes) -> SSEEvent:
    if raw.startswith(b"data: "):
        body = raw[6:].rstrip(b"\r\n")
        if body.find(b"\n") < 0 and body.find(b"\r") < 0:  # (`find`, not `in`: module docstring)
            # The usual event: a single data line (saves splitting into lines and joining).
            return _data_event(body.decode("utf-8", errors="replace"))
    # bytes.splitlines ends lines exactly where SSE does (LF, CRLF, CR); str.splitlines would
    # also cut at U+2028, U+0085, form feeds... that engines send raw inside JSON strings.
    data = [ln[5:].removeprefix(b" ") for ln in raw.splitlines() if ln.startswith(b"data:")]
    if not data:
        return _NO_DATA
    return _data_event(b"\n".join(data).decode("utf-8", errors="replace"))


# What a plain token chunk may not contain for `plain_token_text` to read it without json.loads:
# anything the relay accounts or a continuation must rebuild differently.
_NOT_PLAIN = (b'"error"', b'"reasoning', b'"tool_calls"', b'"function_call"', b'"token_ids"', b"\\")
_TEXT_KEYS = (b'"content":"', b'"content": "', b'"text":"', b'"text": "')


def plain_token_text(raw: bytes) -> str | None:
    """The text of a plain token event, read from its bytes; None when it is anything else (the
    caller then parses it: `parse_sse_event`).

    Plain: one LF-terminated `data: {...}` line holding one choice (index 0) whose `content`
    (chat) or `text` (completions) is a non-empty string without escapes, `finish_reason` and
    `usage` null or absent, and no error, reasoning, tool call or token ids. That is what nearly
    every event of a generation looks like (vLLM, SGLang, the simulated worker), and for it this
    gives what parse + `StreamStats.account` + the continuation's record of sent text would
    learn (a token, its text, nothing else) at a fraction of json.loads' cost; every other
    event, and any doubt, goes the full way. Inside a JSON string a quote is always escaped, so
    a quoted key found in the bytes is a key, and a value without a backslash ends at its next
    quote."""
    if not (raw.startswith(b"data: {") and raw.endswith(b"}\n\n")) or raw.count(b"\n") != 2:
        return None
    # Each test below refuses on its own, so their order is free: first those that refuse the
    # events every stream ends with (the last token's finish reason, the usage chunk).
    n_fin = raw.count(b'"finish_reason"')
    if n_fin and n_fin != raw.count(b'"finish_reason":null') + raw.count(b'"finish_reason": null'):
        return None
    n_usage = raw.count(b'"usage"')
    if n_usage and n_usage != raw.count(b'"usage":null') + raw.count(b'"usage": null'):
        return None
    find = raw.find  # (`find`, not `in`: module docstring)
    # The chunk that opens every chat stream (role, empty content) is refused by the text test at
    # the end: a `"content"` key is one of the keys counted there, so where one holds `""`
    # either the count refuses or it is the one read, empty. Refused here, before ~12 more scans.
    if find(b'"content":""') >= 0:
        return None
    for bad in _NOT_PLAIN:
        if find(bad) >= 0:
            return None
    if raw.count(b'"index"') != 1 or (find(b'"index":0,') < 0 and find(b'"index": 0,') < 0
                                      and find(b'"index":0}') < 0 and find(b'"index": 0}') < 0):
        return None
    if raw.count(b'"content"') + raw.count(b'"text"') != 1:
        return None
    for key in _TEXT_KEYS:
        i = raw.find(key)
        if i >= 0:
            start = i + len(key)
            end = raw.find(b'"', start)
            if end <= start:  # empty (a role-only chunk's ""): not a token
                return None
            try:
                return raw[start:end].decode("utf-8")
            except UnicodeDecodeError:
                return None
    return None  # content null, or a list: not this path


# Text values a template may not take (`PlainTokens`): with the quotes around it, each would make
# one of the keys `plain_token_text` looks for (`"error"`, `"usage"`, ...) that the template's own
# event did not have, so that function would count it and might answer differently.
_KEY_WORDS = frozenset((b"error", b"tool_calls", b"function_call", b"token_ids", b"finish_reason", b"usage",
                        b"index", b"content", b"text"))


# A byte of a text that changes what the scans see: a quote, a backslash, a newline.
_SCANNED_BYTE = re.compile(rb'["\\\n]')


def _template_safe(text: bytes) -> bool:
    """Whether `text` between a template's halves reads as the template's own text did: no quote,
    backslash or newline (each changes what the scans see), none of the key words, not
    `reasoning...` (`"reasoning` is refused as a prefix). The three bytes are looked for by one
    regex search rather than three `in` tests (module docstring)."""
    return (_SCANNED_BYTE.search(text) is None
            and text not in _KEY_WORDS and not text.startswith(b"reasoning"))


class PlainTokens:
    """`plain_token_text` for the events of one stream, most of them without its scans.

    An engine sends every token event of a stream alike: the same id, model, creation time and
    keys, only the text changing. Once an event has proved plain by the full reading, what lies
    before and after its text is kept as a template; a later event that is those bytes around a
    text `_template_safe` admits is plain too, with that text: every scan of `plain_token_text` sees
    in it what it saw in the template's event (the text holds no byte a scan looks for, and no
    key begins or ends inside it), so its answer is the same. Anything else takes the full
    reading, which may make its event the new template. One per stream (bounded: one template)."""

    __slots__ = ("_head", "_tail")

    def __init__(self) -> None:
        self._head = b""  # `data: {...,"text":"` of the template event; b"": none yet
        self._tail = b""  # `",...}\n\n` after its text

    def text(self, raw: bytes) -> str | None:
        head, tail = self._head, self._tail
        if head and len(raw) > len(head) + len(tail) and raw.startswith(head) and raw.endswith(tail):
            mid = raw[len(head):len(raw) - len(tail)]
            if _template_safe(mid):
                try:
                    return mid.decode("utf-8")
                except UnicodeDecodeError:
                    return None  # as plain_token_text: not this path
        got = plain_token_text(raw)
        if got is not None:
            self._learn(raw, got)
        return got

    def _learn(self, raw: bytes, text: str) -> None:
        mid = text.encode("utf-8")
        for key in _TEXT_KEYS:  # where plain_token_text found the text: the first key present
            i = raw.find(key)
            if i >= 0:
                start = i + len(key)
                end = start + len(mid)
                if raw[start:end] == mid and raw[end:end + 1] == b'"' and _template_safe(mid):
                    self._head, self._tail = raw[:start], raw[end:]
                return


def _data_event(text: str) -> SSEEvent:
    if text.strip() == "[DONE]":
        return SSEEvent(text, done=True)
    try:
        obj = json.loads(text)
    except ValueError:
        return SSEEvent(text)
    return SSEEvent(text, obj=obj if isinstance(obj, dict) else None)


def carries_token(choice: Mapping[str, Any]) -> bool:
    """Whether a streamed choice holds output (see TOKEN_DELTA_KEYS; completions: `text`)."""
    if choice.get("text"):
        return True
    delta = choice.get("delta")
    if not isinstance(delta, Mapping):
        return False
    for k in TOKEN_DELTA_KEYS:
        if delta.get(k):
            return True
    return False


def error_message(obj: Mapping[str, Any]) -> str | None:
    """The message of an error chunk (`{"error": {...}}` or `{"error": "..."}`), else None."""
    err = obj.get("error")
    if not err:
        return None
    if isinstance(err, Mapping):
        return str(err.get("message") or "upstream error")
    return str(err)


@dataclass(frozen=True, slots=True)
class UsageCounts:
    """Token counts of a usage object; None where the engine did not say (callers fall back
    to what they counted themselves), cached 0 when not reported."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int = 0


def usage_counts(usage: Mapping[str, Any] | None) -> UsageCounts:
    if not usage:
        return UsageCounts()
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return UsageCounts(_int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens")),
                       _int(cached) or 0)


def _int(v: Any) -> int | None:
    # bool is an int to Python, never a token count
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def usage_of_body(body: bytes) -> dict[str, Any] | None:
    """The `usage` object of a whole (non-stream) JSON answer, None if it has none."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    usage = obj.get("usage") if isinstance(obj, dict) else None
    return usage if isinstance(usage, dict) else None


@dataclass(slots=True)
class StreamStats:
    """What one streamed response showed so far: token chunk times and count, the last usage
    object, the last error message, the last finish reason, whether [DONE] came."""

    first_token_at: float | None = None
    last_token_at: float | None = None
    token_events: int = 0
    usage: dict[str, Any] | None = None
    error: str | None = None
    finish_reason: str | None = None
    done: bool = False

    def observe(self, obj: Mapping[str, Any], now: float) -> bool:
        """Account one chunk; True when it is the usage-only chunk (no choices)."""
        if "error" in obj:
            self.error = error_message(obj) or self.error
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        choices = obj.get("choices")
        if choices:
            token = False
            for c in choices:
                if isinstance(c, Mapping):
                    token = token or carries_token(c)
                    if reason := c.get("finish_reason"):
                        self.finish_reason = str(reason)
            if token:
                if self.first_token_at is None:
                    self.first_token_at = now
                self.last_token_at = now
                self.token_events += 1
            return False
        return isinstance(usage, dict)

    def token(self, now: float) -> None:
        """Account a plain token event (`plain_token_text`): what `observe` would have done."""
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now
        self.token_events += 1

    def account(self, ev: SSEEvent, now: float) -> bool:
        """Account one parsed event ([DONE] or a chunk); True when it is the usage-only chunk."""
        if ev.done:
            self.done = True
            return False
        return ev.obj is not None and self.observe(ev.obj, now)

    def counts(self) -> UsageCounts:
        return usage_counts(self.usage)

    def output_tokens(self) -> int:
        """The engine's completion_tokens; the token chunks counted where it did not report."""
        completion = usage_counts(self.usage).completion_tokens
        return completion if completion is not None else self.token_events


class StreamReader:
    """Splitter + parser + stats for a client that watches a stream (it passes nothing on).

    `feed(data, now)` as bytes arrive, `close(now)` at end of stream. Events after [DONE]
    are ignored; reading goes on past an error event (a well-behaved server still sends
    [DONE] after it), `finished` says when a caller that stops at the first error may stop.
    A data line that is neither [DONE] nor a JSON object is an error here: a benchmark must
    not count a stream it could not read as served."""

    __slots__ = ("stats", "_splitter")

    def __init__(self) -> None:
        self.stats = StreamStats()
        self._splitter = SSESplitter()

    @property
    def finished(self) -> bool:
        return self.stats.done or self.stats.error is not None

    def feed(self, data: bytes, now: float) -> None:
        self._events(self._splitter.feed(data), now)

    def close(self, now: float) -> None:
        """End of the body: an unterminated last event still counts."""
        self._events(self._splitter.flush(), now)

    def _events(self, events: list[bytes], now: float) -> None:
        st = self.stats
        for raw in events:
            if st.done:
                return
            ev = parse_sse_event(raw)
            if ev.malformed:
                st.error = f"unparseable stream chunk {(ev.data or '')[:80]!r}"  # (malformed: data is a str)
            else:
                st.account(ev, now)
