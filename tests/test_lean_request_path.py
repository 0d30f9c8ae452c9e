"""The per-request shortcuts of the /v1 path (issue 14, CPU per request) give what the long way gave."""

from __future__ import annotations

import re

from gateway.requests import new_request_id


def test_fresh_request_ids_are_unique_and_shaped_like_before() -> None:
    ids = [new_request_id({}) for _ in range(2000)]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"req-[0-9a-f]{32}", i) for i in ids)  # uuid4().hex's shape


def test_a_sane_client_request_id_is_kept_and_an_odd_one_replaced() -> None:
    assert new_request_id({"x-request-id": "trace-42:a.b_c"}) == "trace-42:a.b_c"
    for odd in ("", "has space", "x" * 129, "semi;colon"):
        got = new_request_id({"x-request-id": odd})
        assert got != odd and re.fullmatch(r"req-[0-9a-f]{32}", got)


def test_lookup_headers_answer_as_starlettes_headers() -> None:
    from starlette.datastructures import Headers

    from gateway.fast_path import BufferedRequest, LookupHeaders

    raw = [(b"host", b"h"), (b"authorization", b"Bearer k1"), (b"x-request-id", b"a"),
           (b"x-request-id", b"b"), (b"x-tokenfleet-region", b"\xe9u")]  # a repeated name; a latin-1 byte
    scope = {"type": "http", "headers": raw}
    ours, theirs = LookupHeaders(scope=scope), Headers(scope={"type": "http", "headers": list(raw)})
    names = ["host", "Authorization", "X-Request-Id", "x-tokenfleet-region", "x-tokenfleet-class", "traceparent"]
    for name in names:
        assert ours.get(name) == theirs.get(name)
        assert ours.get(name, "d") == theirs.get(name, "d")
        assert (name in ours) == (name in theirs)
        if name in theirs:
            assert ours[name] == theirs[name]
    assert ours.getlist("x-request-id") == ["a", "b"] and ours.items() == theirs.items() and ours == theirs
    try:
        ours["absent"]
    except KeyError as e:
        assert e.args == ("absent",)
    else:
        raise AssertionError("an absent header must raise KeyError")
    req = BufferedRequest({"type": "http", "headers": raw, "method": "POST", "path": "/v1/completions"},
                          None, b"{}")  # type: ignore[arg-type]
    assert isinstance(req.headers, LookupHeaders) and req.headers.get("authorization") == "Bearer k1"
