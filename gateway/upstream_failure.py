"""How an attempt on an engine instance failed before the client saw a byte, shared by the
relay (`gateway.relay`), hedged prefill (`gateway.hedge`) and continuation legs (`gateway.resume`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.relay import Dispatch


class NotAStream(Exception):
    """An engine answered a stream request with an error body (4xx) or not as SSE: pass it on whole."""

    def __init__(self, d: Dispatch) -> None:
        super().__init__(d.iid)
        self.d = d


class RetryableFailure(Exception):
    """The instance failed before the client saw a byte: try another one.

    `detail` is for the log (it may name internal addresses); `public` is what a client may
    read. `timed_out`: the instance stalled rather than failed."""

    def __init__(self, kind: str, detail: str, public: str, timed_out: bool = False) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail
        self.public = public
        self.timed_out = timed_out


class SplitFailed(RetryableFailure):
    """A P/D split request failed before the client's first byte (`gateway.pd_flow`): the relay's
    attempt loop retries it locally, leaving out `excluded`, which the flow has already marked
    failed and logged. `public` is what the client reads when no instance is left for that."""

    def __init__(self, excluded: list[str]) -> None:
        super().__init__("pd_split", ",".join(excluded),
                         "the prefill leg failed and no instance is left to prefill locally")
        self.excluded = excluded


def describe(e: BaseException) -> str:
    """For the log only: aiohttp's texts name hosts and ports."""
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
