"""A relayed stream's head headers, built in C (`RelayStreamingResponse.raw_headers`): the same
list the header-by-header comprehension gave, for any header dict (hypothesis), newlines and
non-latin-1 text included."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.relay import _SSE_CONTENT_TYPE, _SSE_HEAD, RelayStreamingResponse

_TEXT = st.text(alphabet=st.sampled_from("aZ-_09 :\n\t\xe9\xff\u0130\u03a3"), max_size=6)


def _response(headers: dict[str, str]) -> Any:
    r = RelayStreamingResponse.__new__(RelayStreamingResponse)  # no stream needed for its head
    r.headers = dict(headers)
    return r


def _by_comprehension(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [*_SSE_HEAD, *[(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()],
            _SSE_CONTENT_TYPE]


@settings(max_examples=500, deadline=None)
@given(headers=st.dictionaries(_TEXT, _TEXT, max_size=7))
def test_raw_headers_are_the_comprehensions(headers: dict[str, str]) -> None:
    try:
        expected = _by_comprehension(headers)
    except UnicodeEncodeError:
        with pytest.raises(UnicodeEncodeError):
            _ = _response(headers).raw_headers
        return
    assert _response(headers).raw_headers == expected


def test_the_usual_head() -> None:
    h = {"x-tokenfleet-instance": "i0", "X-Request-Id": "req-1", "x-tokenfleet-cached-tokens": "16"}
    assert _response(h).raw_headers == [*_SSE_HEAD, (b"x-tokenfleet-instance", b"i0"), (b"x-request-id", b"req-1"),
                                        (b"x-tokenfleet-cached-tokens", b"16"), _SSE_CONTENT_TYPE]
