"""Aliases and fallbacks: client-facing model names and what serves when a model cannot.

- An alias (`aliases:` in the fleet file) is resolved when the body is parsed
  (`gateway.requests.resolve_model`); the response keeps the name the client asked for in
  `model` (renamed here, chunk by chunk), and `x-tokenfleet-served-model` says which
  model served.
- A fallback (`fallbacks:` per model) is tried, in order, when the model has no ready
  instance or admission refuses it for capacity (503 `no_ready_instance`,
  `slo_unattainable`). Budget, auth and bad-input rejections are final: a tenant over its
  budget must not be served by a second model. The fallback request is parsed afresh for
  its own model (context limit, tokenizer, block hashes) and goes through admission,
  routing and the region policy like any request, so residency that forbids it refuses it.
  `x-tokenfleet-fallback` names the fallback; `tokenfleet_fallbacks_total` counts them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.responses import Response

from gateway.errors import GatewayError

if TYPE_CHECKING:
    from starlette.requests import Request

    from fleetcore.fleet_config import FleetConfig
    from gateway.metrics import GatewayMetrics
    from gateway.relay import Relay
    from gateway.requests import ParsedRequest

log = logging.getLogger("tokenfleet.gateway")

SERVED_MODEL_HEADER = "x-tokenfleet-served-model"
FALLBACK_HEADER = "x-tokenfleet-fallback"
FALLBACK_CODES = frozenset({"no_ready_instance", "slo_unattainable"})


def renamed_event(raw: bytes, obj: dict[str, Any] | None, name: str) -> bytes:
    """An SSE event with its chunk's `model` set to `name` (events without one unchanged)."""
    if obj is None or "model" not in obj:
        return raw
    return b"data: " + json.dumps({**obj, "model": name}, separators=(",", ":")).encode() + b"\n\n"


def renamed_body(body: bytes, name: str) -> bytes:
    try:
        obj = json.loads(body)
    except ValueError:
        return body
    if not isinstance(obj, dict) or "model" not in obj:
        return body
    obj["model"] = name
    return json.dumps(obj, separators=(",", ":")).encode()


def _falls_back(e: GatewayError) -> bool:
    return e.status == 503 and e.code in FALLBACK_CODES


async def serve_with_fallbacks(relay: Relay, metrics: GatewayMetrics, request: Request, parsed: ParsedRequest,
                               path: str, reparse: Callable[[str], Awaitable[ParsedRequest]]) -> Response:
    """`relay.handle`, then the model's fallbacks in order while the answer is a capacity 503.

    Nothing reached the client before a 503, so a fallback is safe for streams too. When no
    fallback serves, the client gets the requested model's own error."""
    try:
        return await relay.handle(request, parsed, path)
    except GatewayError as e:
        if not parsed.model.fallbacks or not _falls_back(e):
            raise
        first = e
    for name in parsed.model.fallbacks:
        try:
            alt = await reparse(name)
        except GatewayError as e:  # e.g. the prompt does not fit the fallback's context
            log.info("request %s: fallback %s does not take it: %s", parsed.profile.request_id, name, e.message)
            continue
        try:
            resp = await relay.handle(request, alt, path)
        except GatewayError as e:
            if _falls_back(e):
                continue
            raise
        metrics.fallbacks.labels(parsed.profile.model, alt.profile.model, first.code or "").inc()
        resp.headers[FALLBACK_HEADER] = alt.profile.model
        return resp
    raise first


def alias_entries(config: FleetConfig, ready: dict[str, set[str]], created: int) -> list[dict[str, Any]]:
    """`/v1/models` entries for the aliases whose model (and version, if pinned) is serving."""
    out: list[dict[str, Any]] = []
    for alias in sorted(config.aliases):
        name, sep, version = config.resolve_alias(alias).partition("@")
        versions = ready.get(name, set())
        if not versions or (sep and version not in versions):
            continue
        out.append({"id": alias, "object": "model", "created": created, "owned_by": "tokenfleet",
                    "alias_of": config.resolve_alias(alias), "versions": sorted(versions if not sep else {version}),
                    "max_model_len": config.model(name).engine.max_model_len})
    return out
