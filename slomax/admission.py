"""SLOMax: the admission policy object the gateway and the simulator both run.

    decision = slomax.admit(profile, view, now)      # every arrival
    slomax.on_dispatched(request_id, instance, now)  # where the router sent it (optional)
    slomax.on_first_token(request_id, now)           # its prefill is through (optional)
    slomax.observe(outcome)                          # the end of an admitted request
    for d in slomax.poll(now, view): ...             # after any request ends, and at next_wakeup(now)
    slomax.cancel(request_id, now)                   # the client went away while it waited

An arrival is classified (`classify`), checked against its tenant's budgets (`budgets`;
over budget: rejected with a retry time) and put into its class queue (`queues`). It
starts at once when the queue rules let it and the engines have room; otherwise it
waits — unless its predicted TTFT (predicted wait at the gateway + the engines' predicted
wait + its own prefill at the measured speed) already misses its SLO, in which case it
is rejected now, before any prefill is spent on it. A waiting request that becomes
hopeless is rejected too (`queue_timeout`). Nothing running is ever preempted.

Capacity is per model pool, two things:

* The engine valve (`valve`): the prefill each instance has been given and not finished,
  over its measured speed, is how long it would take to start one more. The pool takes
  new work while its open instances (ready, KV below the high-water mark) together would
  start it within `engine_wait_s`, a target the controller tunes from the engine-side TTFT that
  admitted requests got. This keeps the engines' queues short and moves the waiting to
  the gateway, where it is ordered by class and can be refused.
* The prefill budget: uncached prompt tokens per second (a request weighs its prompt
  less the prefix hit rate its class has been seeing), which the controller sets from
  the TPOT that admitted work got — prefill shares engine steps with every running
  stream, so it is the lever on TPOT — and out of which come the class shares and the
  interactive reserve.

An admitted request may come with `avoid_instances`: instances whose queued prefill alone
would eat more than half its TTFT SLO. The caller's routing skips them (unless that leaves
none): the valve sees a long prompt in prefill that a router's own load model may not.

Pure: no I/O, no clock; `now` comes from the caller, in the same clock as profiles'
`arrival` and outcomes' durations.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from fleetcore.fleet_config import FleetConfig
from fleetcore.slo import LONG_CONTEXT, ClassSLO
from fleetcore.types import AdmissionDecision, FleetView, RequestOutcome, RequestProfile

from .budgets import BudgetBook, TenantBudget
from .classify import Classification, UnknownClass, classify_profile
from .config import ANY_TENANT, Budgets, SLOMaxConfig, from_fleet
from .controller import Controller, ControllerConfig, Knob, Signals
from .ledger import GoodputLedger, LedgeredAdmission
from .predict import Ewma
from .queues import ClassQueues, Entry, PrefillBudget
from .valve import EngineValve

VALVE_RETRY_S = 0.05  # how soon to look again when only the engines held work back
MAX_RETRY_AFTER_S = 60.0
MIN_WAKE_S = 0.001
AVOID_TTFT_FRACTION = 0.5  # an instance whose queued prefill takes more of a request's TTFT SLO is avoided


def met_slo(slo: ClassSLO, o: RequestOutcome, arrival: float, deadline: float | None) -> bool:
    """A completed request within its class SLO and its own deadline. A request answered in one
    piece (not streamed) has no separate first token: the client's first byte is the whole
    answer, so its TTFT is its end-to-end time."""
    ttft = o.ttft_s if o.ttft_s is not None else o.e2e_s
    if not slo.met(ttft, o.mean_tpot_s, o.e2e_s):
        return False
    return deadline is None or (o.e2e_s is not None and arrival + o.e2e_s <= deadline + 1e-9)


def request_deadline(slo: ClassSLO, profile: RequestProfile) -> float | None:
    """The request's own deadline, else its arrival plus its class SLO's deadline (None: none)."""
    if profile.deadline is not None:
        return profile.deadline
    return profile.arrival + slo.deadline_s if slo.deadline_s is not None else None


def judge(config: SLOMaxConfig, profile: RequestProfile, o: RequestOutcome) -> bool:
    """The ledger's verdict on an ended request: completed (not cancelled, not failed) and within
    its tenant x class SLO (`met_slo`). `profile.request_class` is the class admission gave it.
    What the gateway's per-site dashboard asks (`LedgeredAdmission.judge`), so it never judges apart."""
    if not o.ok or o.cancelled:
        return False
    slo = config.slo(profile.tenant, profile.request_class or "")
    return met_slo(slo, o, profile.arrival, request_deadline(slo, profile))


@dataclass(slots=True)
class _Req:
    entry: Entry
    slo: ClassSLO
    charged_tokens: int
    budget: TenantBudget
    pool: _Pool
    dispatched_at: float | None = None  # when admission let it go
    # A streamed request's first token is observable; one answered in a single piece has
    # none, so the valve cannot tell when its prefill is through and leaves it out.
    tracked: bool = True
    routed: bool = False  # the caller said where it went
    first_at: float | None = None
    waited: bool = False


@dataclass(slots=True)
class _Pool:
    """One model's capacity: class queues, the engine valve, learned figures, the controller."""

    model: str
    queues: ClassQueues
    lc_cap: Knob
    controller: Controller
    valve: EngineValve = field(default_factory=EngineValve)
    service: dict[str, Ewma] = field(default_factory=dict)  # dispatch to end, by class
    hit: dict[str, Ewma] = field(default_factory=dict)  # prefix-cache hit fraction, by class
    signals: Signals = field(default_factory=Signals)
    interval_start: float | None = None
    next_control: float | None = None
    n_ready: int = 0
    open_instances: tuple[str, ...] = ()  # ready, KV below the high-water mark
    unrouted: float = 0.0  # tokens started whose instance is not known (yet)
    valve_closed: bool = False
    held_by: dict[str, int] = field(default_factory=dict)  # why waiting work was held back, per poll

    def engine_wait(self) -> float | None:
        """Predicted wait for a new prefill in the pool's open instances as a whole (None: unknown)."""
        return self.valve.pool_wait(self.open_instances, self.unrouted)

    def best_engine_wait(self) -> float | None:
        """... at the least loaded open instance."""
        best = self.valve.best_wait(self.open_instances)
        if best is None:
            return None
        sp = self.valve.pool_speed.value
        return best + (self.unrouted / sp if sp else 0.0)

    def prefill_s(self, tokens: float) -> float:
        sp = self.valve.pool_speed.value
        return tokens / sp if sp else 0.0


class SLOMax(LedgeredAdmission):
    """Class-based admission with tenant budgets, early rejection and goodput feedback."""

    name = "slomax"
    holds_queue = True  # its class queues: it says when each held request may start (`poll`)

    def __init__(self, config: SLOMaxConfig | None = None) -> None:
        self.config = config or SLOMaxConfig()
        self.ledger = GoodputLedger(self.config.window_s)
        self.budgets = BudgetBook({n: t.budgets for n, t in self.config.tenants.items()})
        self._pools: dict[str, _Pool] = {}
        self._reqs: dict[str, _Req] = {}
        self._seq = 0
        self._last_view: FleetView | None = None
        self._now = 0.0

    @classmethod
    def from_fleet(cls, fleet: FleetConfig, **knobs: Any) -> SLOMax:
        cfg = from_fleet(fleet)
        if knobs:
            cfg = replace(cfg, knobs=replace(cfg.knobs, **knobs))
        return cls(cfg)

    # -- classification ----------------------------------------------------------------

    def classify(self, profile: RequestProfile) -> Classification:
        """Raises UnknownClass when the profile names a class this fleet does not define."""
        return classify_profile(profile, self.config)

    @property
    def class_names(self) -> list[str]:
        return sorted(self.config.classes)

    # -- the pool ----------------------------------------------------------------------

    def _pool(self, model: str) -> _Pool:
        p = self._pools.get(model)
        if p is None:
            cfg, k = self.config, self.config.knobs
            lc = cfg.classes.get(LONG_CONTEXT)
            per = lc.max_concurrency if lc is not None and lc.max_concurrency is not None else 64.0
            cap = Knob(per, min(per, 0.25), max(per, 64.0))
            ctl = Controller(cap, ControllerConfig(rate_lo=k.prefill_rate_min, rate_hi=k.prefill_rate_max),
                             rate=k.prefill_rate, engine_wait_s=k.engine_wait_s)
            p = _Pool(model, ClassQueues(cfg.classes, self._tenant_share, k.usage_tau_s), cap, ctl)
            p.service = {c: Ewma(0.05) for c in cfg.classes}
            p.hit = {c: Ewma(0.05) for c in cfg.classes}
            self._pools[model] = p
        return p

    def _tenant_share(self, tenant: str, request_class: str) -> float:
        return self.config.share(tenant, request_class)

    def _look(self, pool: _Pool, view: FleetView | None, now: float) -> None:
        """Read the pool's ready instances, and which may take work, off the view."""
        if view is None:
            return
        high = self.config.knobs.kv_high_water
        n = 0
        open_ids: list[str] = []
        for s in view.sites:
            for i in s.instances:
                if i.model != pool.model or not i.ready or i.draining:
                    continue
                n += 1
                if i.kv_usage < high:
                    open_ids.append(i.instance_id)
        pool.n_ready, pool.open_instances = n, tuple(open_ids)
        pool.queues.n_ready = max(1, n)
        if pool.queues.engines_open is None:
            pool.queues.engines_open = lambda cls, pool=pool: self._engine_room(pool, cls)
        self._size_budget(pool, now)

    def _size_budget(self, pool: _Pool, now: float, full: bool = True) -> None:
        """Keep the prefill budget in step with the controller's rate and the ready instances.

        A budget made here starts full when it is the configured one (`Knobs.prefill_rate`,
        an idle pool), empty when the controller has just brought it in (`full=False`): it
        does that because admitted work was already missing its TPOT, so the engines are
        behind; a full bucket would let `burst_s` of the rate more through at once, and
        under a burst it held nothing for seconds (bench/SLOMAX.md, "A budget brought in
        mid-burst")."""
        knob = pool.controller.rate
        if knob is None:
            pool.queues.budget = None
            return
        rate = knob.value * max(1, pool.n_ready)
        b = pool.queues.budget
        if b is None:
            protected = {c: p.protected for c, p in self.config.classes.items()}
            pool.queues.budget = PrefillBudget(protected, rate, self.config.knobs.burst_s, now, full=full)
        elif b.rate_per_s != rate:
            b.set_rate(rate, now)

    def _engine_room(self, pool: _Pool, request_class: str) -> bool:
        """The valve is open for this class: the engines would start a new prefill within the target.

        Classes without protected capacity: the pool as a whole, and only within the part of
        the target the protected classes leave them — so no instance piles up prefill,
        whatever the router does, and there is always room for the next chat. Protected
        classes (interactive): the least loaded instance — one long prompt in prefill on one
        instance must not hold every chat back, and chats are small enough not to pile up.
        Until the valve has a speed sample, only an idle instance (or pool) counts.
        """
        if not pool.open_instances:
            return False
        target = pool.controller.engine_wait.value
        if self.config.classes[request_class].protected > 0:
            wait = pool.best_engine_wait()
        else:
            wait = pool.engine_wait()
            target *= max(0.0, 1.0 - sum(c.protected for c in self.config.classes.values()))
        return wait is not None and wait < target

    @staticmethod
    def _alone(pool: _Pool) -> bool:
        """Nobody waits in the pool: `ClassQueues.next` would weigh a new request alone (`why_not`,
        nobody else waiting), so `admit` starts it, or not, without a trip through the heap."""
        return not len(pool.queues)

    def _weight(self, pool: _Pool, cls: str, prompt_tokens: int) -> float:
        """Expected uncached prompt tokens: the prefill this request will cost."""
        hit = pool.hit[cls].value or 0.0
        return max(1.0, prompt_tokens * (1.0 - hit))

    # -- budgets, for a gateway that shares them between replicas -------------------------

    def budget_charge(self, profile: RequestProfile) -> tuple[str, int, Budgets] | None:
        """(tenant, tokens, budgets) that `admit` would charge this request, or None when its
        tenant has no limit: what the gateway asks the fleet-wide budget store about."""
        tenant = self.config.tenant(profile.tenant)
        budgets = self.budgets.budgets_of(tenant.name)
        if budgets.unlimited:
            return None
        out = profile.max_tokens if profile.max_tokens is not None else self.config.knobs.default_output_tokens
        return tenant.name, profile.prompt_tokens + out, budgets

    # -- admit -------------------------------------------------------------------------

    def admit(self, profile: RequestProfile, view: FleetView, now: float) -> AdmissionDecision:
        self._last_view = view
        self._now = now
        cfg = self.config
        t = cfg.tenants.get(profile.tenant)  # (`cfg.tenant`, without building a policy for a tenant it lacks)
        tenant, priority = (t.name, t.priority) if t is not None else (profile.tenant, ANY_TENANT.priority)
        try:
            cls = self.classify(profile).request_class
        except UnknownClass as e:
            return AdmissionDecision("reject", str(e), None, "unknown_class")
        arrival = profile.arrival
        self.ledger.arrived(tenant, cls, arrival)
        budget = self.budgets.get(tenant, now)
        out_budget = profile.max_tokens if profile.max_tokens is not None else cfg.knobs.default_output_tokens
        out_budget *= profile.n  # every choice may use the whole output budget; the prompt is shared
        tokens = profile.prompt_tokens + out_budget
        verdict = budget.check(tokens, now)
        if not verdict.ok:
            self.ledger.rejected(tenant, cls, arrival, verdict.code)
            return AdmissionDecision("reject", verdict.reason, cls, verdict.code,
                                     max(1.0, math.ceil(verdict.retry_after_s)))
        pool = self._pool(profile.model)
        self._look(pool, view, now)
        queue = pool.queues.queues[cls]
        policy = cfg.classes[cls]
        if len(queue) >= policy.max_queue:
            self.ledger.rejected(tenant, cls, arrival, "queue_full")
            return AdmissionDecision("reject", f"the {cls} queue is full ({policy.max_queue} waiting)", cls,
                                     "queue_full", self._retry_after(pool, cls, now))
        slo = cfg.slo(tenant, cls)
        deadline = request_deadline(slo, profile)
        self._seq += 1
        e = Entry(profile.request_id, tenant, cls, profile.model, arrival, now,
                  self._weight(pool, cls, profile.prompt_tokens), profile.prompt_tokens, deadline, priority,
                  self._seq)
        budget.charge(tokens, now)
        req = _Req(e, slo, tokens, budget, pool, tracked=profile.stream)
        self._reqs[e.request_id] = req
        alone = self._alone(pool)
        if alone and (pool.n_ready == 0 or not pool.queues.why_not(cls, e.weight, now, False)):
            self._start(req, now)
            if pool.n_ready == 0:  # nothing serves this model: the gateway says so (503 no_ready_instance)
                return AdmissionDecision("admit", "no ready instance to queue for", cls)
            return AdmissionDecision("admit", "", cls, avoid_instances=self._avoid(req))
        ahead = queue.ahead_of(deadline, priority)
        queue.push(e)
        if pool.n_ready == 0:
            # Nothing serves this model: let the gateway say so (503 no_ready_instance) at once.
            pool.queues.pop(e)
            self._start(req, now)
            return AdmissionDecision("admit", "no ready instance to queue for", cls)
        if not alone and pool.queues.next(now) is e:  # (alone: `why_not` just said it must wait)
            pool.queues.pop(e)
            self._start(req, now)
            return AdmissionDecision("admit", "", cls, avoid_instances=self._avoid(req))
        wait = self._predicted_wait(pool, e, ahead, now)
        why = self._hopeless(req, now, wait)
        if why:
            pool.queues.remove(e.request_id, cls)
            self._drop(req, now)
            self.ledger.rejected(tenant, cls, arrival, "slo_unattainable")
            return AdmissionDecision("reject", why, cls, "slo_unattainable", self._retry_after(pool, cls, now))
        req.waited = True
        self.ledger.queued(tenant, cls, arrival)
        return AdmissionDecision("queue", f"waiting in the {cls} queue ({ahead} ahead)", cls)

    # -- poll --------------------------------------------------------------------------

    def poll(self, now: float, view: FleetView | None = None) -> list[AdmissionDecision]:
        """Decisions for waiting requests: those that may start now, and those that became hopeless."""
        view = view or self._last_view
        self._last_view = view
        self._now = now
        out: list[AdmissionDecision] = []
        for pool in self._pools.values():
            self._look(pool, view, now)
            self._expire(pool, now, out)
            self._release(pool, now, out)
            self._control(pool, now)
        return out

    def _release(self, pool: _Pool, now: float, out: list[AdmissionDecision]) -> None:
        q = pool.queues
        pool.valve_closed = False
        while len(q):
            e = q.next(now)
            if e is None:
                for why in q.blocked(now):
                    pool.held_by[why] = pool.held_by.get(why, 0) + 1
                    if why == "engines":
                        pool.valve_closed = True
                        pool.signals.valve_pressure += 1
                    elif why == "budget":
                        pool.signals.budget_pressure += 1
                    elif why == f"cap:{LONG_CONTEXT}":
                        pool.signals.long_context_capped += 1
                return
            q.pop(e)
            req = self._reqs[e.request_id]
            self._start(req, now)
            out.append(AdmissionDecision("admit", f"waited {now - e.arrival:.3f} s", e.request_class,
                                         request_id=e.request_id, avoid_instances=self._avoid(req)))

    def _expire(self, pool: _Pool, now: float, out: list[AdmissionDecision]) -> None:
        for cls, queue in pool.queues.queues.items():
            if not queue:
                continue
            reasons: dict[str, str] = {}

            def hopeless(e: Entry, reasons: dict[str, str] = reasons) -> bool:
                why = self._hopeless(self._reqs[e.request_id], now, 0.0)
                if why:
                    reasons[e.request_id] = why
                return bool(why)

            for e in queue.expire(hopeless):
                self._drop(self._reqs[e.request_id], now)
                self.ledger.rejected(e.tenant, cls, e.arrival, "queue_timeout")
                out.append(AdmissionDecision("reject", reasons[e.request_id], cls, "queue_timeout",
                                             self._retry_after(pool, cls, now), e.request_id))

    def _start(self, req: _Req, now: float) -> None:
        e, pool = req.entry, req.pool
        req.dispatched_at = now
        pool.queues.start(e, now)
        if req.tracked:
            pool.unrouted += e.weight
        per_instance = e.weight / max(1, pool.n_ready)
        pool.signals.prefill_taken += per_instance
        if e.request_class == LONG_CONTEXT:
            pool.signals.long_context_taken += per_instance
        self.ledger.admitted(e.tenant, e.request_class, e.arrival)

    def _avoid(self, req: _Req) -> tuple[str, ...]:
        """Instances this request should not be routed to: their queued prefill alone would take
        more than half its TTFT SLO. Routers weigh cache affinity and their own load models and
        may not see a long prompt in prefill there; the valve does. None if that is all of them."""
        if req.slo.ttft_s is None or not req.tracked:
            return ()
        pool = req.pool
        limit = AVOID_TTFT_FRACTION * req.slo.ttft_s
        bad = tuple(i for i in pool.open_instances if (w := pool.valve.wait_s(i)) is not None and w > limit)
        return bad if len(bad) < len(pool.open_instances) else ()

    def _unroute(self, req: _Req) -> None:
        if not req.routed:
            req.routed = True
            if req.tracked:
                req.pool.unrouted = max(0.0, req.pool.unrouted - req.entry.weight)

    def _drop(self, req: _Req, now: float) -> None:
        """A request that never ran: forget it and give its tokens back."""
        self._reqs.pop(req.entry.request_id, None)
        req.budget.settle(req.charged_tokens, 0, now)

    # -- where it went, and when its prefill was through --------------------------------

    def on_dispatched(self, request_id: str, instance_id: str, now: float) -> None:
        """The router sent an admitted request to `instance_id` (again, on a retry)."""
        req = self._reqs.get(request_id)
        if req is None or req.dispatched_at is None or req.first_at is not None:
            return
        self._unroute(req)
        if req.tracked:
            req.pool.valve.dispatched(request_id, instance_id, req.entry.weight, now)

    def on_first_token(self, request_id: str, now: float) -> None:
        """A started request's first token arrived: its prefill is through."""
        req = self._reqs.get(request_id)
        if req is None or req.dispatched_at is None or req.first_at is not None:
            return
        req.first_at = now
        self._unroute(req)
        pool = req.pool
        pool.valve.first_token(request_id, now)
        if req.slo.ttft_s is not None:
            # How much of its TTFT budget the engines took: the valve's signal.
            pool.signals.engine_ttft_ratios.append((now - req.dispatched_at) / req.slo.ttft_s)

    # -- prediction --------------------------------------------------------------------

    def _predicted_wait(self, pool: _Pool, e: Entry, ahead: int, now: float) -> float:
        """How long `e` (already in its queue, `ahead` before it) will wait at the gateway.

        Two things can hold it: the prefill budget — the tokens of those ahead of it and its
        own start threshold, refilled at the pool's rate times its class's part of it among
        the classes waiting — and its class's concurrency cap — one slot frees every
        service time / cap seconds (service time learned per class). With neither binding
        (unlimited budget, no cap) only the engines' valve holds it, which opens within a
        step or two: no prediction, so no early rejection; a request that waits too long is
        still caught by `poll`.
        """
        q = pool.queues
        cls = e.request_class
        queue = q.queues[cls]
        n = len(queue)
        ahead_w = (queue.weight - e.weight) * ahead / (n - 1) if n > 1 else 0.0
        wait = 0.0
        b = q.budget
        if b is not None:
            wait = b.wait_s(cls, e.weight, now) + ahead_w / b.rate_for(cls, q.share_fraction(cls))
        cap = q.concurrency_cap(cls)
        if cap is not None and q.usage.count_by_class.get(cls, 0) >= cap:
            svc = pool.service[cls].value
            if svc:
                wait = max(wait, (ahead + 1) * svc / cap)
        return wait

    def _engine_ttft(self, pool: _Pool, e: Entry) -> float:
        """Predicted dispatch-to-first-token: the wait the valve lets through, plus its own prefill."""
        wait = pool.engine_wait()
        target = pool.controller.engine_wait.value
        return (target if wait is None else min(wait, target)) + pool.prefill_s(e.weight)

    def _hopeless(self, req: _Req, now: float, wait: float) -> str:
        """Why `req` cannot meet its SLO if it starts after `wait` more seconds ("" if it still can)."""
        e, slo, pool = req.entry, req.slo, req.pool
        slack = self.config.knobs.reject_slack
        if slo.ttft_s is not None:
            ttft = now - e.arrival + wait + self._engine_ttft(pool, e)
            if ttft > slo.ttft_s * slack:
                return (f"predicted time to first token {ttft:.2f} s exceeds the {e.request_class} SLO of "
                        f"{slo.ttft_s:g} s")
        if e.deadline is not None:
            svc = pool.service[e.request_class].value or 0.0
            if now + wait + svc > e.deadline:
                return (f"predicted completion {now + wait + svc - e.arrival:.1f} s after arrival misses its "
                        f"deadline of {e.deadline - e.arrival:.1f} s")
        return ""

    def _retry_after(self, pool: _Pool, cls: str, now: float) -> float:
        """Seconds until the class's queue has drained to where a new request could make it."""
        q = pool.queues.queues[cls]
        b = pool.queues.budget
        wait = 1.0
        if b is not None and q.weight > 0:
            wait = q.weight / b.rate_for(cls, pool.queues.share_fraction(cls))
        cap = pool.queues.concurrency_cap(cls)
        svc = pool.service[cls].value
        if cap is not None and svc:
            wait = max(wait, len(q) * svc / cap)
        return float(min(MAX_RETRY_AFTER_S, max(1.0, math.ceil(wait))))

    # -- outcomes ----------------------------------------------------------------------

    def observe(self, outcome: RequestOutcome) -> None:
        """The end of an admitted request (completed, failed or cancelled): free it, learn, book it."""
        req = self._reqs.pop(outcome.request_id, None)
        if req is None or req.dispatched_at is None:
            return
        e, pool = req.entry, req.pool
        pool.queues.finish(e)
        self._unroute(req)
        pool.valve.forget(e.request_id)
        end = e.arrival + (outcome.e2e_s or 0.0)
        used = (outcome.prompt_tokens or e.prompt_tokens) + outcome.output_tokens
        req.budget.settle(req.charged_tokens, used, end)
        waited = req.dispatched_at - e.arrival
        if outcome.ttft_s is not None and e.prompt_tokens > 0:
            pool.hit[e.request_class].add(min(1.0, outcome.cached_tokens / e.prompt_tokens))
        if outcome.cancelled:
            self.ledger.cancelled(e.tenant, e.request_class, e.arrival, outcome.output_tokens)
            return
        if not outcome.ok:
            self.ledger.failed(e.tenant, e.request_class, e.arrival, outcome.output_tokens)
            return
        if outcome.e2e_s is not None:
            pool.service[e.request_class].add(max(0.0, outcome.e2e_s - waited))
        met = self._met(req, outcome)
        self.ledger.completed(e.tenant, e.request_class, e.arrival, outcome.output_tokens, met)
        if req.slo.tpot_s is not None and outcome.mean_tpot_s is not None:
            pool.signals.tpot_ratios.append((outcome.mean_tpot_s / req.slo.tpot_s, outcome.output_tokens))

    def _met(self, req: _Req, o: RequestOutcome) -> bool:
        return met_slo(req.slo, o, req.entry.arrival, req.entry.deadline)

    def judge(self, profile: RequestProfile, outcome: RequestOutcome) -> bool:
        return judge(self.config, profile, outcome)

    def cancel(self, request_id: str, now: float) -> bool:
        """The client gave up. A waiting request leaves its queue at once (True); a running one
        ends through `observe` with a cancelled outcome (False here)."""
        req = self._reqs.get(request_id)
        if req is None or req.dispatched_at is not None:
            return False
        e = req.entry
        req.pool.queues.remove(request_id, e.request_class)
        self._drop(req, now)
        self.ledger.cancelled(e.tenant, e.request_class, e.arrival)
        return True

    def note_retry(self, request_id: str) -> None:
        """An attempt is being repeated on another instance (duplicate work, booked)."""
        req = self._reqs.get(request_id)
        if req is not None:
            self.ledger.retried(req.entry.tenant, req.entry.request_class, req.entry.arrival)

    # -- time --------------------------------------------------------------------------

    def next_wakeup(self, now: float) -> float | None:
        """When `poll` should run again though nothing ended: a waiting request about to become
        hopeless, the valve or the budget about to open, or the controller's next interval."""
        best = math.inf
        for pool in self._pools.values():
            if not len(pool.queues):
                continue
            if pool.valve_closed:
                best = min(best, now + VALVE_RETRY_S)
            wait = pool.queues.budget_wait_s(now)
            if wait is not None:
                best = min(best, now + wait)
            if pool.next_control is not None:
                best = min(best, pool.next_control)
            for q in pool.queues.queues.values():
                for e in q.heads():
                    best = min(best, self._hopeless_at(self._reqs[e.request_id]))
        # At least a millisecond on: float residue in a refill must not make a Zeno loop.
        return None if best == math.inf else max(best, now + MIN_WAKE_S)

    def _hopeless_at(self, req: _Req) -> float:
        e, slo, pool = req.entry, req.slo, req.pool
        t = math.inf
        if slo.ttft_s is not None:
            t = e.arrival + slo.ttft_s * self.config.knobs.reject_slack - self._engine_ttft(pool, e)
        if e.deadline is not None:
            t = min(t, e.deadline - (pool.service[e.request_class].value or 0.0))
        return t + 1e-6

    def _control(self, pool: _Pool, now: float) -> None:
        if pool.next_control is None:
            pool.interval_start = now
            pool.next_control = now + self.config.knobs.control_interval_s
            return
        if now < pool.next_control:
            return
        s = pool.signals
        s.interval_s = now - (pool.interval_start if pool.interval_start is not None else now)
        if self.config.feedback:
            pool.controller.update(s, now)
            if LONG_CONTEXT in pool.queues.classes:
                pool.queues.concurrency_override[LONG_CONTEXT] = pool.lc_cap.value
            self._size_budget(pool, now, full=False)
        pool.signals = Signals()
        pool.interval_start = now
        pool.next_control = now + self.config.knobs.control_interval_s

    # -- reading -----------------------------------------------------------------------

    def queued(self) -> Iterable[str]:
        return [rid for rid, r in self._reqs.items() if r.dispatched_at is None]

    def snapshot(self, now: float) -> dict[str, Any]:
        """Controller state, queues and in-flight figures (the admin view)."""
        pools = {}
        for name, p in sorted(self._pools.items()):
            u = p.queues.usage
            rate = p.controller.rate
            b = p.queues.budget
            pools[name] = {
                "ready_instances": p.n_ready,
                "open_instances": len(p.open_instances),
                "engine_wait_target_s": round(p.controller.engine_wait.value, 4),
                "engine_wait_s": p.engine_wait(),
                "prefill_speed_tokens_per_s": p.valve.pool_speed.value,
                "prefill_backlog_tokens": {i: round(v, 1) for i, v in sorted(p.valve.backlog.items())},
                "prefill_rate_per_instance": None if rate is None else round(rate.value, 1),
                "prefill_budget_tokens": None if b is None else round(b.level(now), 1),
                "long_context_cap_per_instance": round(p.lc_cap.value, 3),
                "in_flight": u.count,
                "held_back": dict(sorted(p.held_by.items())),
                "classes": {c: {"queued": len(q), "in_flight": u.count_by_class.get(c, 0),
                                "prefix_hit": p.hit[c].value, "service_s": p.service[c].value}
                            for c, q in sorted(p.queues.queues.items())},
            }
        return {"policy": self.name, "pools": pools, "tenants": self.budgets.snapshot(now)}
