"""The OpenAPI description of the /v1 request bodies (for /openapi.json, /docs and fuzzers).

The endpoints read raw bodies (`gateway.requests` validates them and forwards unknown
fields untouched), so FastAPI cannot derive these schemas; they are declared here, as
`openapi_extra`, and describe what `gateway.requests` accepts. Parsing does not use them.
"""

from __future__ import annotations

from typing import Any

_ERROR = {
    "description": "OpenAI-shaped error",
    "content": {"application/json": {"schema": {
        "type": "object", "required": ["error"],
        "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}}},
}
_RESPONSES: dict[str, Any] = {
    "200": {"description": "The completion (JSON), or its token stream when `stream` is true",
            "content": {"application/json": {"schema": {"type": "object"}},
                        "text/event-stream": {"schema": {"type": "string"}}}},
    **{code: _ERROR for code in ("400", "401", "403", "404", "413", "429", "502", "503", "504")},
}

_SAMPLING: dict[str, Any] = {
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}},
                       "description": "only with stream: true"},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "n": {"type": "integer", "minimum": 1, "maximum": 128},
    "seed": {"type": "integer"},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "user": {"type": "string"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "metadata": {"type": "object", "properties": {"tokenfleet_class": {"type": "string"}},
                 "description": "`tokenfleet_class` picks a request class defined by the fleet"},
}
_MODEL = {"type": "string", "description": "`name` or `name@version`; GET /v1/models lists them"}
_CONTENT_PART = {"type": "object", "required": ["type"],
                 "properties": {"type": {"type": "string"}, "text": {"type": "string"}}}
_MESSAGE = {
    "type": "object", "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool", "function"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": _CONTENT_PART}]},
        "tool_calls": {"type": "array", "items": {"type": "object"}},
    },
}
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": 2**32 - 1}}


def _body(schema: dict[str, Any], example: dict[str, Any]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": schema, "example": example}}}, "responses": _RESPONSES}


def chat_body(model: str) -> dict[str, Any]:
    """`openapi_extra` of POST /v1/chat/completions; `model` is the example's model."""
    return _body({
        "type": "object", "required": ["model", "messages"], "additionalProperties": True,
        "properties": {"model": _MODEL, "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
                       "max_completion_tokens": {"type": "integer", "minimum": 1}, **_SAMPLING},
    }, {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8})


def completion_body(model: str) -> dict[str, Any]:
    """`openapi_extra` of POST /v1/completions."""
    return _body({
        "type": "object", "required": ["model", "prompt"], "additionalProperties": True,
        "properties": {"model": _MODEL, "prompt": {"oneOf": [
            {"type": "string"}, _TOKEN_IDS,
            {"type": "array", "minItems": 1, "items": {"oneOf": [{"type": "string"}, _TOKEN_IDS]}}]},
            **_SAMPLING},
    }, {"model": model, "prompt": "Hello", "max_tokens": 8})


def embeddings_body(model: str) -> dict[str, Any]:
    """`openapi_extra` of POST /v1/embeddings (models of kind `embedding`)."""
    return _body({
        "type": "object", "required": ["model", "input"], "additionalProperties": True,
        "properties": {"model": _MODEL, "input": {"oneOf": [
            {"type": "string"}, _TOKEN_IDS,
            {"type": "array", "minItems": 1, "maxItems": 2048, "items": {"oneOf": [{"type": "string"}, _TOKEN_IDS]}}]},
            "encoding_format": {"type": "string", "enum": ["float", "base64"]},
            "dimensions": {"type": "integer", "minimum": 1}, "user": {"type": "string"}},
    }, {"model": model, "input": "Hello"})


def responses_body(model: str) -> dict[str, Any]:
    """`openapi_extra` of POST /v1/responses (stateless; `gateway.responses_api`)."""
    return _body({
        "type": "object", "required": ["model", "input"], "additionalProperties": False,
        "properties": {
            "model": _MODEL,
            "input": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "object"}}]},
            "instructions": {"type": "string"}, "max_output_tokens": {"type": "integer", "minimum": 1},
            "temperature": _SAMPLING["temperature"], "top_p": _SAMPLING["top_p"], "stream": {"type": "boolean"},
            "user": {"type": "string"}, "metadata": _SAMPLING["metadata"],
            "store": {"type": "boolean", "enum": [False], "description": "stateless: true is a 400"}},
    }, {"model": model, "input": "Hello", "max_output_tokens": 8})
