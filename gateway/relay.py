"""A request's way through the gateway after validation: admission → site → instance → upstream → client.

- Admission (`gateway.admission`, SLOMax by default): may queue or refuse the request
  before anything is chosen; its hint `avoid_instances` is excluded from the choice
  when that leaves a candidate. It hears where the request went, its first token, retries
  and each attempt's outcome, and gets its capacity back once the response is over.
- Choice: `fleetmind.place` (the simulator's too): the site chooser picks a site, the
  router an instance in that site's pool; failed attempts are excluded, the avoid hint
  gives way when it leaves nothing.
- Forward: `gateway.upstream_http` (a lean HTTP/1.1 client) to `instance.url + path`, with the model renamed to the served
  name and, for streams, `stream_options.include_usage` forced on (the usage chunk
  is how the gateway learns output and cached tokens); the client sees that chunk
  only if it asked for it.
- Retry once elsewhere when an instance fails before the first byte reached the
  client (connection refused/reset, 5xx, stream closed before any event, nothing
  within the first-byte deadline); the failed instance is excluded and marked unready
  until a health check started after the failure passes. All stalled: 504; else 502.
- Every wait on an engine has a deadline (`gateway.deadlines`: connect, first byte,
  idle between reads); client-facing errors name the instance and what happened, never
  its address (the log keeps the detail).
- Cancellation: a client that goes away closes the upstream response, which is
  how OpenAI-compatible engines learn to abort (vLLM, SGLang, the sim worker).
- After a stream started, an upstream that dies, stalls or is drained is continued on
  another instance (`gateway.resume`: the decision, the leg, the drain migration;
  `gateway.continuation`: the leg's body and the splice): prompt + what was relayed, the
  rest of the budget, spliced into the client's stream. Where it may not be (unfaithful, the
  limit, nowhere allowed) the stream ends with an SSE error event and `[DONE]`, never a silent
  truncation; so does the end of graceful shutdown's grace (`gateway.shutdown`). A whole
  answer that may be continued is read from the engine as a stream and assembled.
- Hedged prefill (`gateway.hedge`, off by default): a stream whose instance is slow to its
  first event is sent to a second one too and the first to answer is kept.

This module is the request's way; the hedge and the continuation legs reach back into it only
through the narrow `HedgeHost` and `ResumeHost` protocols that `Relay` satisfies, and the
failures an attempt can end in are `gateway.upstream_failure`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, AsyncGenerator, AsyncIterator, TypeVar

import aiohttp
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from engine_adapters.base import Instance
from fleetcore.continuation import ContinuationReason
from fleetcore.fleet_config import FleetConfig
from fleetcore.first_byte import ATTEMPTS_BEFORE_FIRST_BYTE
from fleetcore.model_tokenizer import PromptTokenizer
from fleetcore.policies import InstanceRouter, SiteChooser
from fleetcore.sse import MAX_EVENT_BYTES, PlainTokens, SSESplitter, StreamStats, parse_sse_event, usage_of_body
from fleetcore.types import Candidate, RequestOutcome, RequestProfile, RouteDecision, SiteDecision
from fleetmind.place import Choice, place
from gateway.admission import AdmissionGate
from gateway.continuation import CONTINUED_HEADER, Continuation, ContinuationMetrics, assembled_answer, strip_token_ids
from gateway.aliases import SERVED_MODEL_HEADER, renamed_body, renamed_event
from gateway.deadlines import Deadlines, Interrupted, UpstreamStalled, UpstreamWatch
from gateway.errors import (GatewayError, gateway_shutting_down, no_ready_instance, redact_addresses,
                            sse_error_event, upstream_failed, upstream_timeout)
from gateway.fleet_state import FleetState
from gateway.head_hold import SCOPE_KEY as HEAD_HOLD
from gateway.head_hold import HeadHold
from gateway.hedge import HedgeMetrics, hedge_delay, open_hedged
from gateway.json_body import sent_as_parsed
from gateway.metrics import GatewayMetrics
from gateway.requests import ParsedRequest
from gateway.resume import DRAINED, continuation_of, drained, resume
from gateway.route_share import RouteShare
from gateway.routing import index_flusher
from gateway.shutdown import Shutdown
from gateway.tokenize_pool import TokenizePool
from gateway.upstream_failure import NotAStream, RetryableFailure, SplitFailed, describe
from gateway.upstream_http import UpstreamClient, UpstreamResponse

if TYPE_CHECKING:
    from gateway.pd_flow import PDFlow

log = logging.getLogger("tokenfleet.gateway")
T = TypeVar("T")

MAX_ATTEMPTS = ATTEMPTS_BEFORE_FIRST_BYTE  # the first try plus one retry elsewhere (the simulator's too)
CLIENT_CLOSED = 499  # nginx's status for "client closed request"; only ever seen in metrics
INVALID_STREAM = "stream_invalid"  # upstream_errors{kind}: an engine stream the gateway could not read
INVALID_ANSWER = "answer_invalid"  # upstream_errors{kind}: a whole engine answer the gateway could not read
ANSWER_TOO_LARGE = "answer_too_large"  # upstream_errors{kind}: a whole engine answer past MAX_EVENT_BYTES
ENGINE_ERROR_EVENT = "stream_error"  # upstream_errors{kind}: an error the engine itself reported mid-stream
_ERROR_SNIPPET = 300
_ERROR_READ_BYTES = 4 * _ERROR_SNIPPET  # of an error answer's body: its snippet's characters, UTF-8


class ClientGone(Exception):
    """The client disconnected before the response was handed over."""


def upstream_fields(parsed: ParsedRequest, served_model: str, stream: bool | None = None,
                    token_ids: bool = False) -> dict[str, Any]:
    """The client's body, unknown fields untouched, with the served model name and forced usage:
    a new top-level dict (nested values are the client's, shared: change only top-level keys).
    `stream` True: asked as a stream whatever the client asked (a continuable whole answer);
    `token_ids`: the engine's generated token ids asked for (what a continuation re-prefills)."""
    body = dict(parsed.body)
    body["model"] = served_model
    if stream:
        body["stream"] = True
    if token_ids:
        body["return_token_ids"] = True
    if parsed.stream or stream:
        opts = body.get("stream_options")
        body["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
    return body


def upstream_body(parsed: ParsedRequest, served_model: str, stream: bool | None = None,
                  token_ids: bool = False) -> bytes:
    """`upstream_fields`, encoded as sent: the client's own bytes where they already say exactly
    that (the served model's name, no stream or token ids asked for on its behalf, and provably
    no key given twice: `json_body.sent_as_parsed`), a stream's usage request appended to them
    where the client named no `stream_options` (`upstream_fields` adds it last too). That saves
    re-encoding the whole prompt (~43 k instructions of a 64-token request's ~2.1 M,
    bench/README.md "Issue 14: the request's logic"). Else `upstream_fields`, encoded."""
    raw = parsed.raw
    if raw is not None and raw[0] is parsed.body and not token_ids and (parsed.stream or not stream):
        body = parsed.body
        if body.get("model") == served_model and sent_as_parsed(raw[1], body):
            if not parsed.stream:
                return raw[1]
            opts = body.get("stream_options")
            if type(opts) is dict and opts.get("include_usage") is True:
                return raw[1]
            if "stream_options" not in body:  # (a JSON object's bytes end with `}` and JSON whitespace)
                return raw[1].rstrip()[:-1] + _USAGE_MEMBER
    return json.dumps(upstream_fields(parsed, served_model, stream, token_ids), separators=(",", ":")).encode()


_USAGE_MEMBER = b',"stream_options":{"include_usage":true}}'  # (the body has a member: its model)


# --- decisions kept for /debug/decisions ---

def _candidates(cands: Iterable[Candidate]) -> list[dict[str, Any]]:
    return [{"name": c.name, "score": c.score, "detail": dict(c.detail)} for c in cands]


class DecisionLog:
    """The last decisions, kept as the policies returned them and formatted only when read:
    explanations must cost nothing on the request path."""

    def __init__(self, size: int = 256) -> None:
        self._entries: deque[tuple[float, RequestProfile, int, tuple[str, ...], SiteDecision,
                                   RouteDecision | None, tuple[int, str] | None]] = deque(maxlen=size)

    def add(self, profile: RequestProfile, attempt: int, excluded: Collection[str],
            site: SiteDecision, route: RouteDecision | None, leg: tuple[int, str] | None = None) -> None:
        """`leg`: (continuation number, why) for a continuation's choice; None for a first attempt."""
        self._entries.append((time.time(), profile, attempt, tuple(excluded), site, route, leg))

    def last(self, n: int, tenant: str | None = None) -> list[dict[str, Any]]:
        """The last `n` decisions, of `tenant` only when given (a tenant sees only its own)."""
        entries = [e for e in self._entries if tenant is None or e[1].tenant == tenant]
        return [_format_decision(*e) for e in entries[-n:]] if n > 0 else []


def _format_decision(at: float, profile: RequestProfile, attempt: int, excluded: tuple[str, ...],
                     site: SiteDecision, route: RouteDecision | None,
                     leg: tuple[int, str] | None) -> dict[str, Any]:
    return {
        "request_id": profile.request_id, "time": at, "attempt": attempt,
        "continuation": leg[0] if leg else 0, "continuation_reason": leg[1] if leg else None,
        "model": profile.model, "version": profile.model_version, "tenant": profile.tenant,
        "client_region": profile.client_region, "prompt_tokens": profile.prompt_tokens,
        "excluded": sorted(excluded),
        "site": site.site, "site_reason": site.reason, "site_candidates": _candidates(site.candidates),
        "instance": route.instance_id if route else None,
        "reason": route.reason if route else None,
        "candidates": _candidates(route.candidates) if route else [],
        "predicted_ttft_s": route.predicted_ttft_s if route else None,
        "network_s": route.network_s if route else 0.0,  # the round trip to the site in that TTFT
        "held_s": route.held_s if route else 0.0,  # waited before the decision: not in it, in the header's
        "cached_tokens_estimate": route.cached_tokens if route else 0,
    }


# --- client disconnects ---

# How long a wait on the client's behalf (admission queue, response head, first event, the stream)
# may last before a task starts watching the receive channel. Most answers are over sooner, and
# then no watcher task exists at all: a task per request was ~5% of a relayed stream's CPU
# (bench/README.md, "Where the time goes"). It is also the longest a disconnect may go unnoticed.
LAZY_WATCH_S = 0.05


class DisconnectWatch:
    """Notices the client's `http.disconnect` while the gateway works for it, at the cost of a
    task only when that work lasts. `race(aw)` awaits `aw` in the caller's own task; a wait
    still pending after LAZY_WATCH_S (at most; one timer for the request's races in turn)
    starts the watcher (at most one per request), which reads
    the receive channel and, when the client leaves, cancels every task then waiting in `race`
    (the request's own, a P/D decode leg's): each one's `race` raises ClientGone. (uvicorn's
    `send` returns silently on a closed connection, so a failing send cannot be the signal.)
    One per request, from `handle` to the end of the response.

    The waiting state is per task: one slot for the request let a second task's `race`
    overwrite the first's, which then never heard that the client left. A task this watch
    cancelled gets ClientGone even when another cancel landed with it (a P/D flow aborting the
    leg, the server): the client has left either way, and a plain CancelledError would end its
    dispatch with no status instead of 499. `left` stays set for whoever ends work on a
    CancelledError; `take_gone` lets exactly one place count the request's 499."""

    __slots__ = ("_receive", "_loop", "_watcher", "_timer", "_waiting", "_cancelled", "_counted", "left")

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._loop = asyncio.get_running_loop()
        self._watcher: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._waiting: set[asyncio.Task[Any]] = set()  # every task inside `race` now
        self._cancelled: set[asyncio.Task[Any]] = set()  # the waiting tasks this watch cancelled
        self._counted = False  # the request's 499 has been counted
        self.left = False  # the client disconnected

    async def aclose(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watcher
            self._watcher = None

    def take_gone(self) -> bool:
        """True once per request, for the one place that counts its 499 (the dispatch cut short,
        the queue left, the prefill leg abandoned); False after that and before the client left."""
        if not self.left or self._counted:
            return False
        self._counted = True
        return True

    async def race(self, aw: Awaitable[T]) -> T:
        """`aw`'s result, or ClientGone (and `aw` cancelled) when the client leaves first."""
        if self.left:
            if asyncio.iscoroutine(aw):
                aw.close()
            raise ClientGone()
        # The loop given: CPython 3.11's current_task() without one looks it up with a getpid()
        # system call each time (get_running_loop's fork check), 3-4 races a request.
        task = asyncio.current_task(self._loop)
        if task is None or task in self._waiting:  # nested: the outer race covers it
            return await aw
        self._waiting.add(task)
        if self._watcher is None and self._timer is None:
            # One timer serves the request's races one after another (left armed when a race
            # ends, cancelled by `aclose`): a timer armed and cancelled per race was 4 of each
            # a request. A race that begins under an earlier race's timer may get its watcher
            # sooner than LAZY_WATCH_S, never later; one that fires with no race waiting starts
            # nothing, and the next race arms anew.
            self._timer = self._loop.call_later(LAZY_WATCH_S, self._start)
        try:
            return await aw
        except asyncio.CancelledError:
            if task in self._cancelled:
                raise ClientGone() from None
            raise
        finally:
            if task in self._cancelled:
                # Our cancel is taken back (another canceller's, if any, stays counted on the task),
                # whatever `aw` made of it: ClientGone above; or, where `aw` swallowed it and ended
                # on its own (3.11's wait_for can), its result or error, which owns resources and
                # stands; the request's next `race` raises ClientGone.
                self._cancelled.discard(task)
                task.uncancel()
            self._waiting.discard(task)

    def _start(self) -> None:
        self._timer = None
        if self._waiting and self._watcher is None and not self.left:
            self._watcher = self._loop.create_task(self._watch())

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self.left = True
        for task in list(self._waiting):
            if task not in self._cancelled:
                self._cancelled.add(task)
                task.cancel()


# --- one dispatch to one instance ---

@dataclass(slots=True)
class Target:
    site: str
    instance: Instance
    route: RouteDecision | None = None
    site_reason: str = ""
    prefill: Target | None = None  # a disaggregated request's prefill instance (gateway.pd_flow)


@dataclass(slots=True)
class Dispatch:
    """One attempt on one instance; `finish` runs exactly once and does all the bookkeeping."""

    relay: Relay
    parsed: ParsedRequest
    target: Target
    watch: UpstreamWatch  # every wait on the engine goes through it (deadlines, shutdown)
    first_byte_at: float  # loop time by which the first byte must have come
    started: float  # relay clock when it was sent: a failure mark older than this is old news
    resp: UpstreamResponse | None = None
    stats: StreamStats = field(default_factory=StreamStats)
    finished: bool = False
    # A continuation leg: (relay clock of the request's first token, tokens sent before this leg),
    # so that admission hears the request's outcome, not only this leg's.
    carried: tuple[float | None, int] | None = None

    @property
    def iid(self) -> str:
        return self.target.instance.instance_id

    def engine_alive(self) -> bool:
        """Health checks still pass and nothing failed on it since this dispatch began."""
        st = self.relay.state.get(self.iid)
        return st is not None and st.ready and st.failed_at < self.started

    def close_upstream(self, abort: bool) -> None:
        if self.resp is None:
            return
        if abort:
            self.resp.close()  # drops the connection: this is what tells the engine to abort
        else:
            self.resp.release()
        self.resp = None

    def finish(self, *, ok: bool, status: str | None, error: str | None = None,
               cancelled: bool = False, abort: bool = False, at: float | None = None) -> None:
        """Release upstream, in-flight count, metrics, policy feedback. `status` None: not answered.
        `at`: the relay clock the dispatch ended at, when that was before now (default: now)."""
        if self.finished:
            return
        self.finished = True
        self.close_upstream(abort or cancelled or not ok)
        r = self.relay
        self.watch.close()
        r.shutdown.untrack(self.watch)
        iid = self.target.instance.instance_id
        r.metrics.set_inflight(iid, r.state.end(iid))
        parsed = self.parsed
        profile = parsed.profile
        if status is not None:
            r.metrics.answered(profile.model, self.target.site, iid, status)
        outcome = self._outcome(ok, error, cancelled, profile, iid, at)
        r.metrics.record_outcome(profile.model, outcome)
        r.observe(outcome, outcome if self.carried is None else self._request_outcome(outcome))
        if parsed.obs is not None:
            reason = self.stats.finish_reason
            parsed.obs.attempt_ended(outcome, status, (reason,) if reason else None)

    def _outcome(self, ok: bool, error: str | None, cancelled: bool, profile: RequestProfile,
                 iid: str, at: float | None = None) -> RequestOutcome:
        now = self.relay.clock() if at is None else at
        arrival = profile.arrival
        stats = self.stats
        counts = stats.counts()  # read once: `output_tokens()` is its completion_tokens or the count
        out_tokens = counts.completion_tokens if counts.completion_tokens is not None else stats.token_events
        first, last = stats.first_token_at, stats.last_token_at
        if not profile.stream:
            # a whole answer read as a stream (to be continuable) is judged as a whole answer, as
            # before: its client sees no first token, so no TTFT or time per token is claimed
            first = last = None
        # n choices decode side by side: time per output token is per sequence, not per token summed
        per_seq = out_tokens / max(1, profile.n)
        tpot = (last - first) / (per_seq - 1) if first is not None and last is not None and per_seq > 1 else None
        return RequestOutcome(
            request_id=profile.request_id, instance_id=iid, site=self.target.site,
            ok=ok, prompt_tokens=counts.prompt_tokens or profile.prompt_tokens,
            cached_tokens=counts.cached_tokens,
            output_tokens=out_tokens, ttft_s=(first - arrival) if first is not None else None,
            mean_tpot_s=tpot, e2e_s=now - arrival, error=error, cancelled=cancelled,
            # the round trip to the site inside that TTFT, as the health probes measure it (the
            # router learns engine speeds without it; 0 where no probe has answered yet)
            network_s=self.relay.state.network_rtt_s(self.target.site))

    def _request_outcome(self, leg: RequestOutcome) -> RequestOutcome:
        """The request as a whole when this is a continuation leg: its first token, every token."""
        if self.carried is None:
            return leg
        first, before = self.carried
        ttft = first - self.parsed.profile.arrival if first is not None else leg.ttft_s
        return replace(leg, output_tokens=leg.output_tokens + before, ttft_s=ttft)

    def headers(self) -> dict[str, str]:
        h = {"x-tokenfleet-instance": self.iid, "x-tokenfleet-site": self.target.site,
             "x-request-id": self.parsed.profile.request_id, SERVED_MODEL_HEADER: self.parsed.profile.model}
        if self.relay.worker is not None:
            h["x-tokenfleet-worker"] = self.relay.worker
        route = self.target.route
        if route is not None:
            # The router's prediction, so operators can compare it with what they saw: the TTFT from
            # the request's arrival here (the time it already waited, then the prediction from dispatch).
            h["x-tokenfleet-cached-tokens"] = str(route.cached_tokens)
            ttft = route.ttft_from_arrival_s
            if ttft is not None:
                h["x-tokenfleet-predicted-ttft-ms"] = f"{ttft * 1000:.1f}"
        return h


@dataclass(frozen=True, slots=True)
class LegFailure:
    """How a stream's upstream failed after the client got its first byte. `reason`: why it may be
    continued elsewhere (None: it may not: the gateway itself is ending it); `kind`: the upstream
    error counted (None: not the engine's fault); `code`/`public`: the error event's; `detail`: the log's."""

    reason: ContinuationReason | None
    kind: str | None
    code: str
    public: str
    detail: str


class RelayStream:
    """The upstream SSE body, relayed event by event with usage chunks filtered and stats taken.

    When the upstream dies, stalls or is drained after the first byte and the request may be
    continued (`cont`), the relay sends a continuation to another instance (`gateway.resume`) and
    this stream reads on from it (`switch`), its events spliced into the client's format."""

    def __init__(self, dispatch: Dispatch, include_usage: bool, cont: Continuation | None = None) -> None:
        self.d = dispatch
        self.include_usage = include_usage
        self.cont = cont  # None: this request is not continued (disabled, or it cannot be faithfully)
        self.splicing = False  # reading a continuation leg
        self.gap_from: float | None = None  # relay clock of the last token before the failure
        self.gap_reason = ""
        self.first_token_at: float | None = None  # relay clock of the request's first token (any leg)
        self._splitter = SSESplitter()
        self._pending = b""
        self._plain = PlainTokens()  # `plain_token_text`, mostly from the stream's first plain event
        # [DONE] is in a chunk being handed on: the dispatch finishes once the consumer has it
        # (`_finish_due`), at the relay clock of this moment (`_checked`).
        self._done_at: float | None = None

    def switch(self, dispatch: Dispatch) -> None:
        """Read on from a continuation leg."""
        self.d = dispatch
        self.splicing = True
        self._splitter = SSESplitter()
        self._pending = b""

    async def _read(self, deadline: float | None = None) -> bytes:
        assert self.d.resp is not None
        if deadline is None:
            return await self.d.watch.wait(self.d.resp.content.readany())
        # A whole answer read as a stream waits for its first event as it would for the answer:
        # past the deadline, on while the engine passes its health checks (a queue under load).
        alive = None if self.d.parsed.stream else self.d.engine_alive
        return await self.d.watch.wait(self.d.resp.content.readany(), deadline=deadline, phase="first_byte",
                                       keep_waiting=alive, recheck_s=self.d.relay.state.poll_interval_s)

    def _process(self, events: list[bytes]) -> bytes:
        out: list[bytes] = []
        stats = self.d.stats
        first_seen = stats.first_token_at is not None
        rename = self.d.parsed.requested_model
        cont = self.cont
        now = self.d.relay.clock()  # one read's events arrived together
        # Plain token events pass on as bytes, unparsed (`plain_token_text` via `PlainTokens`), where nothing needs
        # the object: no rename, not a continuation leg, no engine ids to strip, and the
        # continuation's record already holds the first chunk's id.
        plain_ok = rename is None and not self.splicing and (
            cont is None or (not cont.engine_ids and cont.sent.id is not None))
        for raw in events:
            if stats.done:
                break
            if plain_ok and (text := self._plain.text(raw)) is not None:
                stats.token(now)
                if cont is not None:
                    cont.sent.add(text, None)
                out.append(raw)
                continue
            ev = parse_sse_event(raw)
            usage = stats.account(ev, now)
            if self.splicing:
                assert cont is not None
                if usage:  # the continuation's own usage: how much of its re-prefill was a cache hit
                    self.d.relay.continuation_metrics.reprefill_cached.labels(self.d.parsed.profile.model).inc(
                        stats.counts().cached_tokens)
                out.append(cont.splice(ev, usage))
                continue
            if cont is not None and ev.obj is not None:
                cont.sent.observe(ev.obj)  # what a continuation would have to rebuild
                if cont.engine_ids and ev.obj.get("choices"):
                    obj = strip_token_ids(ev.obj)
                    if rename is not None:
                        obj["model"] = rename
                    out.append(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")
                    continue
            if usage and not self.include_usage:
                continue  # the usage chunk the gateway asked for on its own behalf
            out.append(raw if rename is None else renamed_event(raw, ev.obj, rename))
        if not first_seen and stats.first_token_at is not None:
            if self.first_token_at is None:
                self.first_token_at = stats.first_token_at
                self.d.relay.first_token(self.d.parsed.profile.request_id)
            if self.splicing and self.gap_from is not None:
                self.d.relay.continuation_metrics.gap.labels(self.gap_reason).observe(
                    stats.first_token_at - self.gap_from)
                self.gap_from = None
        return b"".join(out)

    async def prefetch(self) -> None:
        """Read until the first whole event; failing here is still retryable."""
        iid = self.d.iid
        try:
            while not self._pending and not self.d.stats.done:
                data = await self._read(self.d.first_byte_at)
                if not data:
                    self._pending = self._process(self._splitter.flush())
                    if not self._pending:
                        raise RetryableFailure("empty_stream", "upstream closed the stream before any event",
                                               f"engine instance {iid} closed the stream before any event")
                    return
                self._pending = self._process(self._splitter.feed(data))
        except UpstreamStalled as e:
            raise _first_byte_timeout(iid, e) from None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise RetryableFailure("stream_start", describe(e),
                                   f"engine instance {iid} connection broke before the first event") from None
        except Interrupted:  # the gateway ended the wait (shutdown's grace is over, a drain): not the engine's fault
            raise
        except Exception as e:  # an event no parser expected (`"choices": 5`), or a bug: not a 500
            log.exception("request %s: the stream of %s could not be relayed", self.d.parsed.profile.request_id, iid)
            raise RetryableFailure(INVALID_STREAM, repr(e),
                                   f"engine instance {iid} sent a stream the gateway could not relay") from None

    def take_pending(self) -> bytes:
        chunk, self._pending = self._pending, b""
        return self._checked(chunk) if chunk else b""

    async def iter_bytes(self) -> AsyncGenerator[bytes, None]:
        relay = self.d.relay
        try:
            if self._pending:
                yield self.take_pending()
                self._finish_due()
            while True:
                failure = None
                async for chunk in self._leg():
                    if isinstance(chunk, LegFailure):
                        failure = chunk
                    else:
                        yield chunk
                        self._finish_due()
                if failure is None:
                    return
                try:
                    resumed = await resume(relay, self, failure)
                except Exception:  # a bug in continuing must still end the stream with its error event
                    log.exception("request %s: continuation failed", self.d.parsed.profile.request_id)
                    self.d.finish(ok=False, status="stream_error", error="continuation failed", abort=True)
                    resumed = None
                if resumed is None:
                    yield self._fail(failure)
                    return
                if resumed:
                    yield resumed
                    self._finish_due()
        finally:
            relay.live.discard(self)

    async def _leg(self) -> AsyncIterator[bytes | LegFailure]:
        """The current leg's bytes; its failure, if it fails, as the last item."""
        iid = self.d.iid
        try:
            while not self.d.stats.done:
                data = await self._read()
                if not data:
                    break
                chunk = self._process(self._splitter.feed(data))
                if chunk:
                    yield self._checked(chunk)
            if not self.d.stats.done:
                tail = self._process(self._splitter.flush())
                if tail:
                    yield tail
        except Interrupted as i:
            if i.code == DRAINED:  # moved off an instance being drained: not the engine's fault
                yield LegFailure("drained", None, "upstream_error", f"engine instance {iid} was drained", i.message)
            else:  # graceful shutdown's grace is over: the gateway itself is going away
                yield LegFailure(None, None, i.code, i.message, i.message)
            return
        except UpstreamStalled as e:
            # a stalled engine (stopped, hung, partitioned) gets no new work until it proves healthy
            self.d.relay.state.mark_failed(iid, f"stalled mid-stream: {e}")
            yield LegFailure("stalled", "stream_idle_timeout", "upstream_timeout",
                             f"engine instance {iid} stalled mid-stream: nothing for {e.waited_s:.1f} s", str(e))
            return
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            detail = f"upstream stream broke: {describe(e)}"
            # a dropped connection mid-stream is an engine that died: stop sending it work now
            self.d.relay.state.mark_failed(iid, detail)
            yield LegFailure("engine_died", "stream_broken", "upstream_error",
                             f"engine instance {iid} connection broke mid-stream", detail)
            return
        except Exception as e:
            # Raised on, the client's stream was cut without its error event and the dispatch
            # booked as a client that left.
            yield self._unreadable(e)
            return
        if not self.d.stats.done:
            message = f"engine instance {iid} ended the stream without [DONE]"
            yield LegFailure("engine_died", "stream_truncated", "upstream_error", message, message)

    def _unreadable(self, e: Exception) -> LegFailure:
        """An event no reader expected (an engine's `"choices": 5`), or a bug of the gateway's: the
        engine's failure (`stream_invalid`), whose stream still ends with its error event. Not
        continued: the same engine output would meet the same code."""
        iid = self.d.iid
        log.error("request %s: the stream of %s could not be relayed", self.d.parsed.profile.request_id, iid,
                  exc_info=e)
        return LegFailure(None, INVALID_STREAM, "upstream_error",
                          f"engine instance {iid} sent a stream the gateway could not relay", repr(e))

    def unreadable(self, e: Exception) -> LegFailure:
        """What this stream handed on could not be read by the layer above it (the Responses API's
        translation): booked now as the relay books a stream it cannot read itself (`_leg`), the
        engine's failure, neither a success (its [DONE] may have passed) nor a client that left
        (the response's `close` next). The caller ends the client's stream with the failure's
        `code` and `public` in its own error event."""
        f = self._unreadable(e)
        self.end_leg(f)
        return f

    def _checked(self, chunk: bytes) -> bytes:
        """Note that [DONE] passed by in `chunk` (the dispatch's end, at this moment's relay
        clock); the dispatch finishes once the chunk is handed on (`_finish_due`)."""
        if self.d.stats.done and self._done_at is None:
            self._done_at = self.d.relay.clock()
        return chunk

    def _finish_due(self) -> None:
        """Finish the dispatch whose [DONE] has been handed on: its bookkeeping (metrics, policy
        feedback, the span; ~50-90 us) after the client's write, not before it. A stream read
        whole in one go (a short answer) has its first and last bytes in one chunk: finishing
        first put all of it on the request's TTFT (bench/README.md, "Wakeups and syscalls per
        request at 200 req/s"). Run by whoever comes first: the consumer asking for the next
        chunk, or `close` (a consumer that stopped after the last one)."""
        at = self._done_at
        if at is None:
            return
        self._done_at = None
        error = self.d.stats.error
        if error is not None:  # the engine's own error event (or a chunk it garbled): its failure, counted as such
            self.d.relay.metrics.upstream_errors.labels(self.d.iid, ENGINE_ERROR_EVENT).inc()
        self.d.finish(ok=error is None, status="200" if error is None else "stream_error", error=error, at=at)

    def end_leg(self, f: LegFailure) -> None:
        """The current leg failed: log it, count it, release it (once)."""
        if self.d.finished:
            return
        log.warning("request %s on %s failed mid-stream: %s", self.d.parsed.profile.request_id, self.d.iid, f.detail)
        if f.kind is not None:
            self.d.relay.metrics.upstream_errors.labels(self.d.iid, f.kind).inc()
        self.d.finish(ok=False, status="stream_error", error=f.public, abort=True)

    def _fail(self, f: LegFailure) -> bytes:
        """End the stream: the client reads `public` (no addresses), the log `detail`."""
        self.end_leg(f)
        return sse_error_event(f.public, f.code)

    def would_outlive(self, seconds: float) -> bool:
        """Whether the current leg's remaining budget, at its pace so far, takes longer than `seconds`
        (unknown budget or pace: it may, so yes)."""
        st, p = self.d.stats, self.d.parsed.profile
        if p.max_tokens is None or st.first_token_at is None or st.last_token_at is None or st.token_events < 2:
            return True
        remaining = p.max_tokens - st.token_events
        tpot = (st.last_token_at - st.first_token_at) / (st.token_events - 1)
        return remaining > 0 and remaining * tpot > seconds

    async def close(self) -> None:
        """The response is over; if the stream did not finish, the client left: abort upstream."""
        self.d.relay.live.discard(self)
        self._finish_due()  # [DONE] was handed on: finished, whether or not the reader asked for more
        self.d.finish(ok=False, status=str(CLIENT_CLOSED), error="client disconnected", cancelled=True)


# The head of every relayed stream: what Starlette's StreamingResponse would send (its media type
# gets the charset it adds to text/* types), encoded once for the process.
_SSE_HEAD = ((b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"))
_SSE_CONTENT_TYPE = (b"content-type", b"text/event-stream; charset=utf-8")


class RelayStreamingResponse(Response):
    """Streams a RelayStream and stops the moment the client disconnects, whatever the ASGI server.

    Written with direct `send` calls (no Starlette StreamingResponse underneath): the head, then
    one body message per upstream read (`RelayStream` hands on each read's events as one chunk),
    the chunk that carries [DONE] with `more_body` False, so that it and the end of the body are
    one write to the client rather than two. `body_iterator` may be replaced (the Responses API
    translates the stream); then the end is sent after it is exhausted. `headers` is a plain
    dict until the head is sent (a fallback adds its header to it).

    Starlette only watches for disconnects on servers below ASGI spec 2.4 and otherwise
    notices at the next send (uvicorn's send does not even fail: it drops the bytes); an engine
    in a long prefill sends nothing for seconds. So the stream runs inside the request's
    `DisconnectWatch` (in this task: no sender task, and a watcher task only for a stream that
    lasts) and always cleans up in `finally`.
    """

    media_type = "text/event-stream"
    # Shadows Response's `headers` property: a plain dict per instance, not Starlette's MutableHeaders.
    headers: dict[str, str] = None  # type: ignore[assignment]

    def __init__(self, stream: RelayStream, headers: Mapping[str, str]) -> None:  # noqa: D107
        # Response.__init__ is not called: it renders a body and encodes headers this class does not use.
        self.status_code = 200
        self.background = None
        self.headers = dict(headers)
        self._relay_stream = stream
        self._own = stream.iter_bytes()
        self.body_iterator: AsyncIterator[bytes] = self._own  # replaceable (the Responses API translates it)
        self.started = False  # the head has been sent (FastLane: an error after it cannot be answered)
        self.on_done: Callable[[], None] | None = None  # after the stream is over, whichever way
        self.watch: DisconnectWatch | None = None  # the request's, handed over by `Relay.handle`

    @property
    def relay_stream(self) -> RelayStream:
        """The stream relayed (a layer that translates `body_iterator` books through it)."""
        return self._relay_stream

    @property
    def raw_headers(self) -> list[tuple[bytes, bytes]]:  # type: ignore[override]
        h = self.headers
        if h:
            # Names and values each joined by a newline, converted once and split again: no
            # Python step per header. A newline inside one (none of ours has one) makes more
            # parts than headers: then header by header, as before.
            names = "\n".join(h).lower().encode("latin-1").split(b"\n")
            values = "\n".join(h.values()).encode("latin-1").split(b"\n")
            if len(names) == len(values) == len(h):
                return [*_SSE_HEAD, *zip(names, values), _SSE_CONTENT_TYPE]
        head = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in h.items()]  # (no generator)
        return [*_SSE_HEAD, *head, _SSE_CONTENT_TYPE]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = self.watch if self.watch is not None else DisconnectWatch(receive)
        try:
            await watch.race(self._write(send, scope.get(HEAD_HOLD)))
        except (ClientGone, OSError):
            pass  # the client left: nobody to tell; `close` below aborts the upstream
        finally:
            await watch.aclose()
            await self._relay_stream.close()
            # Taken off before it runs: the callback usually holds this response (telemetry's
            # `done` reads its status), and left here that cycle would outlive the request until
            # the cyclic collector found it, with the whole stream state (~30 objects) behind it.
            on_done, self.on_done = self.on_done, None
            if on_done is not None:
                on_done()

    async def _write(self, send: Send, hold: HeadHold | None = None) -> None:
        self.started = True
        stream, own = self._relay_stream, self.body_iterator is self._own
        # The relay's own iterator hands its prefetched first chunk on without waiting: the head
        # may wait for it and leave in the same write (`gateway.head_hold`). Nothing else is held.
        holding = hold is not None and own and bool(stream._pending)
        if holding:
            hold.hold()  # type: ignore[union-attr]
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            ended = False
            async for chunk in self.body_iterator:  # run to its end, whose clean-up is the iterator's own
                # The relay's own iterator yields nothing after the read that finished the stream.
                ended = own and stream.d.stats.done
                await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
                if holding:  # that write carried the head: nothing is held from here on
                    holding = False
                    hold.release()  # type: ignore[union-attr]
            if not ended:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if holding:
                hold.release()  # type: ignore[union-attr]


def _is_sse(resp: UpstreamResponse) -> bool:
    return resp.headers.get("Content-Type", "").startswith("text/event-stream")


def _first_byte_timeout(iid: str, e: UpstreamStalled) -> RetryableFailure:
    return RetryableFailure("first_byte_timeout", str(e),
                            f"engine instance {iid} sent nothing within {e.waited_s:.1f} s", timed_out=True)


def _connect_failure(iid: str, e: BaseException) -> RetryableFailure:
    if isinstance(e, asyncio.TimeoutError):
        return RetryableFailure("connect_timeout", describe(e),
                                f"engine instance {iid} did not accept the connection in time", timed_out=True)
    os_error = getattr(e, "os_error", e)
    what = "refused the connection" if isinstance(os_error, ConnectionRefusedError) else "connection failed"
    return RetryableFailure("connect", describe(e), f"engine instance {iid} {what}")


# --- the relay ---

class Relay:
    def __init__(self, config: FleetConfig, state: FleetState, router: InstanceRouter,
                 site_chooser: SiteChooser, metrics: GatewayMetrics, decisions: DecisionLog,
                 tokenize_pool: TokenizePool, clock: Callable[[], float] = time.monotonic, retry_after_s: int = 1,
                 admission: AdmissionGate | None = None) -> None:
        self.admission = admission  # SLOMax (or FCFS) before any site or instance is chosen
        self.tokenize_pool = tokenize_pool  # the app's: continuations re-tokenize their prompts there
        self.config = config
        self.state = state
        self.router = router
        self.site_chooser = site_chooser
        self.metrics = metrics
        self.decisions = decisions
        self.clock = clock
        self.retry_after_s = retry_after_s
        self.session: UpstreamClient | None = None  # set by the app's lifespan
        self.worker: str | None = None  # "workerN" when one of `tokenfleet up --workers` (a response header)
        self.deadlines = Deadlines.from_settings(config.gateway)
        self.shutdown = Shutdown(config.gateway.shutdown_grace_s)  # SIGTERM: drain, then end what is left
        # Others that learn from traffic (FleetMind's placement loop): `arrived(profile)` for
        # every parsed request, before admission; `observe(outcome)` like the policies.
        self.listeners: list[Any] = []
        # Several replicas: each route also goes to the others' history-mode prefix index.
        self.route_share: RouteShare | None = None
        self._flush_index = index_flusher(router)  # the router's index update, once a request is sent
        # Continuation of streams whose engine fails after the first byte (gateway.continuation).
        self.continuation_limits = config.gateway.continuation.limits()
        self.continuation_metrics = ContinuationMetrics(metrics.registry)
        self.tokenizers: Mapping[str, PromptTokenizer] = {}  # the app's, set by create_app
        self.live: set[RelayStream] = set()  # streams handed to their clients and not over yet
        self.hedge_metrics = HedgeMetrics(metrics.registry)  # hedged prefill (gateway.hedge)
        state.on_drain.append(lambda instance_id: drained(self, instance_id))  # drain migration (gateway.resume)
        self.pd: PDFlow | None = None  # P/D disaggregation (gateway.pd_flow), set by the app for P/D fleets

    def observe(self, outcome: RequestOutcome, request_outcome: RequestOutcome | None = None) -> None:
        """Feed every policy that learns; a policy bug must not fail the request. Admission hears
        `request_outcome` (a continued request as a whole) where it differs from the attempt's."""
        if self.admission is not None:
            # the policy hears the final one, at release
            self.admission.attempt_ended(request_outcome if request_outcome is not None else outcome)
        for policy in (self.router, self.site_chooser, *self.listeners):
            try:
                policy.observe(outcome)
            except Exception:
                log.exception("%s.observe failed", type(policy).__name__)
        if self.route_share is not None:  # the other replicas' routers release what they booked for it
            self.route_share.ended(outcome.request_id)

    def choose(self, profile: RequestProfile, excluded: Collection[str], attempt: int,
               avoid: Collection[str] = (), leg: tuple[int, str] | None = None) -> Target | None:
        """Site and instance for this attempt (`fleetmind.place`); every try goes to the decision log.
        A continuation (`leg`: its number and why) is chosen the same way, region policy included."""
        choice: Choice = place(profile, self.state.view(), self.clock(), self.site_chooser, self.router,
                               exclude=excluded, avoid=avoid)
        for t in choice.tries():
            self.decisions.add(profile, attempt, t.excluded, t.site, t.route, leg)
        st = self.state.get(choice.instance.instance_id) if choice.instance is not None else None
        if st is None or choice.site.site is None:
            return None
        return Target(choice.site.site, st.instance, choice.route, choice.site.reason)

    def first_token(self, request_id: str) -> None:
        try:  # the router's load model reconciles its backlog; a policy bug must not fail the stream
            self.router.on_first_token(request_id, self.clock())
        except Exception:
            log.exception("%s.on_first_token failed", type(self.router).__name__)
        if self.route_share is not None:
            self.route_share.first_token(request_id)
        if self.admission is not None:
            self.admission.first_token(request_id)

    async def handle(self, request: Request, parsed: ParsedRequest, path: str) -> Response:
        rid = parsed.profile.request_id
        if self.shutdown.draining:
            self.metrics.answered(parsed.profile.model, "", "", "503")
            raise gateway_shutting_down("The gateway is shutting down; send the request to another replica.",
                                        self.retry_after_s)
        for listener in self.listeners:
            try:
                listener.arrived(parsed.profile)
            except Exception:
                log.exception("%s.arrived failed", type(listener).__name__)
        watch = DisconnectWatch(request.receive)
        resp: Response | None = None
        try:
            if self.admission is None:
                resp = await self._attempts(watch, parsed, path)
            else:
                resp = await self._admitted(watch, parsed, path, self.admission)
            return resp
        except GatewayError as e:
            e.headers.setdefault("x-request-id", rid)
            self.metrics.answered(parsed.profile.model, "", "", str(e.status))
            raise
        finally:
            if isinstance(resp, RelayStreamingResponse):
                resp.watch = watch  # the stream goes on after this returns: the response closes it
            else:
                await watch.aclose()

    async def _admitted(self, watch: DisconnectWatch, parsed: ParsedRequest, path: str,
                        gate: AdmissionGate) -> Response:
        """Admission first (it may queue, or refuse); then the attempts; then give the capacity back
        exactly once — when the response is built, or for a stream when the stream is over."""
        rid = parsed.profile.request_id
        try:
            parsed, avoid = await gate.enter(parsed, watch.race)
        except ClientGone:  # left while queued: nobody to answer
            if watch.take_gone():
                self.metrics.answered(parsed.profile.model, "", "", str(CLIENT_CLOSED))
            return Response(status_code=CLIENT_CLOSED)
        rid = parsed.profile.request_id  # admitted under its own id (a client's id in flight twice: not the same)
        streaming = False
        try:
            resp = await self._attempts(watch, parsed, path, avoid)
            if isinstance(resp, RelayStreamingResponse):
                resp.on_done = lambda: gate.release(rid)
                streaming = True
            return resp
        finally:
            if not streaming:
                gate.release(rid)

    async def _attempts(self, watch: DisconnectWatch, parsed: ParsedRequest, path: str,
                        avoid: Collection[str] = ()) -> Response:
        excluded: list[str] = []
        last: RetryableFailure | None = None
        for attempt in range(MAX_ATTEMPTS):
            if attempt > 0 and watch.left:  # the client left as the attempt failed: nobody to retry for
                if watch.take_gone():
                    self.metrics.answered(parsed.profile.model, "", "", str(CLIENT_CLOSED))
                return Response(status_code=CLIENT_CLOSED)
            # failed attempts are excluded; admission's hint to avoid busy instances gives way when it leaves none
            target = (self.choose(parsed.profile, excluded, attempt, avoid) if self.pd is None
                      else self.pd.choose(parsed.profile, excluded, attempt, avoid))
            if target is None:
                if attempt == 0:
                    raise no_ready_instance(parsed.profile.model, self.retry_after_s)
                break  # nowhere else to go: report the failure we had
            if attempt > 0:
                self.metrics.retries.labels(parsed.profile.model).inc()
                if self.admission is not None:
                    self.admission.retried(parsed.profile.request_id)
            if self.admission is not None:
                self.admission.routed(parsed.profile.request_id, target.instance.instance_id)
            if self.route_share is not None:
                self.route_share.dispatched(parsed.profile, target.instance.instance_id)
            try:
                if target.prefill is not None and self.pd is not None:  # split: both legs
                    return await self.pd.run(watch, parsed, path, target)
                return await self._dispatch(watch, parsed, path, target)
            except SplitFailed as f:  # the flow marked and logged what failed; the retry is local
                excluded.extend(f.excluded)
                last = f
            except RetryableFailure as f:
                log.warning("request %s: instance %s failed before first byte (%s); %s",
                            parsed.profile.request_id, target.instance.instance_id, f,
                            "retrying elsewhere" if attempt + 1 < MAX_ATTEMPTS else "giving up")
                self.state.mark_failed(target.instance.instance_id, str(f))
                excluded.append(target.instance.instance_id)
                last = f
        if last is None:
            raise upstream_failed("no instance answered")
        raise upstream_timeout(last.public) if last.timed_out else upstream_failed(last.public)

    async def _dispatch(self, watch: DisconnectWatch, parsed: ParsedRequest, path: str,
                        target: Target) -> Response:
        d = self.new_dispatch(parsed, target)
        handed_over = False
        cont = self.continuation(parsed)
        # A whole answer that may be continued is read from the engine as a stream: what it
        # generated before failing is what the continuation starts from.
        streamed = parsed.stream or cont is not None
        try:
            ids = cont is not None and cont.engine_ids
            body = (None if streamed == parsed.stream and not ids
                    else upstream_body(parsed, target.instance.model, stream=streamed, token_ids=ids))
            delay = hedge_delay(self.config.gateway.hedge, parsed, target)
            if delay is not None:
                try:
                    stream = await open_hedged(self, watch, parsed, path, d, cont, delay)
                except NotAStream as e:  # an error answer (4xx) or not SSE: passed on whole, as below
                    return await self._whole_body(watch, e.d)
                d = stream.d
                handed_over = True
                self.live.add(stream)
                return RelayStreamingResponse(stream, d.headers())
            d.resp = await watch.race(self.head(d, path, body))
            if d.resp.status >= 500:
                status, text = d.resp.status, await self.error_text(d.resp)
                raise RetryableFailure(f"http_{status}", text,
                                       f"engine instance {d.iid} answered {redact_addresses(text)}")
            if d.resp.status >= 400 or not streamed or not _is_sse(d.resp):
                return await self._whole_body(watch, d)
            stream = RelayStream(d, parsed.include_usage or not parsed.stream, cont)
            await watch.race(stream.prefetch())
            handed_over = True
            self.live.add(stream)
            if not parsed.stream:
                return await self._assembled(watch, stream)
            return RelayStreamingResponse(stream, d.headers())
        except RetryableFailure as f:
            self.metrics.upstream_errors.labels(d.iid, f.kind).inc()
            d.finish(ok=False, status=None, error=str(f), abort=True)
            raise
        except Interrupted as i:  # shutdown's grace ran out before the answer came: nothing was sent yet
            d.finish(ok=False, status=None, error=i.message, abort=True)
            raise gateway_shutting_down(i.message, self.retry_after_s) from None
        except ClientGone:
            d.finish(ok=False, status=str(CLIENT_CLOSED) if watch.take_gone() else None,
                     error="client disconnected", cancelled=True)
            return Response(status_code=CLIENT_CLOSED)  # nobody is listening any more
        finally:
            if not handed_over:
                # covers cancellation and bugs too: never leak a connection or an in-flight count.
                # A cancel that reached it while the client was gone is the client's leaving.
                if watch.take_gone():
                    d.finish(ok=False, status=str(CLIENT_CLOSED), error="client disconnected", cancelled=True)
                else:
                    d.finish(ok=False, status=None, error="dispatch ended early", abort=True)

    async def open_stream(self, d: Dispatch, path: str, cont: Continuation | None) -> RelayStream:
        """Send a stream request and read its first event (a hedge's unit of work, `gateway.hedge`)."""
        ids = cont is not None and cont.engine_ids
        d.resp = await self.head(d, path, upstream_body(d.parsed, d.target.instance.model, token_ids=True)
                                 if ids else None)
        if d.resp.status >= 500:
            status, text = d.resp.status, await self.error_text(d.resp)
            raise RetryableFailure(f"http_{status}", text, f"engine instance {d.iid} answered {redact_addresses(text)}")
        if d.resp.status >= 400 or not _is_sse(d.resp):
            raise NotAStream(d)
        stream = RelayStream(d, d.parsed.include_usage, cont)
        await stream.prefetch()
        return stream

    def continuation(self, parsed: ParsedRequest) -> Continuation | None:
        """The request's continuation state (`gateway.resume.continuation_of`)."""
        return continuation_of(self, parsed)

    async def _assembled(self, watch: DisconnectWatch, stream: RelayStream) -> Response:
        """A whole answer read as a stream (and continued where it failed): assembled for the client."""
        first = stream.d
        parts: list[bytes] = []
        chunks = stream.iter_bytes()

        async def read_all() -> None:
            async for chunk in chunks:
                parts.append(chunk)
                if stream.d.stats.done:
                    # Nothing comes after the read with [DONE]; asking for more would book its
                    # dispatch (`_finish_due`) before the answer is known to be one (`close` below).
                    return
        try:
            await watch.race(read_all())
            body = self._assembled_body(stream.d, b"".join(parts), first.parsed.kind == "chat")
        finally:
            await chunks.aclose()
            # Books [DONE]'s dispatch, unless its answer's failure was booked first; a no-op when
            # the stream failed by itself; else the client left: abort.
            await stream.close()
        headers = first.headers()
        cont = stream.cont
        if cont is not None and cont.done:
            headers[CONTINUED_HEADER] = str(cont.done)
        return Response(body, status_code=200, media_type="application/json", headers=headers)

    def _assembled_body(self, d: Dispatch, stream: bytes, chat: bool) -> bytes:
        """The client's whole answer from the client-format stream read for it; the stream's own
        error (booked already) as the client's 502 or 504."""
        try:
            answer, error = assembled_answer(stream, chat)
        except Exception as e:  # an event no assembly expected (`"content": 5`): not a 500
            raise self._unreadable_answer(d, e) from None
        if error is not None:
            message = str(error.get("message") or "upstream error")
            raise upstream_timeout(message) if error.get("code") == "upstream_timeout" else upstream_failed(message)
        return self._client_body(d, json.dumps(answer, separators=(",", ":")).encode())

    def _client_body(self, d: Dispatch, body: bytes) -> bytes:
        """A whole answer as the client's API writes it (`ParsedRequest.translate_answer`),
        translated before `d` is booked."""
        translate = d.parsed.translate_answer
        if translate is None:
            return body
        try:
            return translate(body)
        except Exception as e:
            raise self._unreadable_answer(d, e) from None

    def _unreadable_answer(self, d: Dispatch, e: Exception) -> GatewayError:
        """A whole answer the gateway cannot assemble or translate, before `d` was booked: the
        engine's failure (`answer_invalid`; the dispatch not answered, as for a stream the gateway
        cannot read), and the client's 502 naming the instance. Not retried: the engine spent the
        whole generation on it, and the same output would meet the same code."""
        log.error("request %s: the answer of %s could not be read", d.parsed.profile.request_id, d.iid, exc_info=e)
        public = f"engine instance {d.iid} sent an answer the gateway could not read"
        self.metrics.upstream_errors.labels(d.iid, INVALID_ANSWER).inc()
        d.finish(ok=False, status=None, error=public, abort=True)
        return upstream_failed(public)

    def new_dispatch(self, parsed: ParsedRequest, target: Target) -> Dispatch:
        up = UpstreamWatch(self.deadlines.idle_s)
        predicted = target.route.predicted_ttft_s if target.route is not None else None
        d = Dispatch(self, parsed, target, up, up.now() + self.deadlines.first_byte_s(predicted), self.clock())
        self.metrics.set_inflight(d.iid, self.state.begin(d.iid))
        self.shutdown.track(up)
        if parsed.obs is not None:  # the attempt's CLIENT span starts before the send
            parsed.obs.attempt(target.site, target.site_reason, target.instance, target.route)
        return d

    async def head(self, d: Dispatch, path: str, body: bytes | None = None) -> UpstreamResponse:
        """Send and wait for the response head within the first-byte deadline. A non-streaming
        answer only comes once the whole generation is done, so past the deadline it may wait on
        while the engine keeps passing its health checks (rechecked each poll), until
        `whole_answer_timeout_s` after the request's arrival: an engine whose scheduler hangs while
        its /health still answers held such a request for ever (an attempt after that gets its
        first-byte deadline only)."""
        alive: Callable[[], bool] | None = None
        if not d.parsed.stream:
            until = d.parsed.profile.arrival + self.config.gateway.whole_answer_timeout_s

            def alive_in_time() -> bool:
                return self.clock() < until and d.engine_alive()
            alive = alive_in_time
        try:
            resp = await d.watch.wait(self._send(d.parsed, path, d.target.instance, body), deadline=d.first_byte_at,
                                      keep_waiting=alive, recheck_s=self.state.poll_interval_s, phase="first_byte")
        except UpstreamStalled as e:
            raise _first_byte_timeout(d.iid, e) from None
        if self._flush_index is not None:  # the engine has the request (every leg): index it now
            self._flush_index()
        return resp

    async def _send(self, parsed: ParsedRequest, path: str, instance: Instance,
                    body: bytes | None = None) -> UpstreamResponse:
        if self.session is None:
            raise RuntimeError("the gateway's HTTP session is not started (lifespan not run)")
        headers = {"Content-Type": "application/json", "X-Request-Id": parsed.profile.request_id,
                   "Accept": "text/event-stream" if parsed.stream else "application/json"}
        if parsed.obs is not None:
            parsed.obs.inject(headers)  # W3C traceparent: the engine joins the client's trace
        try:
            data = upstream_body(parsed, instance.model) if body is None else body
            return await self.session.post(instance.url + path, data=data,
                                           headers=headers)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise _connect_failure(instance.instance_id, e) from None

    @staticmethod
    async def error_text(resp: UpstreamResponse) -> str:
        try:  # a snippet is all it keeps: more is never read (the response is closed after)
            body = await asyncio.wait_for(resp.read(_ERROR_READ_BYTES, truncate=True), 2.0)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            body = b""
        text = body.decode("utf-8", errors="replace").strip()[:_ERROR_SNIPPET]
        return f"HTTP {resp.status}" + (f": {text}" if text else "")

    @staticmethod
    async def _read_body(d: Dispatch) -> bytes:
        """The whole body, each read within the idle deadline (an engine may stall half-way), at most
        MAX_EVENT_BYTES (the most the gateway holds of one engine answer or event): past that, 502."""
        assert d.resp is not None
        parts: list[bytes] = []
        held = 0
        while chunk := await d.watch.wait(d.resp.content.readany()):
            held += len(chunk)
            if held > MAX_EVENT_BYTES:
                d.relay.metrics.upstream_errors.labels(d.iid, ANSWER_TOO_LARGE).inc()
                raise upstream_failed(f"engine instance {d.iid} sent an answer larger than {MAX_EVENT_BYTES} bytes")
            parts.append(chunk)
        return b"".join(parts)

    async def _whole_body(self, watch: DisconnectWatch, d: Dispatch) -> Response:
        """Non-stream answers and upstream 4xx: read it all, pass it through unchanged."""
        assert d.resp is not None
        status = d.resp.status
        content_type = d.resp.headers.get("Content-Type", "application/json")
        try:
            body = await watch.race(self._read_body(d))
        except UpstreamStalled as e:
            raise RetryableFailure("body_idle_timeout", str(e),
                                   f"engine instance {d.iid} stalled sending its answer: nothing for "
                                   f"{e.waited_s:.1f} s", timed_out=True) from None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise RetryableFailure("body", describe(e),
                                   f"engine instance {d.iid} connection broke while sending its answer") from None
        if status < 400:
            d.stats.usage = usage_of_body(body)
            if d.parsed.obs is not None:
                d.parsed.obs.whole_body(body)  # its finish reasons, read only for a traced request
            if d.parsed.requested_model is not None:
                body = renamed_body(body, d.parsed.requested_model)
            if d.parsed.translate_answer is not None:
                body, content_type = self._client_body(d, body), "application/json"
        d.finish(ok=status < 400, status=str(status), error=None if status < 400 else f"HTTP {status}")
        return Response(body, status_code=status, media_type=content_type, headers=d.headers())
