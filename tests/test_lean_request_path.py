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
