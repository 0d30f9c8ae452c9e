"""Parse a client's JSON body with bounded cost, and refuse what nothing downstream can carry.

`json.loads` accepts input that later breaks the gateway or costs far more than its size
suggests, so a body is checked before and after parsing:

- nesting deeper than `max_depth` is a 400 (100k-deep input would otherwise raise
  RecursionError, a 500); a cheap count of brackets skips the walk for ordinary bodies;
- more than `max_values` arrays, objects and values is a 400: an 8 MB body of `[],`
  builds millions of lists while holding the GIL for a second, stalling every request;
  counting separators (memchr speed) skips the check for bodies that cannot be that big;
- a lone UTF-16 surrogate (`"\\ud83d"`, legal JSON, not valid Unicode) in any string, key
  or value, is a 400 naming where: UTF-8 encoders (the upstream body, tokenizers, logs)
  raise on it. The escape or its raw bytes must appear in the body for one to exist, so
  the walk only looks at strings when they do.

`sent_as_parsed` says whether the client's bytes provably hold exactly what `json.loads` made of
them (no key given twice in any object), so that they can go upstream as they are.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from gateway.errors import bad_request

# A JSON string, escapes included; used only to blank strings out before counting structure.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_SURROGATE = re.compile("[" + chr(0xD800) + "-" + chr(0xDFFF) + "]")  # (chr: mypyc refuses surrogate literals)
_OPEN_ARRAY, _OPEN_OBJECT, _CLOSE_ARRAY, _CLOSE_OBJECT = b"[{]}"


def _structure_count(raw: bytes) -> int:
    """An upper bound on the arrays, objects and values in `raw` (each needs a bracket or a comma)."""
    return raw.count(b"[") + raw.count(b"{") + raw.count(b",")


def _may_hold_surrogate(raw: bytes) -> bool:
    # `\ud800`-`\udfff` escapes, or surrogates written as (invalid) UTF-8, which json.loads
    # decodes with "surrogatepass". `find`, not `in`: CPython 3.11's `in` first tries a bytes
    # needle as an integer and builds and clears a TypeError each time (`fleetcore.sse`).
    find = raw.find
    return find(b"\\ud") >= 0 or find(b"\\uD") >= 0 or find(b"\xed") >= 0


def parse_json_object(raw: bytes, *, max_depth: int = 64, max_values: int = 1 << 20) -> dict[str, Any]:
    """`raw` as a JSON object; raises a 400 GatewayError (code invalid_json) on anything else."""
    if _structure_count(raw) > max_values and _structure_count(_STRING.sub(b'""', raw)) > max_values:
        raise bad_request(f"The request body has more than {max_values} JSON values.", code="invalid_json")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad_request(f"The request body is nested more than {max_depth} levels deep.",
                          code="invalid_json") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise bad_request(f"The request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    check_strings = _may_hold_surrogate(raw)
    if check_strings or (raw.count(b"[") + raw.count(b"{") > max_depth and _nesting(raw) > max_depth):
        _walk(body, max_depth, check_strings)  # it raises, naming where (or finds nothing amiss)
    return body


def _nesting(raw: bytes) -> int:
    """How deep `raw`'s arrays and objects nest (the top-level object is 1), from its bytes:
    strings blanked out, then a running count of opening less closing brackets. A multi-turn
    chat with tools has more brackets than `max_depth` but is shallow; this answers that in C
    and numpy instead of a Python walk that formats a path for every value of every request."""
    a = np.frombuffer(_STRING.sub(b'""', raw), dtype=np.uint8)
    if not len(a):
        return 0
    steps = ((a == _OPEN_ARRAY) | (a == _OPEN_OBJECT)).astype(np.int32)
    steps -= (a == _CLOSE_ARRAY) | (a == _CLOSE_OBJECT)
    return int(np.cumsum(steps).max())


def _walk(body: dict[str, Any], max_depth: int, check_strings: bool) -> None:
    """Depth and lone surrogates, iteratively (the body may be as deep as json.loads allows)."""
    stack: list[tuple[Any, int, str]] = [(body, 1, "")]
    while stack:
        value, depth, where = stack.pop()
        if isinstance(value, dict):
            if depth > max_depth:
                raise bad_request(f"The request body is nested more than {max_depth} levels deep.",
                                  param=where or None, code="invalid_json")
            for k, v in value.items():
                at = f"{where}.{k}" if where else k
                if check_strings and _SURROGATE.search(k):
                    _lone_surrogate(where or None)
                stack.append((v, depth + 1, at))
        elif isinstance(value, list):
            if depth > max_depth:
                raise bad_request(f"The request body is nested more than {max_depth} levels deep.",
                                  param=where or None, code="invalid_json")
            stack.extend((v, depth + 1, f"{where}[{i}]") for i, v in enumerate(value))
        elif check_strings and isinstance(value, str) and not value.isascii() and _SURROGATE.search(value):
            _lone_surrogate(where)


def _lone_surrogate(where: str | None) -> None:
    raise bad_request(f"`{where or 'the request body'}` contains an unpaired UTF-16 surrogate "
                      "(such as \\ud83d): not valid Unicode text.", param=where, code="invalid_unicode")


# Values `sent_as_parsed` walks at most before it gives up (a prompt of thousands of token ids:
# the walk would cost what re-encoding saves).
MEMBER_WALK_MAX = 4096


def sent_as_parsed(raw: bytes, body: dict[str, Any]) -> bool:
    """Whether `raw`, which `parse_json_object` made `body` of, holds exactly `body` and says so
    cheaply: a UTF-8 JSON object (it begins with `{`: no byte-order mark, no UTF-16/32, which
    json.loads takes and an engine may not) in which no object names a key twice, and whose
    strings hold no colon. json.loads keeps a repeated key's last value; an engine's parser may
    keep the first (simdjson's lookup) or refuse, so a body with one would be validated as one
    request and run as another: such bytes are never sent as they are.

    The rule, in C but for the walk: outside strings a colon appears in JSON only between a
    member's key and value, so when the body's colons equal the members `body` holds, every
    colon is such a separator (none is in a string) and no key was dropped as a repeat. Strings
    that do hold colons are not blanked out to count the rest: that regex costs about twice the
    re-encoding it would save (6.5 against 2.8 ns a byte for a 116 kB body, timeit, ad-hoc), so
    such bodies are re-encoded, as are those whose walk would be long (`MEMBER_WALK_MAX`)."""
    if raw[:1] != b"{":
        return False
    members = _members(body)
    return members is not None and raw.count(b":") == members


def _members(body: dict[str, Any]) -> int | None:
    """The members of every object in `body` (json.loads' dicts and lists; their values
    visited iteratively); None past MEMBER_WALK_MAX values."""
    n, budget = 0, MEMBER_WALK_MAX
    todo: list[Any] = [body]
    while todo:
        v = todo.pop()
        if type(v) is dict:
            n += len(v)
            values: Any = v.values()
        else:
            values = v
        budget -= len(values)
        if budget < 0:
            return None
        for x in values:
            if type(x) is dict or type(x) is list:
                todo.append(x)
    return n
