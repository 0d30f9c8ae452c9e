"""OpenAI-shaped errors: every non-2xx body the gateway returns goes through here.

Clients (the openai SDK, load generators) parse `{"error": {...}}` to decide
whether to retry, so the shape and the status code matter as much as the text.
FastAPI's own 404 / 405 / 422 / 500 answers are replaced by `install_handlers`.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from fleetcore.sse import SSE_DONE

log = logging.getLogger("tokenfleet.gateway")

INVALID_REQUEST = "invalid_request_error"
AUTH_ERROR = "invalid_request_error"  # what OpenAI sends with code invalid_api_key
SERVER_ERROR = "server_error"


class GatewayError(Exception):
    """An error the gateway answers with; raise it anywhere below the endpoints."""

    def __init__(self, status: int, message: str, *, type: str = INVALID_REQUEST,
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self, extra_headers: Mapping[str, str] | None = None) -> JSONResponse:
        headers = {**self.headers, **(extra_headers or {})}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(message: str, type: str = INVALID_REQUEST, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def sse_error_event(message: str, code: str = "upstream_error") -> bytes:
    """The event that ends a stream which failed after it started, followed by [DONE]."""
    payload = json.dumps(error_body(message, SERVER_ERROR, None, code))
    return f"data: {payload}\n\n".encode() + SSE_DONE


# --- constructors for the errors the gateway raises most; one place for codes ---

def bad_request(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


def invalid_api_key(message: str = "Invalid or missing API key. Send `Authorization: Bearer <key>`.") -> GatewayError:
    return GatewayError(401, message, type=AUTH_ERROR, code="invalid_api_key")


def model_not_found(model: str) -> GatewayError:
    return GatewayError(404, f"The model `{model}` does not exist or you do not have access to it.",
                        param="model", code="model_not_found")


def context_length_exceeded(param: str, max_len: int, prompt: int, output: int,
                            at_least: bool = False) -> GatewayError:
    """`at_least`: counting stopped early (`prompt` is a lower bound, not the exact count)."""
    more = "at least " if at_least else ""
    return GatewayError(
        400,
        f"This model's maximum context length is {max_len} tokens. However, you requested "
        f"{more}{prompt + output} tokens ({more}{prompt} in the prompt, {output} for the completion). "
        "Please reduce the prompt or max_tokens.",
        param=param, code="context_length_exceeded")


def no_ready_instance(model: str, retry_after_s: int = 1) -> GatewayError:
    return GatewayError(503, f"No ready instance serves model `{model}` right now; retry shortly.",
                        type=SERVER_ERROR, code="no_ready_instance",
                        headers={"Retry-After": str(retry_after_s)})


def upstream_failed(detail: str) -> GatewayError:
    """502: `detail` is client-facing (say which instance and what happened, never its address)."""
    return GatewayError(502, f"Upstream engine failed: {detail}", type=SERVER_ERROR,
                        code="upstream_error")


def upstream_timeout(detail: str) -> GatewayError:
    """504: every engine tried stalled (sent nothing within its deadline)."""
    return GatewayError(504, f"Upstream engine timed out: {detail}", type=SERVER_ERROR,
                        code="upstream_timeout")


def gateway_shutting_down(message: str, retry_after_s: int = 1) -> GatewayError:
    """503 while the gateway drains: another replica can serve the request."""
    return GatewayError(503, message, type=SERVER_ERROR, code="gateway_shutdown",
                        headers={"Retry-After": str(retry_after_s)})


# URLs, bracketed IPv6, dotted IPv4 and host:port: what an engine's or aiohttp's error text may
# carry about the internal network. Client-facing text never does; the log keeps the original.
_ADDRESS = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://\S+|\[[0-9a-fA-F:.%]+\](?::\d+)?"
                      r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b|\b[\w.-]+:\d{2,5}\b")


def redact_addresses(text: str) -> str:
    return _ADDRESS.sub("<address>", text)


def rate_limited(message: str, retry_after_s: float, limit_type: str = "requests",
                 headers: Mapping[str, str] | None = None) -> GatewayError:
    """A tenant over its budget: 429, OpenAI's `rate_limit_exceeded` (type "tokens" or "requests")."""
    secs = max(1, math.ceil(retry_after_s))
    return GatewayError(429, f"{message}. Please try again in {secs}s.", type=limit_type,
                        code="rate_limit_exceeded", headers={"Retry-After": str(secs), **(headers or {})})


def overloaded(message: str, code: str, retry_after_s: float) -> GatewayError:
    """The fleet cannot serve the request within its class SLO now (admission refused it before
    any prefill): 503, `code` says why (slo_unattainable, queue_timeout, queue_full)."""
    secs = max(1, math.ceil(retry_after_s))
    return GatewayError(503, f"{message}. Please try again in {secs}s.", type=SERVER_ERROR, code=code,
                        headers={"Retry-After": str(secs)})


def body_too_large(limit: int) -> GatewayError:
    return GatewayError(413, f"Request body is larger than {limit} bytes.", code="request_too_large")


# --- FastAPI integration ---

_STATUS_CODES = {404: "unknown_url", 405: "method_not_allowed", 413: "request_too_large"}


async def _gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return exc.response()


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 (unknown path) / 405 (wrong method) and any other HTTPException."""
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        message = f"Unknown request URL: {request.method} {request.url.path}."
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed for {request.url.path}."
    else:
        message = str(exc.detail)
    kind = INVALID_REQUEST if exc.status_code < 500 else SERVER_ERROR
    return JSONResponse(error_body(message, kind, None, _STATUS_CODES.get(exc.status_code)),
                        status_code=exc.status_code, headers=dict(exc.headers or {}))


async def _validation_error(request: Request, exc: Exception) -> Response:
    """FastAPI's 422 (only reachable for query/header params): a 400 naming the field."""
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "header", "path")]
    return JSONResponse(error_body(str(first.get("msg", "invalid request")), INVALID_REQUEST,
                                   ".".join(loc) or None, None), status_code=400)


async def _unhandled(request: Request, exc: Exception) -> Response:
    """A bug, not bad input: log the trace here, never send it to the client."""
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return JSONResponse(error_body("The gateway hit an internal error.", SERVER_ERROR, None,
                                   "internal_error"), status_code=500)


def install_handlers(app: FastAPI) -> None:
    app.add_exception_handler(GatewayError, _gateway_error)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unhandled)
