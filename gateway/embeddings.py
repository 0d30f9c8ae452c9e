"""`POST /v1/embeddings` for models of `kind: embedding`: validated, admitted, routed like the rest.

The profile counts every input's tokens as prompt (admission charges them; the budget
adds one token of output room, as prefill ends in one step) and carries the first input's
block hashes (what a prefix-aware router can use). Each input must fit the model's
context. Chat or completions to an embedding model, and embeddings to a chat model, are
a 400 naming `model` (`gateway.requests.check_model_kind`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from fleetcore.model_tokenizer import PromptTokenizer
from fleetcore.prefix import block_hashes
from fleetcore.tokens import PromptTooLong
from fleetcore.types import RequestProfile
from gateway.auth import Caller
from gateway.errors import bad_request, context_length_exceeded
from gateway.json_body import parse_json_object
from gateway.requests import (ParsedRequest, builtin_ids, check_model_kind, json_value_cap,
                              requested_class, resolve_model, resolve_region, REGION_HEADER, TASK_TYPE_HEADER)
from gateway.serving import parse_off_loop, parser_args, serve_endpoint
from fleetcore.fleet_config import FleetConfig

if TYPE_CHECKING:
    from gateway.app import GatewayContext

PATH = "/v1/embeddings"
MAX_INPUTS = 2048  # OpenAI's limit


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_embeddings_request(raw: bytes, *, config: FleetConfig, caller: Caller, headers: Mapping[str, str],
                             request_id: str, now: float,
                             tokenizers: Mapping[str, PromptTokenizer] | None = None,
                             model_override: str | None = None) -> ParsedRequest:
    body = parse_json_object(raw, max_depth=config.gateway.max_json_depth, max_values=json_value_cap(config))
    asked = body.get("model")
    if model_override is not None:
        body["model"] = model_override
    model_cfg, version = resolve_model(body.get("model"), config)
    check_model_kind(model_cfg, "embedding")
    items = body.get("input")
    if items is None:
        raise bad_request("`input` is required.", "input")
    if isinstance(items, str) or (isinstance(items, list) and items and all(_is_int(t) for t in items)):
        items = [items]
    if not isinstance(items, list) or not items or len(items) > MAX_INPUTS:
        raise bad_request(f"`input` must be a string, a list of token ids, or a list of 1..{MAX_INPUTS} of them.",
                          "input")
    fmt = body.get("encoding_format")
    if fmt is not None and fmt not in ("float", "base64"):
        raise bad_request(f"`encoding_format` must be `float` or `base64`; got {fmt!r}.", "encoding_format")
    dims = body.get("dimensions")
    if dims is not None and (not _is_int(dims) or not 1 <= dims <= model_cfg.embedding_dim):
        raise bad_request(f"`dimensions` must be an integer between 1 and {model_cfg.embedding_dim}; got {dims!r}.",
                          "dimensions")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad_request("`user` must be a string.", "user")
    tok = tokenizers.get(model_cfg.name) if tokenizers else None
    limit = model_cfg.engine.max_model_len - 1  # the engine's one prefill step needs a slot
    total, first_ids = 0, []
    for i, item in enumerate(items):
        param = f"input[{i}]"
        try:
            if isinstance(item, str) and item:
                ids = tok.text_ids(item, limit) if tok is not None else builtin_ids(item, limit)
            elif isinstance(item, list) and item and all(_is_int(t) and 0 <= t < 2**32 for t in item):
                ids = list(item)
            else:
                raise bad_request(f"`{param}` must be a non-empty string or list of token ids.", param)
        except PromptTooLong as e:
            raise context_length_exceeded(param, model_cfg.engine.max_model_len, e.tokens, 1,
                                          at_least=not e.exact) from None
        if len(ids) > limit:
            raise context_length_exceeded(param, model_cfg.engine.max_model_len, len(ids), 1)
        total += len(ids)
        first_ids = first_ids or ids
    bs = model_cfg.engine.block_size
    profile = RequestProfile(
        request_id=request_id, model=model_cfg.name, prompt_tokens=total,
        block_hashes=tuple(block_hashes(first_ids, bs)), block_size=bs, max_tokens=1, model_version=version,
        tenant=caller.tenant, task_type=headers.get(TASK_TYPE_HEADER) or "embedding", stream=False,
        client_region=resolve_region(headers.get(REGION_HEADER), caller, config), arrival=now,
        request_class=requested_class(headers, body, config))
    requested = asked if isinstance(asked, str) and asked != model_cfg.name and (
        model_override is not None or asked in config.aliases) else None
    return ParsedRequest("embedding", body, profile, model_cfg, False, requested, key_id=caller.key_id)


async def serve_embeddings(ctx: GatewayContext, request: Request) -> Response:
    # Traced and access-logged like chat (gateway.telemetry), as operation "embeddings".
    async def parse(caller: Caller, rid: str, model: str | None) -> ParsedRequest:
        raw = await request.body()
        return await parse_off_loop(ctx, parse_embeddings_request, raw,
                                    **parser_args(ctx, request, caller, rid, model))
    return await serve_endpoint(ctx, request, "embeddings", PATH, parse)
