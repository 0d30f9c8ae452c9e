"""`POST /v1/responses`, stateless: the Responses API translated to chat for the engines and back.

The request becomes a chat body (`instructions` → a system message first, `input` text or
messages → `messages`, `max_output_tokens` → `max_tokens`) and then takes the chat path
unchanged: `gateway.requests` builds the profile, admission, routing, fallbacks, the relay
and the reports see a chat request. The answer is translated back: a `response` object, or
for `stream: true` the Responses event stream (`response.created`, `response.in_progress`,
`response.output_item.added`, `response.content_part.added`, `response.output_text.delta`...,
`response.output_text.done`, `response.content_part.done`, `response.output_item.done`,
`response.completed` — or `response.incomplete` when `max_output_tokens` cut it).

Every record the gateway keeps says what the client got: the relay translates a whole answer
before it books it (`ParsedRequest.translate_answer`), and a stream chunk this translation
cannot read is booked through the relay's stream (`RelayStream.unreadable`), as the relay
books an engine answer it cannot read itself: an upstream error, not a success or a client
that left.

Nothing is stored: `store: true`, `previous_response_id` and `background: true` are a 400
naming the field; so is any field this translation does not carry (a Responses client must
not believe a tool or format was honoured when it was dropped).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from fleetcore.fast_replace import replace
from fleetcore.sse import SSESplitter, parse_sse_event
from gateway.auth import Caller
from gateway.errors import GatewayError, bad_request
from gateway.json_body import parse_json_object
from gateway.relay import RelayStream, RelayStreamingResponse
from gateway.requests import ParsedRequest, json_value_cap, parse_request
from gateway.serving import parse_off_loop, parser_args, serve_endpoint

if TYPE_CHECKING:
    from gateway.app import GatewayContext

CHAT_PATH = "/v1/chat/completions"
# Fields carried into the chat body as they are.
_PASSED = ("model", "temperature", "top_p", "user", "metadata", "stream")
_KNOWN = frozenset({*_PASSED, "input", "instructions", "max_output_tokens", "store", "previous_response_id",
                    "background", "text", "parallel_tool_calls", "tools", "tool_choice",
                    "truncation", "service_tier"})
_ROLES = frozenset({"user", "system", "developer", "assistant"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
# Chat-side names in errors from `gateway.requests`, as the Responses client knows them.
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens"}


def _unsupported(name: str, why: str = "is not supported by this gateway") -> GatewayError:
    return bad_request(f"`{name}` {why}.", name, code="unsupported_parameter")


def to_chat_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat body a Responses body stands for; a 400 naming the field it cannot carry."""
    for name in body:
        if name not in _KNOWN:
            raise _unsupported(name)
    if body.get("store") is True:
        raise _unsupported("store", "must be false: the gateway is stateless and stores no responses")
    if body.get("previous_response_id") is not None:
        raise _unsupported("previous_response_id", "is not supported: the gateway is stateless; send the "
                                                   "conversation in `input`")
    if body.get("background") is True:
        raise _unsupported("background", "is not supported: responses are not stored")
    for name in ("tools", "tool_choice", "truncation", "service_tier"):
        v = body.get(name)
        if v not in (None, [], "auto", "disabled", "none"):
            raise _unsupported(name)
    text = body.get("text")
    if text is not None:
        fmt = text.get("format") if isinstance(text, dict) else None
        if not isinstance(text, dict) or set(text) - {"format", "verbosity"} or (
                fmt is not None and fmt != {"type": "text"}):
            raise _unsupported("text", "is supported only as {\"format\": {\"type\": \"text\"}}")
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise bad_request("`metadata` must be an object.", "metadata")  # it is echoed in the response
    chat: dict[str, Any] = {k: body[k] for k in _PASSED if k in body}
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("`instructions` must be a string.", "instructions")
        messages.append({"role": "system", "content": instructions})
    messages += _input_messages(body.get("input"))
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("stream") is True:
        chat["stream_options"] = {"include_usage": True}  # response.completed carries usage
    return chat


def _input_messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise bad_request("`input` is required.", "input")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("`input` must be a string or a non-empty list of messages.", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"`{where}` must be a message object.", where)
        kind = item.get("type", "message")
        if kind != "message":
            raise bad_request(f"`{where}.type` {kind!r} is not supported (only messages).", f"{where}.type",
                              code="unsupported_parameter")
        role = item.get("role")
        if role not in _ROLES:
            raise bad_request(f"`{where}.role` must be one of {sorted(_ROLES)}; got {role!r}.", f"{where}.role")
        out.append({"role": role, "content": _content_text(item.get("content"), f"{where}.content")})
    return out


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"`{where}` must be a string or a list of text parts.", where)
    texts: list[str] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"`{where}[{j}]` must be a text part (input_text); got type {kind!r}.",
                              f"{where}[{j}]", code="unsupported_parameter")
        texts.append(part["text"])
    return "".join(texts)


# --- back: chat → Responses ---

def _usage(u: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not u:
        return None
    details = u.get("prompt_tokens_details")
    cached = details.get("cached_tokens", 0) if isinstance(details, Mapping) else 0
    inp, out = int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    return {"input_tokens": inp, "input_tokens_details": {"cached_tokens": cached or 0},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": inp + out}


class ResponseShape:
    """The response object as it grows: ids, the one message item, status."""

    def __init__(self, body: Mapping[str, Any], model: str) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.body = body
        self.model = model

    def item(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] \
            if status != "in_progress" else []
        return {"id": self.item_id, "type": "message", "status": status, "role": "assistant", "content": content}

    def obj(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
            finish_reason: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "usage": usage, "error": error,
                "incomplete_details": incomplete, "instructions": b.get("instructions"),
                "max_output_tokens": b.get("max_output_tokens"), "metadata": b.get("metadata") or {},
                "temperature": b.get("temperature"), "top_p": b.get("top_p"), "parallel_tool_calls": False,
                "tool_choice": "none", "tools": [], "store": False, "previous_response_id": None,
                "text": {"format": {"type": "text"}}, "truncation": "disabled", "user": b.get("user")}


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def from_chat_completion(chat: Mapping[str, Any], shape: ResponseShape) -> dict[str, Any]:
    choices = chat.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], Mapping) else {}
    message = choice.get("message") if isinstance(choice.get("message"), Mapping) else {}
    text = message.get("content") or ""
    reason = choice.get("finish_reason")
    return shape.obj(_status(reason), [shape.item(text, "completed")], _usage(chat.get("usage")), reason)


class EventStream:
    """Chat completion chunks in, Responses events out (SSE `event:` + `data:`, numbered)."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.seq = 0
        self.text: list[str] = []
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.ended = False

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.shape.item_id, "output_index": 0, "content_index": 0}

    def start(self) -> bytes:
        s = self.shape
        created = s.obj("in_progress", [], None)
        return (self._event("response.created", response=created)
                + self._event("response.in_progress", response=created)
                + self._event("response.output_item.added", output_index=0, item=s.item("", "in_progress"))
                + self._event("response.content_part.added", **self._where(),
                              part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))

    def chunk(self, obj: Mapping[str, Any]) -> bytes:
        if "error" in obj:
            return self.fail(obj["error"])
        out = b""
        if isinstance(obj.get("usage"), Mapping):
            self.usage = _usage(obj["usage"])
        for c in obj.get("choices") or ():
            if not isinstance(c, Mapping):
                continue
            delta = c.get("delta") if isinstance(c.get("delta"), Mapping) else {}
            piece = delta.get("content")
            if piece:
                self.text.append(piece)
                out += self._event("response.output_text.delta", **self._where(), delta=piece, logprobs=[])
            if c.get("finish_reason"):
                self.finish_reason = str(c["finish_reason"])
        return out

    def finish(self) -> bytes:
        if self.ended:
            return b""
        self.ended = True
        s, text = self.shape, "".join(self.text)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        status = _status(self.finish_reason)
        return (self._event("response.output_text.done", **self._where(), text=text, logprobs=[])
                + self._event("response.content_part.done", **self._where(), part=part)
                + self._event("response.output_item.done", output_index=0, item=s.item(text, "completed"))
                + self._event(f"response.{status}",
                              response=s.obj(status, [s.item(text, "completed")], self.usage, self.finish_reason)))

    def fail(self, error: Any) -> bytes:
        """A stream that broke after it started: an `error` event, then `response.failed`."""
        self.ended = True
        err = error if isinstance(error, Mapping) else {"message": str(error)}
        code, message = err.get("code") or "upstream_error", str(err.get("message") or "upstream error")
        s = self.shape
        return (self._event("error", code=code, message=message, param=None)
                + self._event("response.failed", response=s.obj("failed", [], self.usage,
                                                                error={"code": code, "message": message})))


def translated_answer(shape: ResponseShape, chat_answer: bytes) -> bytes:
    """A whole chat answer's bytes as the `response` object's; raises on one of a shape no
    translation expects (not JSON, `"choices": 5`), which the relay books as the engine's failure
    and answers with a 502 naming the instance (`ParsedRequest.translate_answer`)."""
    return json.dumps(from_chat_completion(json.loads(chat_answer), shape), separators=(",", ":")).encode()


async def translate_stream(chat_bytes: AsyncIterator[bytes], events: EventStream,
                           relayed: RelayStream) -> AsyncIterator[bytes]:
    """`chat_bytes`, the relay's stream of `relayed`, as Responses events."""
    splitter = SSESplitter()
    yield events.start()
    async for data in chat_bytes:
        out = b""
        try:
            for raw in splitter.feed(data):
                ev = parse_sse_event(raw)
                if ev.done:
                    out += events.finish()
                elif ev.obj is not None and not events.ended:
                    out += events.chunk(ev.obj)
        except Exception as e:
            # A chunk this translation cannot read (an engine's `"prompt_tokens": "many"`), or a bug:
            # the stream still ends with `error` and `response.failed`, booked as the relay books a
            # stream it cannot read. Raised on, the client's connection was cut mid-body with
            # neither; ended here without booking it, the relay took it for a client that left.
            f = relayed.unreadable(e)
            yield out + events.fail({"code": f.code, "message": f.public})
            return
        if out:
            yield out
    if not events.ended:  # the chat stream ended without [DONE]: say so rather than truncate
        yield events.fail({"code": "upstream_error", "message": "the engine's stream ended early"})


# --- the endpoint ---

def _client_param(e: GatewayError) -> GatewayError:
    """Errors from the chat parser, renamed to the Responses field the client sent."""
    if e.param:
        head, dot, rest = e.param.partition(".")
        base, bracket, idx = head.partition("[")
        if base in _PARAMS:
            e.param = _PARAMS[base] + bracket + idx + dot + rest
            e.message = e.message.replace(f"`{base}", f"`{_PARAMS[base]}")
    return e


async def serve_responses(ctx: GatewayContext, request: Request) -> Response:
    # Traced and access-logged like chat (gateway.telemetry), as operation "responses".
    body: dict[str, Any] | None = None
    chat_raw = b""
    shape: ResponseShape | None = None

    async def parse(caller: Caller, rid: str, model: str | None) -> ParsedRequest:
        nonlocal body, chat_raw, shape
        if body is None:  # the Responses body, read and translated to chat once
            body = parse_json_object(await request.body(), max_depth=ctx.config.gateway.max_json_depth,
                                     max_values=json_value_cap(ctx.config))
            chat_raw = json.dumps(to_chat_body(body), separators=(",", ":")).encode()
            shape = ResponseShape(body, str(body.get("model")))  # the name the client asked for, alias or not
        assert shape is not None  # made with the body
        try:
            parsed = await parse_off_loop(ctx, parse_request, chat_raw, "chat",
                                          **parser_args(ctx, request, caller, rid, model))
        except GatewayError as e:
            raise _client_param(e) from None
        # A whole answer is translated by the relay, before it books it (an untranslatable one is a failure).
        return replace(parsed, translate_answer=partial(translated_answer, shape))

    resp = await serve_endpoint(ctx, request, "responses", CHAT_PATH, parse)
    assert shape is not None  # parsed before anything was served
    if isinstance(resp, RelayStreamingResponse):
        # The relay's stream: usage, SLO and report accounting happen there, on the chat chunks;
        # a chunk this translation cannot read is booked through it too.
        resp.body_iterator = translate_stream(resp.body_iterator, EventStream(shape), resp.relay_stream)
    return resp  # a whole answer: the relay's, translated (errors are OpenAI-shaped already)
