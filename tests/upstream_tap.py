"""Act on an engine at the gateway's own reads of its stream, not at the client's.

A test that kills, stops or drains an engine mid-stream must act while the engine still has
tokens to generate, or it checks a stream that never failed. Timed off the client's reads, the
action comes after the gateway read the bytes, relayed them and the client read and parsed
them; the engine is another process and keeps generating meanwhile, and on a loaded machine
that is the whole rest of its budget (CI: a real vLLM engine on CPU generated ~1,900 tokens
before the client had read its first).

`UpstreamTap` wraps the relay's upstream client (`Relay.session`, set by the app's lifespan:
every leg the relay sends, first attempt, retry or continuation, goes through its `post`, and
the relay reads every byte through the answer's `content.readany()`). The test's action runs
inside the gateway's read that brings a leg of a request to its n-th token, before the relay has
processed those bytes: the earliest moment the gateway itself can know, with nothing of the
gateway or the client run in between. An action that signals the engine (SIGSTOP, SIGKILL) is a
system call there; an action on the gateway's own state should be scheduled (`loop.call_soon`),
not run inside its read. The window left is the engine generating all of its remaining budget
between sending the n-th token and the gateway's read of it; `Fired.done` says when that
happened (the same read carried [DONE]), and `finished` whether [DONE] came on that leg at all
(sent before the action, read after it), so a test can fail saying so rather than on a usage
without a continuation.

`before_first_send` runs an action inside the gateway's `post` of a request's first leg, before
a byte of it has left: on the engine the request is about to go to, which cannot have started
on it yet (lowering that engine's priority below the gateway's, say).

No production code knows about it; the relay's session is put back when the `with` ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from fleetcore.sse import StreamReader
from gateway.relay import Relay
from gateway.upstream_http import UpstreamClient, UpstreamResponse

Action = Callable[[str], None]  # called with the instance id of the leg whose read reached the count


@dataclass(frozen=True)
class Fired:
    """One action taken: on which request and leg (0: the first; 1: the first continuation ...),
    at which instance, with how many of the request's (`tokens`) and the leg's (`leg_tokens`)
    token events read so far by the gateway, and whether that read already carried [DONE]
    (`done`: the engine had finished before the gateway read its n-th token; acting was too late)."""

    request_id: str
    leg: int
    instance_id: str
    tokens: int
    leg_tokens: int
    done: bool
    at: float  # time.monotonic()


@dataclass
class _Trigger:
    tokens: int
    act: Action
    leg: int  # 0: the first leg; 1: the first continuation ...
    fired: bool = False


@dataclass
class _Request:
    triggers: list[_Trigger] = field(default_factory=list)
    before_send: list[Action] = field(default_factory=list)  # once, at its first send
    legs: int = 0  # SSE answers opened for it so far
    tokens: int = 0  # token events the gateway has read for it, all legs
    finished: set[int] = field(default_factory=set)  # the legs whose [DONE] the gateway has read


class _TappedResponse:
    """An upstream answer whose reads are counted before the relay sees them (what the relay
    uses of `UpstreamResponse`: status, headers, content.readany, read, release, close)."""

    __slots__ = ("_resp", "_tap", "_rid", "_iid", "_leg", "_reader", "_seen")

    def __init__(self, resp: UpstreamResponse, tap: UpstreamTap, rid: str, iid: str, leg: int) -> None:
        self._resp = resp
        self._tap = tap
        self._rid = rid
        self._iid = iid
        self._leg = leg
        self._reader = StreamReader()
        self._seen = 0  # this leg's token events counted so far

    @property
    def status(self) -> int:
        return self._resp.status

    @property
    def headers(self) -> Any:
        return self._resp.headers

    @property
    def content(self) -> _TappedResponse:
        return self

    async def readany(self) -> bytes:
        data = await self._resp.readany()
        if data:
            self._reader.feed(data, 0.0)
            stats = self._reader.stats
            new, self._seen = stats.token_events - self._seen, stats.token_events
            if new:
                self._tap._tokens_read(self._rid, self._iid, self._leg, new, self._seen, stats.done)
            if stats.done:
                self._tap._requests[self._rid].finished.add(self._leg)
        return data

    async def read(self) -> bytes:
        parts: list[bytes] = []
        while data := await self.readany():
            parts.append(data)
        return b"".join(parts)

    def release(self) -> None:
        self._resp.release()

    def close(self) -> None:
        self._resp.close()

    async def __aenter__(self) -> _TappedResponse:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if exc is None:
            self.release()
        else:
            self.close()


class UpstreamTap:
    """`with UpstreamTap(relay) as tap:` — while open, `tap.at_tokens(rid, n, act)` runs `act(iid)`
    inside the gateway's read that brings the first leg of request `rid` (the client's
    `X-Request-Id`) to its n-th token event (`leg=`: a continuation's). Only requests with a
    trigger are tapped; every other call goes straight through."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.fired: list[Fired] = []
        self.errors: list[BaseException] = []  # raised by an action: reported when the `with` ends
        self._inner: UpstreamClient | None = None
        self._requests: dict[str, _Request] = {}

    def at_tokens(self, request_id: str, n: int, act: Action, leg: int = 0) -> None:
        """Once the gateway has read `n` token events of leg `leg` of `request_id` (each leg
        counts its own: a dying leg's last tokens never reach the next one's count), call `act`
        with that leg's instance id, once, inside that read."""
        assert n >= 1
        self._requests.setdefault(request_id, _Request()).triggers.append(_Trigger(n, act, leg))

    def before_first_send(self, request_id: str, act: Action) -> None:
        """Call `act` with the instance id the gateway sends `request_id` to first, inside its
        `post`, before a byte of the request has left (the engine cannot have started on it)."""
        self._requests.setdefault(request_id, _Request()).before_send.append(act)

    def fired_for(self, request_id: str) -> list[Fired]:
        return [f for f in self.fired if f.request_id == request_id]

    def finished(self, request_id: str, leg: int) -> bool:
        """Whether the gateway has read [DONE] on that leg. On a leg whose engine an action
        stopped or killed, that [DONE] was sent before the action: the engine had finished."""
        req = self._requests.get(request_id)
        return req is not None and leg in req.finished

    # --- in place of the relay's upstream client ---

    def __enter__(self) -> UpstreamTap:
        assert self.relay.session is not None, "the gateway's lifespan has not started its upstream client"
        assert not isinstance(self.relay.session, UpstreamTap), "a tap is already open on this relay"
        self._inner = self.relay.session
        self.relay.session = self  # type: ignore[assignment]
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.relay.session is self:
            self.relay.session = self._inner
        if exc is None and self.errors:
            raise AssertionError(f"a tap action failed: {self.errors[0]!r}") from self.errors[0]

    async def post(self, url: str, *, data: bytes, headers: Mapping[str, str]) -> Any:
        assert self._inner is not None
        rid = headers.get("X-Request-Id", "")
        req = self._requests.get(rid)
        if req is not None and req.before_send:
            acts, req.before_send = req.before_send, []
            for act in acts:
                self._run(act, self._instance_of(url))
        resp = await self._inner.post(url, data=data, headers=headers)
        if req is None or not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            return resp
        leg, req.legs = req.legs, req.legs + 1
        return _TappedResponse(resp, self, rid, self._instance_of(url), leg)

    def __getattr__(self, name: str) -> Any:  # close, idle_count ...: the wrapped client's
        inner = self.__dict__.get("_inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def _instance_of(self, url: str) -> str:
        for st in self.relay.state.states():
            if url.startswith(st.instance.url + "/"):
                return st.instance.instance_id
        raise AssertionError(f"no instance serves {url}")

    def _tokens_read(self, rid: str, iid: str, leg: int, new: int, leg_tokens: int, done: bool) -> None:
        req = self._requests[rid]
        req.tokens += new
        for t in req.triggers:
            if t.fired or t.leg != leg or leg_tokens < t.tokens:
                continue
            t.fired = True
            self.fired.append(Fired(rid, leg, iid, req.tokens, leg_tokens, done, time.monotonic()))
            self._run(t.act, iid)

    def _run(self, act: Action, iid: str) -> None:
        try:
            act(iid)
        except Exception as e:  # never into the gateway's send or read: the test hears it at the end
            self.errors.append(e)
