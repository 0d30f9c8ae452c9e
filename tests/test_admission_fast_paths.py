"""The per-request fast paths of admission and its bookkeeping, pinned against the slow references.

Each shortcut taken to cut a relayed request's CPU (branch i14-admit) must give what the general
code gives: the same admission decisions on random request sequences, the same ledger, the same
classification, the same /metrics text.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from fleetcore.slo import BATCH, INTERACTIVE, LONG_CONTEXT, ClassSLO
from fleetcore.types import (
    FleetView,
    InstanceSnapshot,
    RequestOutcome,
    RequestProfile,
    SiteSnapshot,
)
from gateway.admission import AdmissionGate
from gateway.metrics import GatewayMetrics
from gateway.requests import ParsedRequest
from gateway.telemetry import TPOT_BUCKETS, TTFT_BUCKETS, ClassHistograms
from slomax import FCFS, SLOMax, SLOMaxConfig, TenantPolicy, classify
from slomax.classify import classify_profile
from slomax.config import DEFAULT_CLASSES, Budgets, ClassPolicy, Knobs
from slomax.ledger import COUNTERS, REJECT_REASONS, Cell, GoodputLedger
from slomax.queues import ClassQueues

# --- random requests ---------------------------------------------------------------------------


def _random_profile(rng: random.Random, i: int) -> RequestProfile:
    return RequestProfile(
        f"r{i}", rng.choice(["m1", "m2"]), rng.randrange(0, 20000), tuple(rng.randrange(1 << 62) for _ in range(3)),
        rng.choice([16, 32]), rng.choice([None, 4, 30000]), rng.randrange(1, 4), rng.choice([None, "v1"]),
        rng.choice(["a", "b", "anonymous"]), rng.choice([None, INTERACTIVE, BATCH]), rng.choice([None, "rag", "chat"]),
        rng.random() < 0.5, rng.choice([None, "eu"]), rng.random() * 100, rng.choice([None, 1e3 * rng.random()]))


# --- classification ---------------------------------------------------------------------------


def _reference_classify(profile: RequestProfile, config: SLOMaxConfig):  # type: ignore[no-untyped-def]
    """`classify_profile` as it was: every rule through `classify`, the tenant's policy built."""
    return classify(prompt_tokens=profile.prompt_tokens, max_tokens=profile.max_tokens,
                    explicit=profile.request_class, task_type=profile.task_type,
                    tenant_default=config.tenant(profile.tenant).default_class, classes=config.classes,
                    long_context_min_tokens=config.long_context_min_tokens,
                    long_output_tokens=config.long_output_tokens, task_classes=config.task_classes)


@pytest.mark.parametrize("seed", range(4))
def test_classify_profile_agrees_with_classify(seed: int) -> None:
    rng = random.Random(seed)
    classes = {**DEFAULT_CLASSES, "premium": ClassPolicy("premium", ClassSLO(ttft_s=0.5))}
    if seed % 2:
        classes.pop(LONG_CONTEXT)  # no long-context class: rules 3 and 4 are off
    tenants = {"a": TenantPolicy("a", default_class="premium"), "b": TenantPolicy("b", default_class=BATCH),
               "c": TenantPolicy("c", default_class="gone")}  # a default class the fleet lacks: interactive
    config = SLOMaxConfig(classes=classes, tenants=tenants, long_context_min_tokens=rng.choice([1000, 8192]),
                          long_output_tokens=rng.choice([None, 2000]), task_classes={"nightly": BATCH})
    for i in range(2000):
        p = replace(_random_profile(rng, i), tenant=rng.choice(["a", "b", "c", "d"]),
                    request_class=rng.choice([None, None, None, INTERACTIVE, "premium", "vip"]),
                    task_type=rng.choice([None, None, "", "nightly", "rag", "premium", "other"]),
                    prompt_tokens=rng.choice([10, 999, 1000, 8191, 8192, 50000]),
                    max_tokens=rng.choice([None, 10, 1999, 2000, 5000]))
        try:
            want = _reference_classify(p, config)
        except ValueError as e:
            with pytest.raises(type(e), match="unknown request class"):
                classify_profile(p, config)
            continue
        assert classify_profile(p, config) == want, p
    assert config.default_class("nobody") == TenantPolicy("nobody").default_class
    assert config.share("nobody", BATCH) == TenantPolicy("nobody").share(BATCH)


# --- the goodput ledger ----------------------------------------------------------------------


class _ReferenceLedger(GoodputLedger):
    """The bookings as they were: the cells looked up afresh, every counter set by name."""

    def _cells_for(self, tenant: str, request_class: str, arrival: float) -> tuple[Cell, Cell]:
        w = self._index(arrival)
        win = self._cells.get(w)
        if win is None:
            win = self._cells[w] = {}
            self._trim(w)
        key = (tenant, request_class)
        return win.setdefault(key, Cell()), self.totals.setdefault(key, Cell())

    def _bump(self, tenant: str, request_class: str, arrival: float, **inc: int) -> None:
        for c in self._cells_for(tenant, request_class, arrival):
            for k, v in inc.items():
                setattr(c, k, getattr(c, k) + v)

    def arrived(self, tenant: str, request_class: str, arrival: float) -> None:
        self._bump(tenant, request_class, arrival, arrived=1)

    def admitted(self, tenant: str, request_class: str, arrival: float) -> None:
        self._bump(tenant, request_class, arrival, admitted=1)

    def queued(self, tenant: str, request_class: str, arrival: float) -> None:
        self._bump(tenant, request_class, arrival, queued=1)

    def completed(self, tenant: str, request_class: str, arrival: float, output_tokens: int, met: bool) -> None:
        self._bump(tenant, request_class, arrival, completed=1, met_slo=int(met), output_tokens=output_tokens,
                   goodput_tokens=output_tokens if met else 0)

    def cancelled(self, tenant: str, request_class: str, arrival: float, output_tokens: int = 0) -> None:
        self._bump(tenant, request_class, arrival, cancelled=1, output_tokens=output_tokens)

    def failed(self, tenant: str, request_class: str, arrival: float, output_tokens: int = 0) -> None:
        self._bump(tenant, request_class, arrival, failed=1, output_tokens=output_tokens)

    def retried(self, tenant: str, request_class: str, arrival: float) -> None:
        self._bump(tenant, request_class, arrival, retried=1)


def _state(ledger: GoodputLedger) -> tuple[object, ...]:
    cells = {w: {k: dataclasses.astuple(c) for k, c in ledger.window_cells(w).items()} for w in ledger.windows()}
    return cells, {k: dataclasses.astuple(c) for k, c in ledger.totals.items()}, ledger.report(per_window=True)


@pytest.mark.parametrize("seed", range(4))
def test_ledger_bookings_match_the_reference_through_window_trims(seed: int) -> None:
    rng = random.Random(seed)
    fast, ref = GoodputLedger(1.0, keep_windows=3), _ReferenceLedger(1.0, keep_windows=3)
    t = 0.0
    for _ in range(3000):
        t += rng.expovariate(8.0)
        # mostly the newest window, sometimes an older one (a long request ending), or a trimmed one
        arrival = t - rng.choice([0.0, 0.0, 0.0, 0.3, 1.5, 6.0])
        key = (rng.choice(["a", "b"]), rng.choice([INTERACTIVE, BATCH]), arrival)
        event = rng.choice(["arrived", "admitted", "queued", "rejected", "completed", "cancelled", "failed",
                            "retried"])
        args: tuple[object, ...] = ()
        if event == "rejected":
            args = (rng.choice([*REJECT_REASONS, "whatever"]),)
        elif event == "completed":
            args = (rng.randrange(0, 50), rng.random() < 0.6)
        elif event in ("cancelled", "failed"):
            args = (rng.randrange(0, 50),)
        for ledger in (fast, ref):
            getattr(ledger, event)(*key, *args)
        if rng.random() < 0.02:
            w = rng.choice(fast.windows())
            extra = Cell(arrived=2, met_slo=1)
            for ledger in (fast, ref):
                ledger.merge_cell(w, "a", INTERACTIVE, replace(extra))
        assert _state(fast) == _state(ref)
    assert all(type(getattr(c, k)) is int for c in fast.totals.values() for k in COUNTERS)


# --- SLOMax admission ------------------------------------------------------------------------


class _SlowQueues(ClassQueues):
    def _only(self):  # type: ignore[no-untyped-def]
        return None  # always through the candidates


class _ReferenceSLOMax(SLOMax):
    """SLOMax without its shortcuts: every arrival through its heap, every pick through the candidates."""

    @staticmethod
    def _alone(pool) -> bool:  # type: ignore[no-untyped-def]
        return False

    def _pool(self, model):  # type: ignore[no-untyped-def]
        p = super()._pool(model)
        p.queues.__class__ = _SlowQueues
        return p


def _view(rng: random.Random) -> FleetView:
    n = rng.choice([0, 1, 1, 2, 3])
    insts = tuple(InstanceSnapshot(f"i{k}", "s", "m", "v", "u", ready=rng.random() < 0.9,
                                   kv_usage=rng.choice([0.1, 0.5, 0.99])) for k in range(n))
    return FleetView((SiteSnapshot("s", "r", "j", {}, insts),))


@pytest.mark.parametrize("seed", range(6))
def test_slomax_decides_as_its_reference_on_random_sequences(seed: int) -> None:
    rng = random.Random(seed)
    tenants = {"gold": TenantPolicy("gold", priority=2, budgets=Budgets(concurrent_streams=rng.choice([None, 3]))),
               "lim": TenantPolicy("lim", budgets=Budgets(tokens_per_minute=20000, requests_per_minute=120)),
               "bat": TenantPolicy("bat", default_class=BATCH)}
    knobs = Knobs(prefill_rate=rng.choice([None, 2000.0, 20000.0]), control_interval_s=0.5)
    config = SLOMaxConfig(tenants=tenants, knobs=knobs)
    fast, ref = SLOMax(config), _ReferenceSLOMax(config)
    now = 0.0
    live: list[tuple[str, float]] = []  # started (the gateway reports on these only)
    waiting: dict[str, float] = {}  # queued by admission
    view = _view(rng)
    for i in range(1500):
        now += rng.expovariate(40.0)
        if rng.random() < 0.05:
            view = _view(rng)
        r = rng.random()
        if r < 0.45:
            p = RequestProfile(f"r{i}", "m", rng.choice([20, 200, 3000, 9000, 40000]), max_tokens=rng.choice([None, 16]),
                               tenant=rng.choice(["gold", "lim", "bat", "anon"]),
                               request_class=rng.choice([None, None, None, INTERACTIVE, BATCH]),
                               task_type=rng.choice([None, None, "rag"]), stream=rng.random() < 0.8, arrival=now,
                               deadline=rng.choice([None, None, now + 5.0]))
            got, want = fast.admit(p, view, now), ref.admit(p, view, now)
            assert got == want, (i, p)
            if got.action == "admit":
                live.append((p.request_id, now))
            elif got.action == "queue":
                waiting[p.request_id] = now
        elif r < 0.6 and live:
            rid, _ = live[rng.randrange(len(live))]
            for policy in (fast, ref):
                policy.on_dispatched(rid, rng.choice(["i0", "i1"]), now)
                policy.on_first_token(rid, now)
        elif r < 0.8 and live:
            rid, t0 = live.pop(rng.randrange(len(live)))
            o = RequestOutcome(rid, "i0", "s", rng.random() < 0.9, 200, rng.randrange(0, 200), rng.randrange(0, 64),
                               0.05 + rng.random(), 0.02 * rng.random(), max(0.0, now - t0) + 0.1,
                               cancelled=rng.random() < 0.05)
            for policy in (fast, ref):
                policy.observe(o)
        elif r < 0.85 and waiting:
            rid = rng.choice(sorted(waiting))
            del waiting[rid]
            assert fast.cancel(rid, now) == ref.cancel(rid, now)
        else:
            got_polled = fast.poll(now, view)
            assert got_polled == ref.poll(now, view)
            for d in got_polled:
                t0 = waiting.pop(d.request_id or "", None)
                if d.action == "admit" and t0 is not None:
                    live.append((d.request_id or "", t0))
            assert fast.next_wakeup(now) == ref.next_wakeup(now)
    assert fast.snapshot(now) == ref.snapshot(now)
    assert {k: dataclasses.astuple(c) for k, c in fast.ledger.totals.items()} == \
        {k: dataclasses.astuple(c) for k, c in ref.ledger.totals.items()}


def test_one_waiting_request_is_picked_as_the_candidates_would() -> None:
    rng = random.Random(7)
    for _ in range(200):
        config = SLOMaxConfig(knobs=Knobs(prefill_rate=rng.choice([None, 500.0])))
        sm = SLOMax(config)
        view = _view(rng)
        now = 0.0
        for i in range(rng.randrange(1, 6)):
            sm.admit(RequestProfile(f"r{i}", "m", rng.choice([100, 5000, 20000]), stream=True, arrival=now,
                                    tenant=rng.choice(["a", "b"])), view, now)
        for pool in sm._pools.values():
            q = pool.queues
            for cls_q in q.queues.values():
                for e in cls_q.entries():
                    if rng.random() < 0.3:
                        cls_q.remove(e.request_id)
            only = q._only()
            waiting = [e for cq in q.queues.values() for e in cq.entries()]
            assert (only is not None) == (len(waiting) == 1)
            if only is not None:
                assert q._candidates(now) == [only] == waiting
                slow = q._candidates(now)
                assert q.next(now) is (slow[0] if not q.why_not(only.request_class, only.weight, now, False) else None)


# --- the gate ----------------------------------------------------------------------------------


class _CountingState:
    def __init__(self) -> None:
        self.views = 0

    def view(self) -> FleetView:
        self.views += 1
        inst = InstanceSnapshot("e0", "s", "m", "v", "u")
        return FleetView((SiteSnapshot("s", "r", "j", {}, (inst,)),))


def _cycle(gate: AdmissionGate, i: int) -> ParsedRequest:
    p = RequestProfile(f"r{i}", "m", 64, stream=True, arrival=float(i))
    co = gate.enter(ParsedRequest("chat", {}, p, None, False), None)  # type: ignore[arg-type]
    with pytest.raises(StopIteration) as stop:
        co.send(None)
    parsed, avoid = stop.value.value
    gate.routed(p.request_id, "e0")
    gate.first_token(p.request_id)
    gate.attempt_ended(RequestOutcome(p.request_id, "e0", "s", True, 64, 0, 4, 0.01, 0.001, 0.02))
    gate.release(p.request_id)
    return parsed


def test_the_gate_builds_no_view_to_pump_a_policy_that_holds_nothing() -> None:
    state = _CountingState()
    gate = AdmissionGate(FCFS(), state, lambda: 0.0)  # type: ignore[arg-type]
    parsed = _cycle(gate, 1)
    assert parsed.profile.request_class == INTERACTIVE and state.views == 1  # admission's own look only
    assert gate.policy.ledger.totals[("anonymous", INTERACTIVE)].completed == 1

    class Polling(FCFS):
        polls = 0

        def poll(self, now, view=None):  # type: ignore[no-untyped-def]
            Polling.polls += 1
            return []

    state = _CountingState()
    gate = AdmissionGate(Polling(), state, lambda: 0.0)  # type: ignore[arg-type]
    _cycle(gate, 2)
    assert state.views == 2 and Polling.polls == 1  # a policy with a poll of its own is pumped

    class Waking(FCFS):
        asked = 0

        def next_wakeup(self, now):  # type: ignore[no-untyped-def]
            Waking.asked += 1
            return None

    state = _CountingState()
    gate = AdmissionGate(Waking(), state, lambda: 0.0)  # type: ignore[arg-type]
    _cycle(gate, 3)
    assert state.views == 2 and Waking.asked == 1  # ... and so is one with a wake-up of its own

    state = _CountingState()
    sm = SLOMax()
    gate = AdmissionGate(sm, state, lambda: 0.0)  # type: ignore[arg-type]
    _cycle(gate, 3)
    assert state.views == 2


# --- metrics -----------------------------------------------------------------------------------


def _exposition(registry: CollectorRegistry) -> list[str]:
    return [ln for ln in generate_latest(registry).decode().splitlines() if "_created" not in ln]


def test_class_histograms_expose_what_labels_observe_would() -> None:
    rng = random.Random(3)
    fast_reg, ref_reg = CollectorRegistry(), CollectorRegistry()
    fast = ClassHistograms(fast_reg)
    ref = ClassHistograms(ref_reg)
    for _ in range(500):
        key = (rng.choice(["m1", "m2"]), rng.choice([INTERACTIVE, BATCH]), rng.choice(["a", "b", "c"]))
        ttft, tpot, wait = (rng.choice([None, rng.random()]) for _ in range(3))
        fast.observe(key, ttft, tpot, wait)
        for hist, v in ((ref.ttft, ttft), (ref.tpot, tpot), (ref.queue_wait, wait)):
            if v is not None:
                hist.labels(*key).observe(v)
    assert _exposition(fast_reg) == _exposition(ref_reg)
    assert TTFT_BUCKETS and TPOT_BUCKETS


def test_record_outcome_exposes_what_it_did_with_zero_increments() -> None:
    rng = random.Random(4)
    fast, ref = GatewayMetrics(), GatewayMetrics()
    for i in range(300):
        o = RequestOutcome(f"r{i}", "e0", rng.choice(["s1", "s2"]), rng.random() < 0.8, rng.choice([0, 64]),
                           rng.choice([0, 0, 1, 32]), rng.choice([0, 1, 4]), rng.choice([None, 0.1]), None,
                           rng.choice([None, 0.5]))
        fast.record_outcome("m", o)
        key = ("m", o.site)  # the reference: every series by `.labels()`, every counter added to, 0 or not
        if o.ttft_s is not None:
            ref.ttft.labels(*key).observe(o.ttft_s)
        if o.e2e_s is not None and o.ok:
            ref.e2e.labels(*key).observe(o.e2e_s)
        ref.prompt_tokens.labels(*key).inc(o.prompt_tokens)
        ref.output_tokens.labels(*key).inc(o.output_tokens)
        ref.cached_tokens.labels(*key).inc(o.cached_tokens)
    assert _exposition(fast.registry) == _exposition(ref.registry)


def test_the_admission_cost_benchmark_runs() -> None:
    from tests.bench_scripts import load_bench

    bench = load_bench("admission_cost")
    out = bench.measure(50)
    assert set(out) == set(bench.CASES) and all(v > 0 for v in out.values())


def test_a_drained_class_queue_keeps_no_removed_entries() -> None:
    from slomax.queues import ClassQueue, Entry

    q = ClassQueue(DEFAULT_CLASSES[INTERACTIVE])
    es = [Entry(f"r{i}", f"t{i % 2}", INTERACTIVE, "m", 0.0, 0.0, 10.0, 10, seq=i) for i in range(6)]
    for e in es:
        q.push(e)
    q.remove("r3")  # a cancel in the middle of a heap: lazily removed, left in place
    assert sum(map(len, q._heaps.values())) == 6
    for e in (es[0], es[1], es[2], es[4], es[5]):
        q.pop(e)
    # nothing live: admit's shortcut never walks the heaps, so they are dropped with the last entry
    assert len(q) == 0 and q._heaps == {} and q.weight == 0.0 and list(q.heads()) == []
