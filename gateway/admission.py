"""The gateway side of admission: runs the pure policy (SLOMax or FCFS) on the event loop.

`AdmissionGate.enter` asks the policy about a request before any site or instance is
chosen. Admitted: it goes on at once. Rejected: an OpenAI error — 429 with Retry-After
and code `rate_limit_exceeded` when the tenant is over a budget (it is the caller's
limit; retrying later succeeds), 503 with Retry-After and code `slo_unattainable`,
`queue_timeout` or `queue_full` when the fleet cannot serve the request within its class
SLO now (it is the fleet's state, not the caller's fault; 503 is what OpenAI clients
already retry with back-off for an overloaded service), 400 `unknown_class` for a class
the fleet does not define. Queued: the request waits on a future, with no thread and no
polling loop of its own; the policy's `poll` runs whenever an admitted request ends and
at the time its `next_wakeup` names (`loop.call_later`), and resolves the futures. A
client that disconnects while waiting leaves the queue at once (`policy.cancel`).

The relay tells the gate where each request was routed, when its first token came, that
an attempt was retried, and the outcome of every attempt; `release` hands the final one
to the policy exactly once per admitted request, which frees its capacity and books it
in the goodput ledger, then tells `on_released` (with the policy's own verdict,
`judge`: where the class and the final outcome meet, e.g. goodput per site).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

from fleetcore.policies import Admission
from fleetcore.types import AdmissionDecision, RequestOutcome, RequestProfile
from gateway.budget_store import Charge, SharedBudgets
from gateway.errors import GatewayError, bad_request, overloaded, rate_limited
from fleetcore.fast_replace import replace  # dataclasses.replace, cheaper: the class on every request
from gateway.fleet_state import FleetState
from gateway.requests import CLASS_HEADER, ParsedRequest
from slomax import LedgeredAdmission

log = logging.getLogger("tokenfleet.gateway")
R = TypeVar("R")

# What the gate runs: the admission contract (`fleetcore.policies.Admission`, hook-owned
# queues) with a goodput ledger the reports read (slomax.SLOMax, slomax.FCFS).
AdmissionPolicy = LedgeredAdmission

# A policy whose `poll` and `next_wakeup` are the contract's defaults holds no request and names
# no wake-up: its pump would do nothing but build a fleet view.
_HOLDS_NONE = Admission.poll
_NO_WAKEUP = Admission.next_wakeup


def distinct_id(parsed: ParsedRequest) -> ParsedRequest:
    """The request under an id of its own: the client's with a random suffix (what the engine
    and the response's `x-request-id` then carry, so the client can tell its two requests apart)."""
    rid = f"{parsed.profile.request_id}.{os.urandom(4).hex()}"
    return replace(parsed, profile=replace(parsed.profile, request_id=rid))


def decision_error(d: AdmissionDecision) -> GatewayError:
    """The client-facing error for a rejection."""
    retry = d.retry_after_s if d.retry_after_s is not None else 1.0
    code = d.code or "rejected"
    if code.startswith("budget_"):
        return rate_limited(d.reason or "Rate limit reached", retry, "tokens" if code == "budget_tokens" else "requests")
    if code == "unknown_class":
        return bad_request(d.reason, CLASS_HEADER, code="unknown_class")
    cls = f" ({d.request_class})" if d.request_class else ""
    return overloaded(f"The fleet cannot serve this request within its SLO{cls} right now: {d.reason}", code, retry)


class AdmissionGate:
    def __init__(self, policy: AdmissionPolicy, state: FleetState, clock: Callable[[], float]) -> None:
        self.policy = policy
        self.state = state
        self.clock = clock
        self._waiting: dict[str, asyncio.Future[AdmissionDecision]] = {}
        self._admitted: dict[str, RequestProfile] = {}  # admitted and not yet released
        self._last: dict[str, RequestOutcome] = {}  # latest attempt outcome per admitted request
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        # Budgets shared by the gateway's replicas (gateway.budget_store), when it has several.
        self.shared_budgets: SharedBudgets | None = None
        self._charges: dict[str, Charge] = {}  # admitted request -> what Redis charged for it
        self.key_budgets: Any = None  # gateway.key_budgets.KeyBudgets: a key's own limits, checked first
        self._key_charges: dict[str, Any] = {}  # admitted request -> what its key's budget charged
        self.shared_ledger: Any = None  # gateway.ledger_sync.LedgerSync: the replicas' goodput, when shared
        # Told of every admitted request's end: (profile with its admitted class, last outcome,
        # the policy's verdict `policy.judge`), e.g. the dashboard's per-site goodput.
        self.on_released: list[Callable[[RequestProfile, RequestOutcome, bool], None]] = []

    # -- entering -------------------------------------------------------------------------

    async def enter(self, parsed: ParsedRequest,
                    race: Callable[[Any], Any]) -> tuple[ParsedRequest, tuple[str, ...]]:
        """Admit (returns the request with its class, and instances to avoid), or raise its GatewayError.

        `race(awaitable)` returns the awaitable's result or raises the relay's ClientGone
        when the client disconnects first (DisconnectWatch.race).

        One coroutine: a request admitted at once awaits nothing here but the budget stores
        it has (each layer of coroutine is a frame and a send on every request).
        """
        profile = parsed.profile
        rid = profile.request_id
        entered = self.clock()
        shared = self.shared_budgets
        # The key's own budgets first (gateway.key_budgets): 429 before the tenant's are touched.
        keys = self.key_budgets
        # (a request without a key created by API has no key budget: no coroutine to run for it)
        key_charge = (await keys.admit(parsed.key_id, profile, entered, shared)
                      if keys is not None and parsed.key_id is not None else None)
        try:
            # Fleet-wide budgets first (one bounded round trip); the policy gets the verdict, stays pure.
            charge = await shared.before_admit(profile) if shared is not None else None
            if rid in self._admitted or rid in self._waiting:
                # Another request with this id (the client's X-Request-Id) is in flight: everything
                # from here on is keyed by the id, and sharing it, one request overwrote the other's
                # entries (a queued one's future lost: it waited until its client gave up; an ended
                # one's capacity and stream slot never given back). Checked after the awaits above,
                # with nothing awaited until the id is taken below.
                parsed = distinct_id(parsed)
                profile, rid = parsed.profile, parsed.profile.request_id
            try:
                d = self._call(self.policy.admit, profile, self.state.view(), entered) or AdmissionDecision("admit")
            finally:
                if shared is not None:
                    shared.after_admit(profile)
            try:
                queued = d.action == "queue"
                if queued:
                    d = await self._wait(parsed, race, entered)
                parsed, avoid = self._decided(parsed, d, queued, entered)
            except BaseException:
                if charge is not None and shared is not None:
                    shared.settle(charge, 0)  # never ran: its tokens (not its request) go back
                raise
            if charge is not None:
                self._charges[rid] = charge
        except BaseException:
            if key_charge is not None:
                keys.settle(key_charge, 0, self.clock())  # never ran: its tokens (not its request) go back
            raise
        if key_charge is not None:
            self._key_charges[rid] = key_charge
        return parsed, avoid

    async def _wait(self, parsed: ParsedRequest, race: Callable[[Any], Any], entered: float) -> AdmissionDecision:
        """Wait in the policy's queue for its verdict (`pump` resolves the future)."""
        rid = parsed.profile.request_id
        fut: asyncio.Future[AdmissionDecision] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        self.pump()  # someone ahead of it may be able to start now
        try:
            return await race(fut)
        except BaseException:
            # The client left (or the handler was cancelled): leave the queue at once. Had
            # the policy just let it go, `pump` already ended it (its future was done).
            self._waiting.pop(rid, None)
            self._call(self.policy.cancel, rid, self.clock())
            self.pump()
            if parsed.obs is not None:
                parsed.obs.admitted("left", self.clock() - entered, parsed.profile)
            raise

    def _decided(self, parsed: ParsedRequest, d: AdmissionDecision, queued: bool,
                 entered: float) -> tuple[ParsedRequest, tuple[str, ...]]:
        """The policy's verdict: the request with its class, told to telemetry; raises a rejection."""
        profile = parsed.profile
        if d.request_class and d.request_class != profile.request_class:
            parsed = replace(parsed, profile=replace(profile, request_class=d.request_class))
        if parsed.obs is not None:  # the verdict, the class and the time it waited, for telemetry
            verdict = "rejected" if d.action == "reject" else ("queued" if queued else "admitted")
            parsed.obs.admitted(verdict, self.clock() - entered, parsed.profile, d.code)
        if d.action == "reject":
            raise decision_error(d)
        self._admitted[profile.request_id] = parsed.profile
        return parsed, d.avoid_instances

    # -- what the relay reports -----------------------------------------------------------

    def routed(self, request_id: str, instance_id: str) -> None:
        if request_id in self._admitted:
            self._call(self.policy.on_dispatched, request_id, instance_id, self.clock())

    def first_token(self, request_id: str) -> None:
        if request_id in self._admitted:
            self._call(self.policy.on_first_token, request_id, self.clock())

    def retried(self, request_id: str) -> None:
        if request_id in self._admitted:
            self._call(self.policy.note_retry, request_id)

    def attempt_ended(self, outcome: RequestOutcome) -> None:
        if outcome.request_id in self._admitted:
            self._last[outcome.request_id] = outcome

    def release(self, request_id: str) -> None:
        """The request is over for the gateway: its last outcome goes to the policy, once."""
        profile = self._admitted.pop(request_id, None)
        if profile is None:
            return
        outcome = self._last.pop(request_id, None)
        if outcome is None:  # never reached an engine (no ready instance, a bug): a failure
            outcome = RequestOutcome(request_id=request_id, instance_id="", site="", ok=False,
                                     prompt_tokens=profile.prompt_tokens,
                                     e2e_s=max(0.0, self.clock() - profile.arrival), error="not dispatched")
        used = (outcome.prompt_tokens or profile.prompt_tokens) + outcome.output_tokens
        charge = self._charges.pop(request_id, None)
        if charge is not None and self.shared_budgets is not None:
            self.shared_budgets.settle(charge, used if outcome.instance_id else 0)
        key_charge = self._key_charges.pop(request_id, None)
        if key_charge is not None and self.key_budgets is not None:
            self.key_budgets.settle(key_charge, used if outcome.instance_id else 0, self.clock())
        self._call(self.policy.observe, outcome)
        if self.on_released:
            met = bool(self._call(self.policy.judge, profile, outcome))  # as the ledger just booked it
            for listener in self.on_released:
                try:
                    listener(profile, outcome, met)
                except Exception:
                    log.exception("admission release listener %r failed", listener)
        self.pump()

    # -- the queue ------------------------------------------------------------------------

    def pump(self) -> None:
        """Let the policy decide about waiting requests, and book its next wake-up."""
        p = self.policy
        if getattr(p.poll, "__func__", None) is _HOLDS_NONE and getattr(p.next_wakeup, "__func__", None) is _NO_WAKEUP:
            return  # it holds nothing and never asks to be woken (FCFS): no view to build for it
        now = self.clock()
        for d in self._call(self.policy.poll, now, self.state.view()) or ():
            rid = d.request_id or ""
            fut = self._waiting.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result(d)
            elif d.action == "admit":
                # Let go after its client left: end it at once so its capacity comes back.
                self._call(self.policy.observe, RequestOutcome(request_id=rid, instance_id="", site="", ok=False,
                                                     cancelled=True, error="client gone before start"))
        self._schedule(now)

    def _schedule(self, now: float) -> None:
        at = self._call(self.policy.next_wakeup, now)
        if at is None or not self._waiting:
            return
        if self._timer is not None and self._timer_at <= at and not self._timer.cancelled():
            return  # an earlier wake-up is already booked; it will book the next one
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = asyncio.get_running_loop().call_later(max(0.0, at - now), self._wake)

    def _wake(self) -> None:
        self._timer = None
        self._timer_at = float("inf")
        self.pump()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _call(self, method: Callable[..., R], *args: Any) -> R | None:
        """Call the policy; a policy bug must not fail requests (it admits, and is logged)."""
        try:
            return method(*args)
        except Exception:
            log.exception("admission policy %s.%s failed", type(self.policy).__name__, method.__name__)
            return None
