"""Continuing a stream on another instance: what the relay keeps of a stream, the continuation
request it sends, and how the new stream is spliced into the client's.

The rules (who may be continued, the limits, the continuation's routing profile) are
`fleetcore.continuation`'s, shared with the simulator; this module does the live gateway's
part of it:

- `SentText` keeps what the client has been sent of choice 0 (its text), plus the chunk
  `id`, `created` and `model` the client saw, so the spliced stream keeps one `id`.
- `Continuation` is one request's state across its legs. `next_leg` builds the next leg:
  the original prompt's token ids (re-tokenized exactly as routing tokenized them,
  `gateway.requests`) followed by the token ids of the text sent so far (re-tokenized with
  the model's tokenizer), the remaining `max_tokens`, the same sampling parameters and seed.
- Every leg after the first goes to `/v1/completions` with the prompt as token ids, for chat
  too: token ids are what the engine would have seen (no chat template applied a second time,
  no BOS added twice, no boundary re-tokenization of the prompt), vLLM, SGLang and the sim
  worker all take them, and a prefix-caching engine that holds the prompt re-prefills only the
  tail. `splice` turns that leg's `text_completion` chunks into the client's format (chat
  deltas or completion chunks) under the first leg's `id`, and its usage chunk into one usage
  for the whole response: `completion_tokens` counts every generated token; the tokens the
  continuations re-prefilled are in `usage.tokenfleet_reprefill_tokens` (headers are long sent
  on a stream) and in the metric.
- A request is continued only where a continuation equals an uninterrupted run in
  distribution (`fleetcore.continuation.refusal`) and the gateway can rebuild the engine's
  prompt exactly: it needs the model's own tokenizer, or the built-in one for a model served
  only by simulated engines (`no_tokenizer`); a chat template chosen per request
  (`chat_template`, `chat_template_kwargs`) or a batch of prompts are refused too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from fleetcore.continuation import (ContinuationLimits, ContinuationReason, Faithfulness, continuation_profile,
                                    refusal, remaining_budget)
from fleetcore.fleet_config import FleetConfig
from fleetcore.model_tokenizer import PromptTokenizer
from fleetcore.prefix import block_hashes
from fleetcore.sse import SSE_DONE, SSEEvent, SSESplitter, parse_sse_event, usage_counts
from fleetcore.types import RequestProfile
# the very functions that tokenized the prompt for routing: the continuation's ids equal them
from gateway.openai_fields import PD_LEG_FIELDS  # a P/D decode leg's body carries them
from gateway.requests import ParsedRequest
from gateway.requests import _chat_prompt_ids as chat_prompt_ids
from gateway.requests import _completion_prompt_ids as completion_prompt_ids
from gateway.tokenize_pool import builtin_encode_upto

CONTINUATION_PATH = "/v1/completions"
CONTINUED_HEADER = "x-tokenfleet-continued"

# Fields of a chat body that have no meaning for /v1/completions (or that the continuation
# sets itself); everything else — sampling parameters, seed, stop, engine extras such as
# `ignore_eos` — is sent again unchanged.
_CHAT_ONLY = frozenset({
    "messages", "max_completion_tokens", "tools", "tool_choice", "functions", "function_call",
    "parallel_tool_calls", "response_format", "logprobs", "top_logprobs", "modalities", "audio",
    "reasoning_effort", "store", "metadata", "prediction", "web_search_options", "service_tier",
    "add_generation_prompt", "continue_final_message", "documents", "chat_template",
    "chat_template_kwargs"})
# A disaggregated request's leg fields (`PD_LEG_FIELDS`, set by gateway.pd_flow on its decode leg's
# body): they name one prefill's KV, which a continuation leg re-prefills instead.
# Constrained decoding holds a parser state a continuation cannot resume from text.
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
           "json_schema", "regex", "ebnf")


def faithfulness(parsed: ParsedRequest) -> Faithfulness:
    body = parsed.body
    if parsed.kind == "chat":
        logprobs = bool(body.get("logprobs")) or body.get("top_logprobs") is not None
    else:
        v = body.get("logprobs")
        logprobs = v is not None and v is not False  # `logprobs: 0` asks for the chosen token's (0 == False)
    fmt = body.get("response_format")
    constrained = (bool(body.get("tools")) or bool(body.get("functions"))
                   or (isinstance(fmt, Mapping) and fmt.get("type") not in (None, "text"))
                   or any(body.get(k) is not None for k in _GUIDED))
    return Faithfulness(n=parsed.profile.n, logprobs=logprobs, constrained=constrained,
                        echo=parsed.kind == "completion" and bool(body.get("echo")))


def static_refusal(parsed: ParsedRequest, tokenizer_known: bool, limits: ContinuationLimits) -> str | None:
    """Why this request can never be continued (None: it may be, within the limits)."""
    first = refusal(faithfulness(parsed), continuations_done=0, generated_tokens=0, prompt_tokens=0,
                    remaining_tokens=None, limits=limits)
    if first is not None:
        return first
    if parsed.kind not in ("chat", "completion"):
        return "endpoint"
    body = parsed.body
    if parsed.kind == "chat" and (body.get("chat_template") is not None or body.get("chat_template_kwargs")):
        return "chat_template"
    prompt = body.get("prompt")
    if parsed.kind == "completion" and isinstance(prompt, list) and len(prompt) > 1 and not all(
            isinstance(t, int) for t in prompt):
        return "batch"
    if not tokenizer_known:
        return "no_tokenizer"
    return None


def strip_token_ids(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A chunk without the token ids the gateway asked for on its own behalf."""
    out = dict(obj)
    out["choices"] = [{k: v for k, v in c.items() if k not in ("token_ids", "prompt_token_ids")}
                      if isinstance(c, Mapping) else c for c in obj.get("choices") or ()]
    out.pop("prompt_token_ids", None)
    return out


def engine_gives_ids(config: FleetConfig, model: str) -> bool:
    """Whether every engine of `model` streams its token ids when asked (vLLM: `return_token_ids`)."""
    adapters = {d.adapter for d in config.deployments if d.model == model}
    return adapters == {"vllm"}


def continuation_tokenizer(config: FleetConfig, model: str,
                           tokenizers: Mapping[str, PromptTokenizer]) -> tuple[bool, PromptTokenizer | None]:
    """(usable, tokenizer): the model's own tokenizer; else the built-in one (None) where it is
    exact, i.e. every deployment of the model is the simulated engine; else not usable."""
    tok = tokenizers.get(model)
    if tok is not None:
        return True, tok
    adapters = {d.adapter for d in config.deployments if d.model == model}
    return adapters == {"sim"}, None


def generated_ids(text: str, tok: PromptTokenizer | None) -> list[int]:
    """Token ids of generated text, as the engine appends them (no special tokens)."""
    if not text:
        return []
    if tok is None:  # (every piece holds a character: a limit of len(text) keeps them all)
        return builtin_encode_upto(text, len(text))
    plain = getattr(tok, "plain_ids", None)
    if plain is None:
        raise TypeError(f"{type(tok).__name__} cannot tokenize generated text")
    return list(plain(text))


def prompt_ids(parsed: ParsedRequest, tok: PromptTokenizer | None) -> list[int]:
    """The prompt's token ids exactly as routing computed them (`gateway.requests`)."""
    limit = parsed.model.engine.max_model_len
    if parsed.kind == "chat":
        return chat_prompt_ids(parsed.body, tok, limit)
    return completion_prompt_ids(parsed.body, tok, limit)


@dataclass(slots=True)
class SentText:
    """What the client has been sent of choice 0, and the ids it saw."""

    chat: bool
    parts: list[str] = field(default_factory=list)
    id: str | None = None
    created: int | None = None
    model: str | None = None
    finished: bool = False  # a finish_reason went by: the answer is whole
    unfaithful: str | None = None  # output a continuation cannot rebuild (tool calls, reasoning)
    # The engine's own token ids of that text, where every chunk carried them (vLLM's
    # `return_token_ids`); else the text is re-tokenized.
    ids: list[int] = field(default_factory=list)
    ids_complete: bool = True

    def add(self, text: str, token_ids: Any) -> None:
        if text:
            self.parts.append(text)
        if isinstance(token_ids, list) and all(isinstance(t, int) for t in token_ids):
            self.ids.extend(token_ids)
        elif text:
            self.ids_complete = False

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def observe(self, obj: Mapping[str, Any]) -> None:
        """A chunk of the first leg, as the engine sent it."""
        if self.id is None and isinstance(obj.get("id"), str):
            self.id = obj["id"]
            self.created = obj.get("created") if isinstance(obj.get("created"), int) else None
            self.model = obj.get("model") if isinstance(obj.get("model"), str) else None
        for c in obj.get("choices") or ():
            if not isinstance(c, Mapping) or c.get("index", 0) != 0:
                continue
            if self.chat:
                delta = c.get("delta")
                if isinstance(delta, Mapping):
                    if delta.get("tool_calls") or delta.get("function_call"):
                        self.unfaithful = "tool_calls"
                    elif delta.get("reasoning_content") or delta.get("reasoning"):
                        self.unfaithful = "reasoning"  # the raw text (think tags) is the engine's
                    text = delta.get("content")
                    self.add(text if isinstance(text, str) else "", c.get("token_ids"))
            else:
                text = c.get("text")
                self.add(text if isinstance(text, str) else "", c.get("token_ids"))
            if c.get("finish_reason"):
                self.finished = True


@dataclass(frozen=True, slots=True)
class Leg:
    """One continuation leg to send: where routing may look, and the body."""

    profile: RequestProfile
    body: Mapping[str, Any]  # without `model`: the chosen instance's served name goes in
    generated_tokens: int  # sent to the client before this leg
    prompt_tokens: int  # what this leg re-prefills (prompt + generated tail)

    def encoded(self, served_model: str) -> bytes:
        return json.dumps({**self.body, "model": served_model}, separators=(",", ":")).encode()


class ContinuationMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "tokenfleet_continuations", "Streams whose engine failed after the first byte, by why and what "
            "the gateway did (continued, failed, or the refusal reason)", ["reason", "outcome"], registry=registry)
        self.reprefill = Counter("tokenfleet_reprefill_tokens", "Prompt + generated tokens continuations sent "
                                 "to be prefilled again", ["model"], registry=registry)
        self.reprefill_cached = Counter("tokenfleet_reprefill_cached_tokens", "Of those, tokens the engine "
                                        "served from its prefix cache", ["model"], registry=registry)
        self.gap = Histogram("tokenfleet_continuation_gap_seconds", "Last token before the failure to the first "
                             "token of the continuation (detection + choice + re-prefill)", ["reason"],
                             buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 30, 60), registry=registry)


class Continuation:
    """One streamed request's continuation state over its legs."""

    def __init__(self, parsed: ParsedRequest, limits: ContinuationLimits, tok: PromptTokenizer | None,
                 engine_ids: bool = False) -> None:
        self.parsed = parsed
        # ask the engine for its token ids (vLLM's `return_token_ids`), unless the client did: then
        # the gateway strips them from what it relays
        self.engine_ids = engine_ids and parsed.body.get("return_token_ids") is None
        self.limits = limits
        self.tok = tok
        self.sent = SentText(chat=parsed.kind == "chat")
        self.done = 0  # continuations sent
        self.excluded: list[str] = []  # instances that failed this request
        self.reprefill_tokens = 0
        self.before_tokens = 0  # tokens sent before the current leg
        # a whole answer is assembled from the stream: its usage is needed even though nobody asked
        self.include_usage = parsed.include_usage or not parsed.stream
        self._prompt_ids: list[int] | None = None
        self.legs: list[dict[str, Any]] = []  # for the decision log and the log line

    def refused(self, generated_tokens: int) -> str | None:
        if self.sent.unfaithful is not None:
            return self.sent.unfaithful
        p = self.parsed.profile
        return refusal(faithfulness(self.parsed), continuations_done=self.done, generated_tokens=generated_tokens,
                       prompt_tokens=p.prompt_tokens,
                       remaining_tokens=remaining_budget(p.max_tokens, generated_tokens), limits=self.limits)

    @property
    def tail_needs_tokenizing(self) -> bool:
        """Whether `tail_ids` tokenizes (the engine gave no ids for some of the text) or only copies."""
        return not (self.sent.ids_complete and self.sent.ids)

    def tail_ids(self) -> list[int]:
        """The generated tokens so far: the engine's ids where it gave them, else the text re-tokenized."""
        if not self.tail_needs_tokenizing:
            return list(self.sent.ids)
        return generated_ids(self.sent.text, self.tok)

    def next_leg(self, tail: list[int]) -> Leg:
        """The continuation request (CPU work: run it off the event loop for long prompts)."""
        if self._prompt_ids is None:
            self._prompt_ids = prompt_ids(self.parsed, self.tok)
        p = self.parsed.profile
        ids = self._prompt_ids + tail
        tail_hashes = tuple(block_hashes(ids, p.block_size)[len(p.block_hashes):])
        profile = continuation_profile(p, generated_tokens=len(tail), tail_block_hashes=tail_hashes)
        body = {k: v for k, v in self.parsed.body.items()
                if not (self.sent.chat and k in _CHAT_ONLY) and k not in PD_LEG_FIELDS}
        body.update(prompt=ids, stream=True, stream_options={"include_usage": True})
        if self.engine_ids:
            body["return_token_ids"] = True
        budget = remaining_budget(p.max_tokens, len(tail))
        body.pop("max_completion_tokens", None)
        if budget is None:
            body.pop("max_tokens", None)
        else:
            body["max_tokens"] = budget
        if isinstance(body.get("min_tokens"), int):  # what is already generated counts towards it
            body["min_tokens"] = max(0, body["min_tokens"] - len(tail))
        if self.sent.chat:
            body.pop("echo", None)
        return Leg(profile, body, len(tail), len(ids))

    # -- splicing a continuation leg into the client's stream --

    def splice(self, ev: SSEEvent, is_usage: bool) -> bytes:
        """A continuation leg's event in the client's format (b"" to drop it)."""
        if ev.done:
            return SSE_DONE
        obj = ev.obj
        if obj is None:
            return b""
        if "error" in obj:
            return _sse(obj)  # the engine's own error event ends the stream as it would have
        if is_usage:
            if not self.include_usage:
                return b""
            return _sse(self._chunk([], usage=self.total_usage(obj.get("usage"))))
        choices = []
        for c in obj.get("choices") or ():
            if not isinstance(c, Mapping) or c.get("index", 0) != 0:
                continue
            text = c.get("text") if isinstance(c.get("text"), str) else ""
            self.sent.add(text, c.get("token_ids"))
            reason = c.get("finish_reason")
            if self.sent.chat:
                choices.append({"index": 0, "delta": {"content": text} if text else {}, "logprobs": None,
                                "finish_reason": reason})
            else:
                choices.append({"index": 0, "text": text, "logprobs": None, "finish_reason": reason})
        if not choices:
            return b""
        extra = {"usage": None} if "usage" in obj and self.include_usage else {}
        return _sse(self._chunk(choices, **extra))

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        s = self.sent
        rid = self.parsed.profile.request_id
        out: dict[str, Any] = {
            "id": s.id or (("chatcmpl-" if s.chat else "cmpl-") + rid),
            "object": "chat.completion.chunk" if s.chat else "text_completion",
            "created": s.created or 0,
            "model": self.parsed.requested_model or s.model or self.parsed.profile.model,
            "choices": choices}
        out.update(extra)
        return out

    def total_usage(self, leg_usage: Mapping[str, Any] | None) -> dict[str, Any]:
        """One usage for the whole response: every generated token, the original prompt, and
        what the continuations re-prefilled (TokenFleet fields)."""
        counts = usage_counts(leg_usage)
        prompt = self.parsed.profile.prompt_tokens
        completion = self.before_tokens + (counts.completion_tokens or 0)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                # the final leg's cache hit, as far as it covers the original prompt
                "prompt_tokens_details": {"cached_tokens": min(counts.cached_tokens, prompt)},
                "tokenfleet_continuations": self.done, "tokenfleet_reprefill_tokens": self.reprefill_tokens,
                "tokenfleet_reprefill_cached_tokens": counts.cached_tokens if self.done else 0}


def assembled_answer(stream: bytes, chat: bool) -> tuple[dict[str, Any] | None, Mapping[str, Any] | None]:
    """(the whole answer, None) or (None, the error) of a client-format stream of one choice: how a
    non-streaming request that was read as a stream (to be continuable) is answered."""
    splitter = SSESplitter()
    first: Mapping[str, Any] | None = None
    content: list[str] = []
    reasoning: list[str] = []
    finish: str | None = None
    usage: Any = None
    for raw in splitter.feed(stream) + splitter.flush():
        obj = parse_sse_event(raw).obj
        if obj is None:
            continue
        if "error" in obj:
            err = obj["error"]
            return None, err if isinstance(err, Mapping) else {"message": str(err)}
        if first is None and "id" in obj:
            first = obj
        if isinstance(obj.get("usage"), dict):
            usage = obj["usage"]
        for c in obj.get("choices") or ():
            if not isinstance(c, Mapping) or c.get("index", 0) != 0:
                continue
            if chat:
                delta = c.get("delta") if isinstance(c.get("delta"), Mapping) else {}
                content.append(delta.get("content") or "")
                reasoning.append(delta.get("reasoning_content") or delta.get("reasoning") or "")
            else:
                content.append(c.get("text") or "")
            finish = c.get("finish_reason") or finish
    head = first or {}
    out: dict[str, Any] = {"id": head.get("id"), "object": "chat.completion" if chat else "text_completion",
                           "created": head.get("created"), "model": head.get("model")}
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
        if any(reasoning):
            message["reasoning_content"] = "".join(reasoning)
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": "".join(content), "logprobs": None, "finish_reason": finish}
    out["choices"] = [choice]
    out["usage"] = usage
    return out, None


def _sse(obj: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


__all__ = ["CONTINUATION_PATH", "CONTINUED_HEADER", "Continuation", "ContinuationMetrics", "ContinuationReason",
           "Leg", "SentText", "continuation_tokenizer", "faithfulness", "generated_ids", "static_refusal"]
