"""Request parsing and response builders of the simulated worker: OpenAI and SGLang wire shapes.

Pure functions and small classes, no I/O. The worker turns a JSON body into a
`GenRequest` (prompt token ids + an output plan) and renders engine progress
with one of the `*Wire` formatters. Shapes follow OpenAI (as vLLM serves them);
errors use vLLM's body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import base64
import json
import math
import sys
import time
import uuid
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import xxhash

from fleetcore.sse import SSE_DONE  # re-exported for the worker
from fleetcore.tokens import encode, pseudo_word, render_chat

# Natural (EOS) output length range when the client does not force one.
NATURAL_MIN_TOKENS = 16
NATURAL_SPAN = 257  # natural length in 16..272
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
# The fake EOS id reported by /generate's finish_reason {"type": "stop", "matched": id}.
EOS_TOKEN_ID = 2
_MAX_TOKEN_ID = 1 << 32  # block hashing packs ids as uint32
MAX_N = 128  # OpenAI's limit on `n`
MAX_TOP_LOGPROBS = 20  # vLLM's default max_logprobs (OpenAI: 20 for chat, 5 for completions)


class ApiError(Exception):
    """An error answered to the client as an OpenAI-style error body."""

    def __init__(self, status: int, message: str, type_: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_ or {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


# -- parsing ------------------------------------------------------------------


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw or b"null")
    except RecursionError:  # (thousands of nested brackets: json.loads recurses; a 400, not a 500)
        raise bad_request("Invalid JSON body: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object")
    return body


def _opt_int(body: Mapping[str, Any], key: str, minimum: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"`{key}` must be an integer", key)
    if v < minimum:
        raise bad_request(f"`{key}` must be at least {minimum}, got {v}", key)
    return v


def _opt_bool(body: Mapping[str, Any], key: str, default: bool = False) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"`{key}` must be a boolean", key)
    return v


def _token_ids(v: Any, param: str) -> list[int] | None:
    """`v` as a token id list, None if it is not a list of ints."""
    if not isinstance(v, list) or not v or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return None
    if any(t < 0 or t >= _MAX_TOKEN_ID for t in v):
        raise bad_request("token ids must be in [0, 2^32)", param)
    return v


def completion_prompt_ids(body: Mapping[str, Any]) -> list[int]:
    """Prompt token ids of a /v1/completions body: str, [str] (one), [int], or [[int]] (one)."""
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("`prompt` is required", "prompt")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        ids = encode(p)
    else:
        ids = _token_ids(p, "prompt")
        if ids is None:
            if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
                raise bad_request("batched prompts are not supported: send one prompt per request", "prompt")
            raise bad_request("`prompt` must be a string, a list of one string, or a list of token ids", "prompt")
    if not ids:
        raise bad_request("`prompt` is empty", "prompt")
    return ids


def chat_prompt_ids(body: Mapping[str, Any]) -> list[int]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("`messages` must be a non-empty list", "messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string `role`", "messages")
    try:
        return encode(render_chat(msgs))
    except TypeError as exc:
        raise bad_request(str(exc), "messages") from None


def generate_prompt_ids(body: Mapping[str, Any]) -> list[int]:
    """SGLang /generate: `text` or `input_ids` (one prompt)."""
    if body.get("input_ids") is not None:
        ids = body["input_ids"]
        if isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], list):
            ids = ids[0]
        out = _token_ids(ids, "input_ids")
        if out is None:
            raise bad_request("`input_ids` must be a list of token ids", "input_ids")
        return out
    text = body.get("text")
    if isinstance(text, list) and len(text) == 1:
        text = text[0]
    if not isinstance(text, str) or not text:
        raise bad_request("`text` or `input_ids` is required", "text")
    ids = encode(text)
    if not ids:
        raise bad_request("`text` is empty", "text")
    return ids


def output_seed(prompt_ids: list[int], user_seed: int | None = None) -> int:
    """Seed of the output words: a function of the prompt content (and the client's seed)."""
    return xxhash.xxh64_intdigest(array("I", prompt_ids).tobytes(), seed=(user_seed or 0) & 0xFFFFFFFFFFFFFFFF)


def output_text(seed: int, start: int, count: int, lstrip_first: bool = False) -> str:
    """Words start..start+count-1 of the output (one word = one token).

    Words carry their leading space (a continuation reads naturally); a chat
    answer strips the space of its very first word.
    """
    text = "".join(pseudo_word(seed, i) for i in range(start, start + count))
    return text.lstrip() if lstrip_first and start == 0 else text


@dataclass(frozen=True, slots=True)
class OutputPlan:
    output_len: int  # exactly the tokens the engine will generate
    finish_reason: str  # "stop" (natural end) or "length" (hit the cap)
    seed: int


def plan_output(prompt_ids: list[int], max_model_len: int, max_tokens: int | None = None,
                min_tokens: int = 0, ignore_eos: bool = False, user_seed: int | None = None) -> OutputPlan:
    """How many tokens a request generates and why it stops (deterministic in the prompt).

    Raises the vLLM context-length 400 when prompt + max_tokens exceeds max_model_len.
    """
    n_prompt = len(prompt_ids)
    if max_tokens is not None and n_prompt + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{n_prompt + max_tokens} tokens ({n_prompt} in the messages, {max_tokens} in the completion). "
            f"Please reduce the length of the messages or completion.", "max_tokens")
    room = max_model_len - n_prompt
    if room < 1:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{n_prompt} input tokens. Please reduce the length of the input messages.", "messages")
    cap = room if max_tokens is None else max_tokens
    if min_tokens > cap:
        raise bad_request(f"min_tokens ({min_tokens}) must be less than or equal to max_tokens ({cap})",
                          "min_tokens")
    seed = output_seed(prompt_ids, user_seed)
    natural = NATURAL_MIN_TOKENS + seed % NATURAL_SPAN
    stop_at = cap + 1 if ignore_eos else max(natural, min_tokens)
    if stop_at <= cap:
        return OutputPlan(stop_at, "stop", seed)
    return OutputPlan(cap, "length", seed)


@dataclass(frozen=True, slots=True)
class GenRequest:
    """A validated generation request, whatever endpoint it came from."""

    kind: str  # "chat" | "completion" | "generate"
    request_id: str  # engine id (X-Request-Id or generated); also what /abort_request takes
    response_id: str  # id in the response body
    model: str
    prompt_ids: list[int]
    plan: OutputPlan  # choice 0's plan (the only one for n=1 and /generate)
    stream: bool
    include_usage: bool
    created: int
    # One plan per choice (`n`); choice i > 0 is seeded with the client's seed + i, so each
    # choice is deterministic and choice 0 is what the same request with n=1 answers.
    plans: tuple[OutputPlan, ...] = ()
    # Top alternatives per token when the client asked for logprobs (0: the chosen token's
    # logprob only); None: no logprobs.
    logprobs: int | None = None

    @property
    def n(self) -> int:
        return len(self.plans) or 1

    def choice_plans(self) -> tuple[OutputPlan, ...]:
        return self.plans or (self.plan,)


def new_request_id() -> str:
    return uuid.uuid4().hex


def parse_openai(kind: str, body: Mapping[str, Any], served_model: str, max_model_len: int,
                 request_id: str | None, default_seed: int = 0) -> GenRequest:
    """Validate a /v1/completions or /v1/chat/completions body."""
    model = body.get("model")
    if model is not None and model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", param="model")
    if kind == "chat":
        ids = chat_prompt_ids(body)
        max_tokens = _opt_int(body, "max_completion_tokens", 1)
        if max_tokens is None:
            max_tokens = _opt_int(body, "max_tokens", 1)
    else:
        ids = completion_prompt_ids(body)
        max_tokens = _opt_int(body, "max_tokens", 1)
        # Not implemented here: refused, never silently ignored.
        if _opt_bool(body, "echo"):
            raise bad_request("`echo` is not supported by the simulated engine", "echo")
        if body.get("suffix") is not None:
            raise bad_request("`suffix` is not supported by the simulated engine", "suffix")
    n = _opt_int(body, "n", 1) or 1
    if n > MAX_N:
        raise bad_request(f"`n` must be at most {MAX_N}, got {n}", "n")
    logprobs = _logprobs_request(kind, body)
    stream = _opt_bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad_request("`stream_options` must be an object", "stream_options")
    if opts and not stream:
        raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
    include_usage = bool(opts and opts.get("include_usage"))
    seed = _opt_int(body, "seed", -(1 << 63))
    seed = default_seed if seed is None else seed
    min_toks, ignore_eos = _opt_int(body, "min_tokens", 0) or 0, _opt_bool(body, "ignore_eos")
    plans = tuple(plan_output(ids, max_model_len, max_tokens, min_toks, ignore_eos, seed + i) for i in range(n))
    rid = request_id or new_request_id()
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    return GenRequest(kind, rid, prefix + rid, served_model, ids, plans[0], stream, include_usage,
                      int(time.time()), plans, logprobs)


def _logprobs_request(kind: str, body: Mapping[str, Any]) -> int | None:
    """Chat: `logprobs: bool` + `top_logprobs` (0..20); completions: `logprobs: int` (0..MAX)."""
    if kind == "chat":
        top = _opt_int(body, "top_logprobs", 0)
        if top is not None and top > MAX_TOP_LOGPROBS:
            raise bad_request(f"`top_logprobs` must be at most {MAX_TOP_LOGPROBS}", "top_logprobs")
        if not _opt_bool(body, "logprobs"):
            if top is not None:
                raise bad_request("`top_logprobs` requires `logprobs` to be true", "top_logprobs")
            return None
        return top or 0
    v = body.get("logprobs")
    if v is None or v is False:
        return None
    k = _opt_int(body, "logprobs", 0)
    if k is not None and k > MAX_TOP_LOGPROBS:
        raise bad_request(f"`logprobs` must be at most {MAX_TOP_LOGPROBS}", "logprobs")
    return k


def parse_generate(body: Mapping[str, Any], served_model: str, max_model_len: int,
                   request_id: str | None, default_seed: int = 0) -> GenRequest:
    """Validate an SGLang /generate body."""
    ids = generate_prompt_ids(body)
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise bad_request("`sampling_params` must be an object", "sampling_params")
    max_new = _opt_int(sp, "max_new_tokens", 1)
    seed = _opt_int(sp, "sampling_seed", -(1 << 63))
    plan = plan_output(ids, max_model_len, SGLANG_DEFAULT_MAX_NEW_TOKENS if max_new is None else max_new,
                       _opt_int(sp, "min_new_tokens", 0) or 0, _opt_bool(sp, "ignore_eos"),
                       default_seed if seed is None else seed)
    rid = body.get("rid") if isinstance(body.get("rid"), str) else None
    rid = rid or request_id or new_request_id()
    return GenRequest("generate", rid, rid, served_model, ids, plan, _opt_bool(body, "stream"), False,
                      int(time.time()))


# -- responses ----------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def sse(obj: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"




def _lp_hash(seed: int, i: int, k: int) -> int:
    return xxhash.xxh64_intdigest(f"{i}:{k}".encode(), seed=seed & 0xFFFFFFFFFFFFFFFF)


def token_logprobs(seed: int, start: int, texts: list[str], top: int) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """Deterministic logprobs of output tokens start.. (their texts given): per token
    (text, logprob, top alternatives). The chosen token leads its own top list (the most
    likely token, as at temperature 0) and alternatives are strictly less likely, so the
    values are well-formed: all <= 0, tops sorted, no duplicate tokens."""
    out: list[tuple[str, float, list[tuple[str, float]]]] = []
    for j, text in enumerate(texts):
        i = start + j
        lp = -(_lp_hash(seed, i, 0) % 4096) / 8192.0  # in (-0.5, 0]
        tops: list[tuple[str, float]] = [(text, lp)] if top > 0 else []
        seen, k = {text}, 0
        while len(tops) < top and k < 4 * top + 8:
            k += 1
            alt = pseudo_word(seed ^ _lp_hash(seed, i, k), i)
            if alt in seen:
                continue
            seen.add(alt)
            tops.append((alt, tops[-1][1] - 0.5 - (_lp_hash(seed, i, k) % 1024) / 2048.0))
        out.append((text, lp, tops))
    return out


def _entry(token: str, lp: float) -> dict[str, Any]:
    return {"token": token, "logprob": lp, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(items: list[tuple[str, float, list[tuple[str, float]]]]) -> dict[str, Any]:
    """OpenAI chat `choices[].logprobs`: {"content": [{token, logprob, bytes, top_logprobs}], "refusal"}."""
    return {"content": [{**_entry(t, lp), "top_logprobs": [_entry(a, alp) for a, alp in tops]}
                        for t, lp, tops in items], "refusal": None}


def completion_logprobs(items: list[tuple[str, float, list[tuple[str, float]]]], offset: int) -> dict[str, Any]:
    """OpenAI completions `choices[].logprobs`: parallel lists; text_offset counts from `offset`."""
    offsets: list[int] = []
    for t, _, _ in items:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": [t for t, _, _ in items], "token_logprobs": [lp for _, lp, _ in items],
            "top_logprobs": [dict(tops) for _, _, tops in items], "text_offset": offsets}


@dataclass(frozen=True, slots=True)
class ChoiceOut:
    """One finished choice of a whole (non-stream) answer."""

    text: str
    reason: str
    seed: int = 0  # its output seed, for logprobs
    tokens: int = 0


def _choice_texts(seed: int, count: int, chat: bool) -> list[str]:
    """The output's tokens one by one (they concatenate to the choice's text)."""
    return [output_text(seed, i, 1, lstrip_first=chat) for i in range(count)]


class ChatWire:
    """chat.completion / chat.completion.chunk."""

    def __init__(self, req: GenRequest) -> None:
        self.req = req
        self._usage_null = req.include_usage  # OpenAI: every chunk has "usage": null then
        self._pos = [0] * req.n  # tokens streamed so far, per choice

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None, index: int = 0,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        out = {"id": self.req.response_id, "object": "chat.completion.chunk", "created": self.req.created,
               "model": self.req.model,
               "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
        if self._usage_null:
            out["usage"] = None
        return out

    def start(self) -> list[dict[str, Any]]:
        return [self._chunk({"role": "assistant", "content": ""}, None, i) for i in range(self.req.n)]

    def delta(self, text: str, n_tokens: int = 1, index: int = 0) -> dict[str, Any]:
        lp = None
        if self.req.logprobs is not None:
            seed = self.req.choice_plans()[index].seed
            lp = chat_logprobs(token_logprobs(seed, self._pos[index], [text], self.req.logprobs))
        self._pos[index] += n_tokens
        return self._chunk({"content": text}, None, index, lp)

    def finish(self, reason: str, cached: int = 0, e2e: float | None = None, index: int = 0) -> dict[str, Any]:
        return self._chunk({}, reason, index)

    def usage_chunk(self, u: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.req.response_id, "object": "chat.completion.chunk", "created": self.req.created,
                "model": self.req.model, "choices": [], "usage": u}

    def full(self, choices: list[ChoiceOut], u: dict[str, Any], e2e: float | None = None) -> dict[str, Any]:
        out = []
        for i, c in enumerate(choices):
            lp = None
            if self.req.logprobs is not None:
                texts = _choice_texts(c.seed, c.tokens, True)
                lp = chat_logprobs(token_logprobs(c.seed, 0, texts, self.req.logprobs))
            out.append({"index": i, "message": {"role": "assistant", "content": c.text, "tool_calls": []},
                        "logprobs": lp, "finish_reason": c.reason, "stop_reason": None})
        return {"id": self.req.response_id, "object": "chat.completion", "created": self.req.created,
                "model": self.req.model, "choices": out, "usage": u}


class CompletionWire:
    """text_completion (streamed chunks share the object name, as OpenAI does)."""

    def __init__(self, req: GenRequest) -> None:
        self.req = req
        self._usage_null = req.include_usage
        self._pos = [0] * req.n
        self._offset = [0] * req.n  # characters streamed so far, per choice (text_offset)

    def _chunk(self, text: str, finish_reason: str | None, index: int = 0,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        out = {"id": self.req.response_id, "object": "text_completion", "created": self.req.created,
               "model": self.req.model,
               "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}
        if self._usage_null:
            out["usage"] = None
        return out

    def start(self) -> list[dict[str, Any]]:
        return []

    def delta(self, text: str, n_tokens: int = 1, index: int = 0) -> dict[str, Any]:
        lp = None
        if self.req.logprobs is not None:
            seed = self.req.choice_plans()[index].seed
            lp = completion_logprobs(token_logprobs(seed, self._pos[index], [text], self.req.logprobs),
                                     self._offset[index])
        self._pos[index] += n_tokens
        self._offset[index] += len(text)
        return self._chunk(text, None, index, lp)

    def finish(self, reason: str, cached: int = 0, e2e: float | None = None, index: int = 0) -> dict[str, Any]:
        return self._chunk("", reason, index)

    def usage_chunk(self, u: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.req.response_id, "object": "text_completion", "created": self.req.created,
                "model": self.req.model, "choices": [], "usage": u}

    def full(self, choices: list[ChoiceOut], u: dict[str, Any], e2e: float | None = None) -> dict[str, Any]:
        out = []
        for i, c in enumerate(choices):
            lp = None
            if self.req.logprobs is not None:
                texts = _choice_texts(c.seed, c.tokens, False)
                lp = completion_logprobs(token_logprobs(c.seed, 0, texts, self.req.logprobs), 0)
            out.append({"index": i, "text": c.text, "logprobs": lp, "finish_reason": c.reason,
                        "stop_reason": None})
        return {"id": self.req.response_id, "object": "text_completion", "created": self.req.created,
                "model": self.req.model, "choices": out, "usage": u}


class GenerateWire:
    """SGLang /generate: each streamed chunk carries the cumulative text, as SGLang does."""

    # SGLang's stream has no usage chunk; the last chunk's meta_info carries the counts.

    def __init__(self, req: GenRequest) -> None:
        self.req = req
        self._text = ""
        self._n = 0

    def _meta(self, reason: str | None, cached: int = 0, e2e: float | None = None) -> dict[str, Any]:
        fr: dict[str, Any] | None = None
        if reason == "length":
            fr = {"type": "length", "length": self._n}
        elif reason == "abort":
            fr = {"type": "abort", "message": "request aborted"}
        elif reason is not None:
            fr = {"type": "stop", "matched": EOS_TOKEN_ID}
        meta: dict[str, Any] = {"id": self.req.response_id, "finish_reason": fr,
                                "prompt_tokens": len(self.req.prompt_ids), "completion_tokens": self._n,
                                "cached_tokens": cached}
        if e2e is not None:
            meta["e2e_latency"] = e2e
        return meta

    def start(self) -> list[dict[str, Any]]:
        return []

    def usage_chunk(self, u: dict[str, Any]) -> dict[str, Any] | None:
        return None

    def delta(self, text: str, n_tokens: int = 1, index: int = 0) -> dict[str, Any]:
        self._text += text
        self._n += n_tokens
        return {"text": self._text, "meta_info": self._meta(None)}

    def finish(self, reason: str, cached: int = 0, e2e: float | None = None, index: int = 0) -> dict[str, Any]:
        return {"text": self._text, "meta_info": self._meta(reason, cached, e2e)}

    def full(self, choices: list[ChoiceOut], u: dict[str, Any], e2e: float | None = None) -> dict[str, Any]:
        text, reason = choices[0].text, choices[0].reason
        self._text = text
        self._n = u["completion_tokens"]
        return {"text": text, "meta_info": self._meta(reason, u["prompt_tokens_details"]["cached_tokens"], e2e)}


# -- embeddings ---------------------------------------------------------------------

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on inputs per request


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    request_id: str
    model: str
    inputs: list[list[int]]  # token ids per input
    dimensions: int  # what the client asked for (<= the model's): a truncated, renormalised vector
    base64: bool
    model_dim: int = 0


def parse_embeddings(body: Mapping[str, Any], served_model: str, max_model_len: int, dim: int,
                     request_id: str | None) -> EmbeddingRequest:
    """/v1/embeddings: `input` as a string, strings, token ids or lists of token ids."""
    model = body.get("model")
    if model is not None and model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", param="model")
    raw = body.get("input")
    if raw is None:
        raise bad_request("`input` is required", "input")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw)):
        raw = [raw]
    if not isinstance(raw, list) or not raw or len(raw) > MAX_EMBEDDING_INPUTS:
        raise bad_request(f"`input` must be a string, token ids, or a list of 1..{MAX_EMBEDDING_INPUTS} of them",
                          "input")
    inputs: list[list[int]] = []
    for i, item in enumerate(raw):
        ids = encode(item) if isinstance(item, str) else _token_ids(item, f"input[{i}]")
        if not ids:
            raise bad_request(f"`input[{i}]` must be a non-empty string or list of token ids", f"input[{i}]")
        if len(ids) >= max_model_len:
            raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, "
                              f"input[{i}] has {len(ids)} tokens.", f"input[{i}]")
        inputs.append(ids)
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise bad_request("`encoding_format` must be `float` or `base64`", "encoding_format")
    dims = _opt_int(body, "dimensions", 1)
    if dims is not None and dims > dim:
        raise bad_request(f"`dimensions` must be at most {dim} for this model", "dimensions")
    return EmbeddingRequest(request_id or new_request_id(), served_model, inputs, dims or dim, fmt == "base64", dim)


def embedding_vector(ids: list[int], dim: int, keep: int | None = None) -> list[float]:
    """A deterministic unit vector of the input's content (equal inputs, equal vectors); `keep`
    truncates it to its first components, renormalised, as OpenAI's `dimensions` does."""
    seed = xxhash.xxh64_intdigest(array("I", ids).tobytes())
    vals = [((xxhash.xxh64_intdigest(i.to_bytes(4, "little"), seed=seed) >> 11) / float(1 << 53)) * 2.0 - 1.0
            for i in range(dim)][:keep]
    norm = math.sqrt(sum(v * v for v in vals)) or 1.0
    return [v / norm for v in vals]


def embeddings_body(req: EmbeddingRequest) -> dict[str, Any]:
    data = []
    for i, ids in enumerate(req.inputs):
        vec = embedding_vector(ids, req.model_dim or req.dimensions, req.dimensions)
        value: Any = vec
        if req.base64:  # OpenAI's base64: little-endian float32
            packed = array("f", vec)
            if sys.byteorder == "big":
                packed.byteswap()
            value = base64.b64encode(packed.tobytes()).decode()
        data.append({"object": "embedding", "index": i, "embedding": value})
    n = sum(len(ids) for ids in req.inputs)
    return {"object": "list", "model": req.model, "data": data,
            "usage": {"prompt_tokens": n, "total_tokens": n}}
