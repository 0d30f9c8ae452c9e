"""Body validation: an OpenAI chat / completion body → a `RequestProfile`.

Validation is deliberately about what the gateway needs to route safely and
what would otherwise surface as an opaque engine error; every unknown field is
left in the body and forwarded untouched (engines take extras such as
`ignore_eos`), except OpenAI fields the gateway cannot honour (`gateway.openai_fields`:
refused, never silently dropped). `n` and `logprobs` are validated and forwarded. Every
failure is a 400 naming the offending `param`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from fleetcore.fleet_config import FleetConfig, ModelConfig
from fleetcore.model_tokenizer import PromptTokenizer
from fleetcore.prefix import block_hashes
from fleetcore.tokens import PromptTooLong, min_tokens, render_chat
from fleetcore.types import RequestProfile
from gateway.auth import Caller
from gateway.errors import bad_request, context_length_exceeded, model_not_found
from gateway.json_body import parse_json_object
from gateway.openai_fields import check_logprobs, check_unsupported, choice_count
from gateway.tokenize_pool import builtin_encode_upto

if TYPE_CHECKING:
    from gateway.telemetry import RequestRecord

Kind = Literal["chat", "completion", "embedding"]

REGION_HEADER = "x-tokenfleet-region"
TASK_TYPE_HEADER = "x-tokenfleet-task-type"
CLASS_HEADER = "x-tokenfleet-class"
CLASS_METADATA_KEY = "tokenfleet_class"  # in the body's `metadata` object
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    kind: Kind
    body: dict[str, Any]  # the client's body as sent; the relay copies before changing it
    profile: RequestProfile
    model: ModelConfig
    include_usage: bool  # the client itself asked for the streamed usage chunk
    # The name the client asked for when it is not the model that serves (an alias, or the
    # original model of a fallback): responses carry it in `model`.
    requested_model: str | None = None
    # What telemetry learns about the request on its way (gateway.telemetry); travels with it
    # through admission's `replace`. None: no telemetry (tests that build requests directly).
    obs: RequestRecord | None = None
    key_id: str | None = None  # the API key created by API that sent it (its own budgets: gateway.key_budgets)
    # (the body as parsed, the client's bytes of it): what `gateway.relay.upstream_body` may send
    # as it is while `body` is still that dict and nothing in it needs changing
    # (`gateway.json_body.sent_as_parsed` decides whether the bytes hold exactly it). None: a
    # body changed as parsed (a fallback's model), or one not parsed from bytes.
    raw: tuple[dict[str, Any], bytes] | None = None
    # A whole answer's bytes as the client's API writes them, from the engine's: the Responses
    # API's translation of a chat answer (`gateway.responses_api`). The relay applies it before
    # it books the answer, so that one it cannot translate (it raises) is booked as the engine's
    # failure rather than a success (`Relay._client_body`). None: passed on as the engine wrote it.
    translate_answer: Callable[[bytes], bytes] | None = None

    @property
    def stream(self) -> bool:
        return self.profile.stream


def new_request_id(headers: Mapping[str, str]) -> str:
    """The client's `X-Request-Id` when it is sane (for end-to-end tracing), else a fresh one:
    `req-` and 32 hex digits of os.urandom, as unguessable as uuid4's (128 random bits, not 122)
    at a fifth of its cost (uuid4 builds a UUID object around the same system call)."""
    given = headers.get("x-request-id")
    return given if given and _REQUEST_ID.match(given) else "req-" + os.urandom(16).hex()


def json_value_cap(config: FleetConfig) -> int:
    """The most JSON values a valid request body can need: a prompt of token ids fits the
    largest context (a batch counts as one prompt), twice over, plus room for tools and the like."""
    return 2 * max(m.engine.max_model_len for m in config.models) + 65536


def parse_request(kind: Kind, raw: bytes, *, config: FleetConfig, caller: Caller,
                  headers: Mapping[str, str], request_id: str, now: float,
                  tokenizers: Mapping[str, PromptTokenizer] | None = None,
                  model_override: str | None = None) -> ParsedRequest:
    """Validate `raw` and build its profile; raises a 4xx GatewayError on bad input.

    `tokenizers` (model name -> the model's own tokenizer) makes prompt token counts and
    block hashes exact for real engines (KV-event cache keys match); models without one
    use the built-in estimate (`fleetcore.tokens`).

    A prompt is never tokenized further than the context allows: one that provably cannot
    fit (from its length in characters, or counting stopped at the limit) is rejected with
    "at least N tokens", so a huge prompt costs no more than a fitting one.
    """
    body = parse_json_object(raw, max_depth=config.gateway.max_json_depth, max_values=json_value_cap(config))
    asked = body.get("model")
    if model_override is not None:  # a fallback: the same body for another model
        body["model"] = model_override
    model_cfg, version = resolve_model(body.get("model"), config)
    check_model_kind(model_cfg, kind)
    requested = asked if isinstance(asked, str) and asked != model_cfg.name and (
        model_override is not None or asked in config.aliases) else None
    stream, include_usage = _stream_flags(body)
    check_unsupported(body, kind)
    _check_sampling(body)
    check_logprobs(body, kind)
    n = choice_count(body)
    max_tokens = _output_budget(body, kind)
    tok = tokenizers.get(model_cfg.name) if tokenizers else None
    output = max_tokens if max_tokens is not None else 1  # the engine needs room for >= 1 token
    max_len = model_cfg.engine.max_model_len
    param = "messages" if kind == "chat" else "prompt"
    limit = max_len - output  # the most prompt tokens that fit
    try:
        ids = _chat_prompt_ids(body, tok, limit) if kind == "chat" else _completion_prompt_ids(body, tok, limit)
    except PromptTooLong as e:
        raise context_length_exceeded(param, max_len, e.tokens, output, at_least=not e.exact) from None
    if len(ids) + output > max_len:
        raise context_length_exceeded(param, max_len, len(ids), output)
    block_size = model_cfg.engine.block_size
    profile = RequestProfile(
        request_id=request_id, model=model_cfg.name, prompt_tokens=len(ids),
        block_hashes=tuple(block_hashes(ids, block_size)), block_size=block_size,
        max_tokens=max_tokens, n=n, model_version=version, tenant=caller.tenant,
        task_type=headers.get(TASK_TYPE_HEADER) or None, stream=stream,
        client_region=resolve_region(headers.get(REGION_HEADER), caller, config), arrival=now,
        request_class=requested_class(headers, body, config))
    return ParsedRequest(kind, body, profile, model_cfg, include_usage, requested, key_id=caller.key_id,
                         raw=(body, raw) if model_override is None else None)


def requested_class(headers: Mapping[str, str], body: Mapping[str, Any], config: FleetConfig) -> str | None:
    """The class the client asked for: `x-tokenfleet-class`, else `metadata.tokenfleet_class`.

    None leaves it to admission (task type, length, tenant default). A name the fleet does
    not define is a 400 naming the known ones, not a silent default.
    """
    value, param = headers.get(CLASS_HEADER), CLASS_HEADER
    if not value:
        meta = body.get("metadata")
        value = meta.get(CLASS_METADATA_KEY) if isinstance(meta, dict) else None
        param = f"metadata.{CLASS_METADATA_KEY}"
        if value is not None and not isinstance(value, str):
            raise bad_request(f"`{param}` must be a string.", param)
    if not value:
        return None
    value = value.strip()
    known = config.admission.class_names
    if value not in known:
        raise bad_request(f"Unknown request class {value!r}; known: {', '.join(sorted(known))}.", param,
                          code="unknown_class")
    return value


# --- model, region ---

def resolve_model(value: Any, config: FleetConfig) -> tuple[ModelConfig, str | None]:
    """`name` or `name@version` → (model config, version or None for any ready version)."""
    if value is None:
        raise bad_request("You must provide a model parameter.", "model")
    if not isinstance(value, str) or not value.strip():
        raise bad_request("`model` must be a non-empty string.", "model")
    name, sep, version = config.resolve_alias(value).partition("@")
    try:
        model_cfg = config.model(name)
    except KeyError:
        raise model_not_found(value) from None
    if sep and version not in model_cfg.versions:
        raise model_not_found(value)
    return model_cfg, (version if sep else None)


def check_model_kind(model: ModelConfig, kind: Kind) -> None:
    """Embedding models serve /v1/embeddings only, chat models everything else: a 400 naming `model`."""
    if (model.kind == "embedding") != (kind == "embedding"):
        what = ("an embedding model: use /v1/embeddings" if model.kind == "embedding"
                else "not an embedding model: use /v1/chat/completions or /v1/completions")
        raise bad_request(f"The model `{model.name}` is {what}.", "model", code="model_not_supported")


def resolve_region(header: str | None, caller: Caller, config: FleetConfig) -> str:
    """Header (validated: a typo must not silently route across the world), tenant, fleet default."""
    if header:
        region = header.strip()
        if region not in config.client_regions:
            raise bad_request(f"Unknown region {region!r} in {REGION_HEADER}; known: "
                              f"{', '.join(config.client_regions)}.", REGION_HEADER)
        return region
    return caller.region or config.entry_region


# --- generic field checks ---

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(float(v)))


def _check_number(body: Mapping[str, Any], name: str, ok: Callable[[float], bool],
                  expect: str) -> None:
    v = body.get(name)
    if v is None:
        return
    if not _is_number(v) or not ok(float(v)):
        raise bad_request(f"`{name}` must be {expect}; got {v!r}.", name)


def _check_sampling(body: Mapping[str, Any]) -> None:
    _check_number(body, "temperature", lambda x: 0.0 <= x <= 2.0, "a number between 0 and 2")
    _check_number(body, "top_p", lambda x: 0.0 < x <= 1.0, "a number in (0, 1]")
    _check_number(body, "presence_penalty", lambda x: -2.0 <= x <= 2.0, "a number between -2 and 2")
    _check_number(body, "frequency_penalty", lambda x: -2.0 <= x <= 2.0, "a number between -2 and 2")
    if body.get("seed") is not None and not _is_int(body["seed"]):
        raise bad_request("`seed` must be an integer.", "seed")
    _check_stop(body.get("stop"))
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad_request("`user` must be a string.", "user")


def _check_stop(stop: Any) -> None:
    if stop is None or isinstance(stop, str):
        return
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad_request("`stop` must be a string or a list of strings.", "stop")


def _stream_flags(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """(stream, client asked for include_usage)."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request(f"`stream` must be a boolean; got {stream!r}.", "stream")
    opts = body.get("stream_options")
    if opts is None:
        return bool(stream), False
    if not stream:
        raise bad_request("`stream_options` is only allowed when `stream` is true.", "stream_options")
    if not isinstance(opts, dict):
        raise bad_request("`stream_options` must be an object.", "stream_options")
    usage = opts.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise bad_request("`stream_options.include_usage` must be a boolean.",
                          "stream_options.include_usage")
    return True, bool(usage)


def _output_budget(body: Mapping[str, Any], kind: Kind) -> int | None:
    """`max_completion_tokens` (newer chat name) wins over `max_tokens`; both must be positive ints."""
    names = ("max_completion_tokens", "max_tokens") if kind == "chat" else ("max_tokens",)
    budget: int | None = None
    for name in names:
        v = body.get(name)
        if v is None:
            continue
        if not _is_int(v) or v < 1:
            raise bad_request(f"`{name}` must be a positive integer; got {v!r}.", name)
        budget = v if budget is None else budget
    return budget


# --- prompts ---

def builtin_ids(text: str, limit: int) -> list[int]:
    """`fleetcore.tokens` ids of `text`; PromptTooLong as soon as they provably exceed `limit`."""
    if (at_least := min_tokens(len(text))) > limit:
        raise PromptTooLong(at_least, exact=False)
    ids = builtin_encode_upto(text, limit)  # (a long text, on a tokenize pool thread: in its helper process)
    if len(ids) > limit:
        raise PromptTooLong(len(ids), exact=False)
    return ids


def _chat_prompt_ids(body: Mapping[str, Any], tok: PromptTokenizer | None, limit: int) -> list[int]:
    messages = body.get("messages")
    if messages is None:
        raise bad_request("`messages` is required.", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` must be a non-empty list of message objects.", "messages")
    for i, m in enumerate(messages):
        _check_message(i, m)
    if tok is not None:
        try:
            return tok.chat_ids(messages, limit)
        except PromptTooLong:
            raise
        except Exception:
            # The engine is the judge of what its template accepts; routing falls back
            # to the estimate rather than rejecting a request the engine may take.
            pass
    return builtin_ids(render_chat(messages), limit)


def _check_message(i: int, m: Any) -> None:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_request(f"`{where}` must be an object.", where)
    role = m.get("role")
    if role not in CHAT_ROLES:
        raise bad_request(f"`{where}.role` must be one of {sorted(CHAT_ROLES)}; got {role!r}.",
                          f"{where}.role")
    content = m.get("content")
    if content is None:
        # Only an assistant turn that calls tools may omit its text.
        if role == "assistant" and (m.get("tool_calls") or m.get("function_call")):
            return
        raise bad_request(f"`{where}.content` is required.", f"{where}.content")
    if isinstance(content, str):
        return
    if not isinstance(content, list) or not all(isinstance(p, dict) and isinstance(p.get("type"), str)
                                                for p in content):
        raise bad_request(f"`{where}.content` must be a string or a list of content parts "
                          "with a `type`.", f"{where}.content")


def _completion_prompt_ids(body: Mapping[str, Any], tok: PromptTokenizer | None, limit: int) -> list[int]:
    """`prompt` as text, token ids, or a batch of either; the profile covers the whole batch,
    so the batch shares one limit and counting stops where the sum exceeds it."""
    text_ids: Callable[[str, int], list[int]] = tok.text_ids if tok is not None else builtin_ids
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("`prompt` is required.", "prompt")
    if isinstance(prompt, str):
        return text_ids(prompt, limit)
    if not isinstance(prompt, list) or not prompt:
        raise bad_request("`prompt` must be a string, a list of strings, or a list of token ids.",
                          "prompt")
    if all(_is_int(t) for t in prompt):
        return _checked_ids(prompt)
    ids: list[int] = []
    for item in prompt:
        try:
            ids.extend(_one_prompt(item, text_ids, limit - len(ids)))
        except PromptTooLong as e:
            raise PromptTooLong(len(ids) + e.tokens, exact=False) from None
        if len(ids) > limit:
            raise PromptTooLong(len(ids), exact=False)
    return ids


def _one_prompt(item: Any, text_ids: Callable[[str, int], list[int]], limit: int) -> list[int]:
    if isinstance(item, str):
        return text_ids(item, limit)
    if isinstance(item, list) and item and all(_is_int(t) for t in item):
        return _checked_ids(item)
    raise bad_request("Each element of `prompt` must be a string or a non-empty list of token ids.",
                      "prompt")


def _checked_ids(ids: Sequence[int]) -> list[int]:
    # block_hashes packs ids as uint32; anything else is not a token id anyway
    if not all(0 <= t < 2**32 for t in ids):
        raise bad_request("Token ids in `prompt` must be non-negative 32-bit integers.", "prompt")
    return list(ids)
