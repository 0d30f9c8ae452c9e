"""The one serving skeleton of the OpenAI endpoints (chat, completions, responses, embeddings).

Every endpoint does the same around its own parser: start the request's telemetry record,
authenticate, parse (large bodies off the event loop, in the bounded tokenize pool), answer a
bad request with its error (counted, access-logged), then serve with the model's fallbacks
(each fallback parsed again for its own model). Only the parser differs, so only the parser
is passed in.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.aliases import serve_with_fallbacks
from gateway.auth import Caller
from gateway.errors import GatewayError
from fleetcore.fast_replace import replace  # dataclasses.replace, cheaper (three copies a request)
from gateway.requests import ParsedRequest, new_request_id

if TYPE_CHECKING:
    from gateway.app import GatewayContext

INLINE_PARSE_BYTES = 16 * 1024  # larger bodies are parsed in the tokenize pool, not on the loop

# (caller, request id, model override or None) -> the parsed request; raises GatewayError.
Parse = Callable[[Caller, str, "str | None"], Awaitable[ParsedRequest]]


async def parse_off_loop(ctx: GatewayContext, fn: Callable[..., ParsedRequest], raw: bytes, *lead: Any,
                         **kwargs: Any) -> ParsedRequest:
    """`fn(*lead, raw, **kwargs)`, in the tokenize pool when the body is large."""
    if len(raw) > INLINE_PARSE_BYTES:
        return await ctx.tokenize_pool.run(fn, *lead, raw, **kwargs)
    return fn(*lead, raw, **kwargs)


def parser_args(ctx: GatewayContext, request: Request, caller: Caller, rid: str,
                model_override: str | None) -> dict[str, Any]:
    """What every request parser is given besides the body."""
    return dict(config=ctx.config, caller=caller, headers=request.headers, request_id=rid,
                now=ctx.relay.clock(), tokenizers=ctx.tokenizers, model_override=model_override)


async def serve_endpoint(ctx: GatewayContext, request: Request, operation: str, path: str,
                         parse: Parse) -> Response:
    """Authenticate, parse, serve with fallbacks; `operation` names it in traces and the access log."""
    rid = new_request_id(request.headers)
    obs = ctx.telemetry.begin(request.headers, operation, rid) if ctx.telemetry is not None else None
    try:
        caller = ctx.auth.authenticate(request.headers)
        parsed = await parse(caller, rid, None)
    except GatewayError as e:
        e.headers.setdefault("x-request-id", rid)
        ctx.metrics.answered("", "", "", str(e.status))
        if obs is not None:  # auth failures and bad bodies get their access log line too
            obs.end(e.status, e.message)
        raise

    # A capacity 503 tries the model's fallbacks (`gateway.aliases`), each parsed for its own model.
    async def reparse(model: str) -> ParsedRequest:
        p = await parse(caller, rid, model)
        return p if obs is None else replace(p, obs=obs)

    if obs is None:
        return await serve_with_fallbacks(ctx.relay, ctx.metrics, request, parsed, path, reparse)
    obs.parsed(parsed.profile)
    return await obs.tel.serve(obs, serve_with_fallbacks(ctx.relay, ctx.metrics, request, replace(parsed, obs=obs),
                                                         path, reparse))
