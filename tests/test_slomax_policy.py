"""SLOMax as a pure policy: classification, budgets, queues and shares, early rejection, the ledger."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from fleetcore.fleet_config import parse_fleet
from fleetcore.slo import BATCH, INTERACTIVE, LONG_CONTEXT, ClassSLO
from fleetcore.types import (
    FleetView,
    InstanceSnapshot,
    RequestOutcome,
    RequestProfile,
    SiteSnapshot,
)
from slomax import (
    SLOMax,
    SLOMaxConfig,
    TenantPolicy,
    UnknownClass,
    classify,
    from_fleet,
)
from slomax.budgets import TenantBudget, TokenBucket
from slomax.config import DEFAULT_CLASSES, Budgets, ClassPolicy, Knobs
from slomax.ledger import GoodputLedger
from slomax.queues import ClassQueue, ClassQueues, Entry, PrefillBudget

# --- classification -------------------------------------------------------------------------

CLASSES = {**DEFAULT_CLASSES, "premium": ClassPolicy("premium", ClassSLO(ttft_s=0.5))}


@pytest.mark.parametrize(("explicit", "task", "prompt", "max_tokens", "default", "long_output", "want"), [
    ("batch", "chat", 100, None, INTERACTIVE, None, (BATCH, "explicit")),
    ("premium", None, 100, None, INTERACTIVE, None, ("premium", "explicit")),
    (None, "batch", 100, None, INTERACTIVE, None, (BATCH, "task_type")),
    (None, "nightly", 100, None, INTERACTIVE, None, (BATCH, "task_type")),  # from the fleet's task map
    (None, "RAG", 100, None, INTERACTIVE, None, (LONG_CONTEXT, "task_type")),  # built-in name, any case
    (None, "premium", 100, None, INTERACTIVE, None, ("premium", "task_type")),  # a task type named as a class
    (None, None, 8192, None, INTERACTIVE, None, (LONG_CONTEXT, "length")),
    (None, None, 8191, None, INTERACTIVE, None, (INTERACTIVE, "tenant_default")),
    (None, None, 100, 20000, INTERACTIVE, 16384, (LONG_CONTEXT, "output_budget")),
    (None, None, 100, 20000, INTERACTIVE, None, (INTERACTIVE, "tenant_default")),  # rule off by default
    (None, None, 50_000, None, BATCH, 16384, (BATCH, "tenant_default")),  # a batch tenant's long prompt
    (None, "unheard-of", 100, None, INTERACTIVE, None, (INTERACTIVE, "tenant_default")),
    (None, None, 100, None, "premium", None, ("premium", "tenant_default")),
])
def test_classification_table(explicit, task, prompt, max_tokens, default, long_output, want) -> None:
    c = classify(prompt_tokens=prompt, max_tokens=max_tokens, explicit=explicit, task_type=task,
                 tenant_default=default, classes=CLASSES, long_context_min_tokens=8192,
                 long_output_tokens=long_output, task_classes={"nightly": BATCH})
    assert (c.request_class, c.source) == want


def test_an_unknown_explicit_class_is_an_error_naming_the_known_ones() -> None:
    with pytest.raises(UnknownClass, match="known: batch, interactive, long_context, premium"):
        classify(prompt_tokens=1, max_tokens=None, explicit="vip", task_type=None, tenant_default=INTERACTIVE,
                 classes=CLASSES, long_context_min_tokens=8192)


def test_classes_and_tenants_come_from_the_fleet_file() -> None:
    fleet = parse_fleet({
        "sites": [{"name": "s", "region": "r", "jurisdiction": "j"}],
        "models": [{"name": "m", "engine": {"spec": "llama-3.1-8b"}}],
        "admission": {"classes": {"premium": {"ttft_s": 0.3, "share": 9, "protected": 0.1},
                                  "long_context": {"max_concurrency": 0.5}},
                      "long_context_min_tokens": 4096},
        "tenants": [{"name": "vip", "default_class": "premium", "priority": 2,
                     "budgets": {"tokens_per_minute": 6000, "concurrent_streams": 3},
                     "slos": {"interactive": {"ttft_s": 0.4}}, "class_shares": {"batch": 0.5}}],
    })
    cfg = from_fleet(fleet)
    assert cfg.classes["premium"].slo == ClassSLO(ttft_s=0.3) and cfg.classes["premium"].protected == 0.1
    assert cfg.classes[LONG_CONTEXT].max_concurrency == 0.5 and cfg.classes[LONG_CONTEXT].slo.ttft_s == 8.0
    vip = cfg.tenants["vip"]
    assert (vip.default_class, vip.priority, vip.budgets.tokens_per_minute) == ("premium", 2, 6000)
    assert cfg.slo("vip", INTERACTIVE) == ClassSLO(ttft_s=0.4, tpot_s=0.05)  # override merged on the default
    assert cfg.slo("someone", INTERACTIVE) == ClassSLO(ttft_s=1.0, tpot_s=0.05)
    assert vip.share(BATCH) == 0.5 and vip.share(INTERACTIVE) == 1.0
    assert SLOMax(cfg).classify(profile("r", 5000, tenant="x")).request_class == LONG_CONTEXT


# --- budgets ---------------------------------------------------------------------------------


def test_token_bucket_refill_is_exact_and_capped() -> None:
    b = TokenBucket.per_minute(60, now=0.0)  # 60 per minute: one per second, holds one minute's worth
    assert (b.capacity, b.rate_per_s, b.level(0.0)) == (60.0, 1.0, 60.0)
    b.take(60, 0.0)
    assert b.level(0.0) == 0.0 and b.level(1.5) == 1.5 and b.level(59.0) == 59.0 and b.level(600.0) == 60.0
    assert b.wait_s(10, 4.0) == 6.0 and b.wait_s(61, 4.0) == math.inf
    # Reading does not move it: a million reads later the level is still the formula's.
    for i in range(1, 100_001):
        b.level(i * 1e-4)
    assert b.level(10.0) == 10.0
    b.take(3, 10.0)
    b.give(100, 12.0)  # refunds never overfill
    assert b.level(12.0) == 60.0


def test_tokens_per_minute_charges_prompt_plus_output_budget_and_settles_the_difference() -> None:
    tb = TenantBudget(Budgets(tokens_per_minute=1200), now=0.0)  # 20 tokens/s
    assert tb.check(1000, 0.0).ok
    tb.charge(1000, 0.0)
    v = tb.check(300, 0.0)
    assert not v.ok and v.code == "budget_tokens" and v.limit_type == "tokens"
    assert v.retry_after_s == pytest.approx(5.0)  # 100 missing at 20/s
    assert "limit 1200" in v.reason and "requested 300" in v.reason
    assert tb.check(300, 5.0).ok
    tb.settle(1000, 400, 5.0)  # it used 400 of the 1000 charged: 600 come back
    assert tb.tokens is not None and tb.tokens.level(5.0) == pytest.approx(200 + 100 + 600)
    huge = tb.check(5000, 5.0)
    assert not huge.ok and "too large" in huge.reason and huge.retry_after_s == 60.0


def test_requests_per_minute_and_concurrent_streams() -> None:
    tb = TenantBudget(Budgets(requests_per_minute=2, concurrent_streams=2), now=0.0)
    tb.charge(1, 0.0)
    tb.charge(1, 0.0)
    v = tb.check(1, 0.0)
    assert not v.ok and v.code == "budget_concurrency" and "2 of 2" in v.reason
    tb.settle(1, 1, 1.0)
    v = tb.check(1, 1.0)  # a stream is free, but the minute's two requests are spent
    assert not v.ok and v.code == "budget_requests" and v.retry_after_s == pytest.approx(29.0)
    assert tb.check(1, 30.0).ok


# --- queues and shares -----------------------------------------------------------------------


def entry(rid: str, cls: str = INTERACTIVE, tenant: str = "t", w: float = 100.0, seq: int = 0,
          deadline: float | None = None, priority: int = 0) -> Entry:
    return Entry(rid, tenant, cls, "m", 0.0, 0.0, w, int(w), deadline, priority, seq)


def test_class_queue_order_fifo_edf_priority_and_fair_tenants() -> None:
    q = ClassQueue(DEFAULT_CLASSES[INTERACTIVE])
    for i, t in enumerate(["a", "a", "b"]):
        q.push(entry(f"r{i}", tenant=t, seq=i))
    usage = {"a": 0.0, "b": 0.0, "c": 9.0}
    assert q.peek(usage.__getitem__).request_id == "r0"  # FIFO when tenants are even
    usage["a"] = 5.0
    assert q.peek(usage.__getitem__).request_id == "r2"  # the tenant with less in flight first
    q.push(entry("vip", tenant="c", seq=9, priority=1))
    assert q.peek(usage.__getitem__).request_id == "vip"  # tenant priority before fairness
    assert q.remove("vip") is not None and "vip" not in q and len(q) == 3  # leaves at once
    assert q.peek(usage.__getitem__).request_id == "r2"

    b = ClassQueue(DEFAULT_CLASSES[BATCH])  # earliest deadline first
    for i, dl in enumerate([300.0, 100.0, None, 200.0]):
        b.push(entry(f"b{i}", BATCH, seq=i, deadline=dl))
    order = []
    while len(b):
        e = b.peek(lambda t: 0.0)
        order.append(e.request_id)
        b.pop(e)
    assert order == ["b1", "b3", "b0", "b2"]
    assert b.ahead_of(150.0, 0) == 0


def _queues(rate: float | None, n: int = 1) -> ClassQueues:
    q = ClassQueues(DEFAULT_CLASSES, lambda t, c: 1.0)
    q.n_ready = n
    if rate is not None:
        q.budget = PrefillBudget({c: p.protected for c, p in DEFAULT_CLASSES.items()}, rate, 2.0, 0.0)
    return q


def test_contended_budget_is_split_by_class_share() -> None:
    q = _queues(rate=7000.0)
    for i in range(2000):
        q.queues[INTERACTIVE].push(entry(f"i{i}", INTERACTIVE, seq=i))
        q.queues[BATCH].push(entry(f"b{i}", BATCH, seq=i, deadline=1e9))
    q.start(entry("running", LONG_CONTEXT, w=1.0), 0.0)  # the pool is not idle
    started = {INTERACTIVE: 0, BATCH: 0}
    t = 0.0
    while t < 20.0:
        e = q.next(t)
        if e is None:
            t += 0.01
            continue
        q.pop(e)
        q.start(e, t)
        started[e.request_class] += 1
    # 7,000 tokens/s of 100-token prefills for 20 s, both queues never empty: shares 6 : 1
    # (interactive's own protected fifth of the rate included), and nothing left unspent.
    assert started[INTERACTIVE] / started[BATCH] == pytest.approx(6.0, rel=0.1)
    assert sum(started.values()) == pytest.approx(7000 * 20 / 100 + 140, rel=0.05)  # + the full bucket


def test_protected_capacity_survives_a_huge_batch_prompt() -> None:
    q = _queues(rate=1000.0)  # bucket: 2,000 tokens; interactive's own: a fifth
    q.start(entry("running", BATCH, w=1.0), 0.0)
    q.queues[BATCH].push(entry("huge", BATCH, w=50_000, deadline=1e9))
    e = q.next(0.0)
    assert e is not None and e.request_id == "huge"  # passes at an eighth of a bucket, into debt
    q.pop(e)
    q.start(e, 0.0)
    q.queues[BATCH].push(entry("next-batch", BATCH, w=100, seq=2, deadline=1e9))
    q.queues[INTERACTIVE].push(entry("chat", INTERACTIVE, w=100, seq=3))
    assert q.next(0.1).request_id == "chat"  # its own bucket is untouched by batch's debt
    q.pop(q.next(0.1))
    assert q.next(0.1) is None and q.blocked(0.1) == {"budget"}


def test_long_context_concurrency_cap_does_not_block_other_classes() -> None:
    q = _queues(rate=None, n=2)
    q.concurrency_override[LONG_CONTEXT] = 1.0  # one per ready instance: two in all
    for i in range(2):
        q.start(entry(f"lc{i}", LONG_CONTEXT, w=30_000), 0.0)
    q.queues[LONG_CONTEXT].push(entry("lc2", LONG_CONTEXT, w=30_000, seq=5))
    assert q.next(0.0) is None and q.blocked(0.0) == {"cap:long_context"}
    q.queues[INTERACTIVE].push(entry("chat", seq=6))
    assert q.next(0.0).request_id == "chat"  # work-conserving: the cap holds only its own class
    q.finish(entry("lc0", LONG_CONTEXT, w=30_000))
    q.pop(q.next(0.0))
    assert q.next(0.0).request_id == "lc2"


# --- early rejection -------------------------------------------------------------------------


def view(n: int = 1, kv: float = 0.1) -> FleetView:
    insts = tuple(InstanceSnapshot(f"i{k}", "s", "m", "v1", f"http://i{k}", kv_usage=kv) for k in range(n))
    return FleetView((SiteSnapshot("s", "r", "j", {}, insts),))


def profile(rid: str, prompt: int, *, tenant: str = "t", cls: str | None = None, arrival: float = 0.0,
            max_tokens: int | None = 16, stream: bool = True) -> RequestProfile:
    return RequestProfile(rid, "m", prompt, max_tokens=max_tokens, tenant=tenant, request_class=cls,
                          arrival=arrival, stream=stream)


def finished(rid: str, *, ttft: float = 0.1, tpot: float = 0.02, e2e: float = 1.0, out: int = 16,
             cancelled: bool = False, ok: bool = True) -> RequestOutcome:
    return RequestOutcome(rid, "i0", "s", ok=ok, output_tokens=out, ttft_s=ttft, mean_tpot_s=tpot, e2e_s=e2e,
                          cancelled=cancelled)


def test_early_rejection_on_an_overloaded_fleet_before_any_prefill() -> None:
    # One instance, a prefill budget of 1,000 uncached tokens/s, and it is spent.
    sm = SLOMax(SLOMaxConfig(knobs=Knobs(prefill_rate=1000.0), feedback=False))
    v = view(1)
    assert sm.admit(profile("big", 2000, cls=BATCH), v, 0.0).action == "admit"
    sm.on_dispatched("big", "i0", 0.0)
    sm.on_first_token("big", 0.5)  # its prefill is through: the engines are idle, the budget is not
    decisions = [sm.admit(profile(f"c{k}", 500, arrival=0.5), v, 0.5).action for k in range(5)]
    # The first chat starts on interactive's protected part of the budget; then 500 tokens each
    # at ~1,000 tokens/s: two more can still start within their 1 s, the rest cannot.
    assert decisions == ["admit", "queue", "queue", "reject", "reject"]
    late = sm.admit(profile("late", 500, arrival=0.5), v, 0.5)
    assert late.action == "reject" and late.code == "slo_unattainable" and late.request_class == INTERACTIVE
    assert "exceeds the interactive SLO of 1 s" in late.reason and late.retry_after_s >= 1
    assert sm.snapshot(0.5)["pools"]["m"]["in_flight"] == 2  # big and c0: nothing rejected reached an engine
    assert sm.ledger.totals[("t", INTERACTIVE)].rejected_by == {"slo_unattainable": 3}
    # As the budget refills, the queued ones start; a client that left never does.
    assert sm.cancel("c1", 0.6) is True
    assert [d.request_id for d in sm.poll(1.0, v) if d.action == "admit"] == ["c2"]
    assert sm.next_wakeup(1.0) is None  # nothing waits


def test_a_waiting_request_is_rejected_once_hopeless_and_its_tokens_come_back() -> None:
    cfg = SLOMaxConfig(tenants={"t": TenantPolicy("t", budgets=Budgets(tokens_per_minute=12_000))},
                       knobs=Knobs(prefill_rate=100.0), feedback=False)
    sm = SLOMax(cfg)
    v = view(1)
    sm.admit(profile("hog", 400, cls=BATCH), v, 0.0)
    sm.on_dispatched("hog", "i0", 0.0)
    d = sm.admit(profile("chat", 50), v, 0.0)  # 200 own tokens/s can pay for it well within 1 s ...
    assert d.action == "queue"
    sm.admit(profile("long", 5000, cls=LONG_CONTEXT, max_tokens=100), v, 0.0)  # ~50 s of budget ahead
    tb = sm.budgets.get("t", 0.0)
    assert tb.tokens is not None and tb.tokens.level(0.0) == 12_000 - 416 - 66 - 5100 and tb.streams == 3
    assert sm.cancel("chat", 0.0) is True  # the client left: its tokens and its stream come back
    assert tb.tokens.level(0.0) == 12_000 - 416 - 5100 and tb.streams == 2
    wake = sm.next_wakeup(0.0)
    assert wake is not None and 0.0 < wake <= 8.0
    out = {d.request_id: d for d in sm.poll(9.0, v)}
    assert out["long"].action == "reject" and out["long"].code == "queue_timeout"
    assert tb.streams == 1


def test_outcomes_free_capacity_and_book_goodput_with_misses_counted_against() -> None:
    sm = SLOMax()
    v = view(2)
    for rid in ("ok", "slow", "gone", "broken"):
        assert sm.admit(profile(rid, 100, tenant="acme"), v, 0.0).action == "admit"
    sm.observe(finished("ok", out=40))
    sm.observe(finished("slow", ttft=2.5, out=40))
    sm.observe(finished("gone", cancelled=True, out=7))
    sm.observe(finished("broken", ok=False, out=0))
    sm.observe(finished("never-admitted"))  # ignored
    cell = sm.ledger.totals[("acme", INTERACTIVE)]
    assert (cell.arrived, cell.admitted, cell.completed, cell.met_slo, cell.cancelled, cell.failed) == (4, 4, 2, 1, 1, 1)
    assert (cell.output_tokens, cell.goodput_tokens, cell.attainment) == (87, 40, 0.25)
    assert sm.snapshot(0.0)["pools"]["m"]["in_flight"] == 0


def test_over_budget_is_rejected_with_a_retry_time_and_costs_nothing() -> None:
    cfg = SLOMaxConfig(tenants={"t": TenantPolicy("t", budgets=Budgets(requests_per_minute=1))})
    sm = SLOMax(cfg)
    assert sm.admit(profile("a", 10), view(), 0.0).action == "admit"
    d = sm.admit(profile("b", 10), view(), 1.0)
    assert (d.action, d.code, d.retry_after_s) == ("reject", "budget_requests", 59.0)
    assert sm.ledger.totals[("t", INTERACTIVE)].rejected_by == {"budget_requests": 1}


def test_the_valve_holds_work_back_while_engines_have_prefill_queued_and_ignores_unstreamed() -> None:
    sm = SLOMax(SLOMaxConfig(feedback=False))
    v = view(1)
    # Teach the valve the instance's speed: 4,000 tokens through in 0.5 s.
    sm.admit(profile("warm", 4000, cls=BATCH), v, 0.0)
    sm.on_dispatched("warm", "i0", 0.0)
    sm.on_first_token("warm", 0.5)
    assert sm.snapshot(0.5)["pools"]["m"]["prefill_speed_tokens_per_s"] == 8000.0
    sm.admit(profile("doc", 4000, cls=BATCH), v, 0.5)  # 0.5 s of prefill queued at the engine ...
    sm.on_dispatched("doc", "i0", 0.5)
    assert sm.admit(profile("next", 100, cls=BATCH), v, 0.6).action == "queue"  # ... over the 0.25 s target
    assert sm.admit(profile("chat", 100), v, 0.6).action == "queue"  # interactive: the best instance is busy too
    sm.on_first_token("doc", 0.9)
    assert [d.request_id for d in sm.poll(0.9, v)] == ["chat", "next"]  # interactive first
    # A request answered in one piece has no first token to watch: the valve leaves it out.
    sm.admit(profile("whole", 50_000, cls=BATCH, stream=False), v, 1.0)
    sm.on_dispatched("whole", "i0", 1.0)
    assert sm.admit(profile("after", 100, cls=BATCH), v, 1.0).action == "admit"


def test_an_admitted_request_is_told_which_instances_to_avoid() -> None:
    sm = SLOMax(SLOMaxConfig(feedback=False))
    v = view(2)
    for rid, iid in (("w0", "i0"), ("w1", "i1")):  # both instances measured: 8,000 tokens/s
        sm.admit(profile(rid, 4000, cls=BATCH), v, 0.0)
        sm.on_dispatched(rid, iid, 0.0)
        sm.on_first_token(rid, 0.5)
    sm.admit(profile("doc", 8000, cls=LONG_CONTEXT), v, 1.0)
    sm.on_dispatched("doc", "i0", 1.0)  # i0: a second of prefill queued
    d = sm.admit(profile("chat", 100), v, 1.0)
    assert d.action == "admit" and d.avoid_instances == ("i0",)  # more than half its 1 s TTFT SLO
    sm.on_dispatched("chat", "i1", 1.0)
    sm.on_first_token("chat", 1.02)
    assert sm.admit(profile("b", 100, cls=BATCH), v, 1.1).avoid_instances == ()  # no TTFT to protect


def test_nothing_ready_admits_so_the_gateway_can_say_503_no_ready_instance() -> None:
    sm = SLOMax()
    empty = FleetView((SiteSnapshot("s", "r", "j", {}, ()),))
    assert sm.admit(profile("x", 10), empty, 0.0).action == "admit"


def test_unknown_explicit_class_is_refused_as_such() -> None:
    d = SLOMax().admit(profile("x", 10, cls="gold"), view(), 0.0)
    assert d.action == "reject" and d.code == "unknown_class"


# --- the ledger ------------------------------------------------------------------------------


def test_ledger_books_by_arrival_window_and_reports_with_filters() -> None:
    led = GoodputLedger(window_s=60)
    led.arrived("a", INTERACTIVE, 10)
    led.completed("a", INTERACTIVE, 10, 100, met=True)  # finished later: still the 0-60 s cohort
    led.arrived("a", INTERACTIVE, 70)
    led.rejected("a", INTERACTIVE, 70, "slo_unattainable")
    led.arrived("b", BATCH, 20)
    led.cancelled("b", BATCH, 20, output_tokens=5)
    led.retried("b", BATCH, 20)
    rows = led.report(per_window=True)
    assert [(r["tenant"], r["class"], r["window_start"]) for r in rows] == [
        ("a", INTERACTIVE, 0.0), ("a", INTERACTIVE, 60.0), ("b", BATCH, 0.0)]
    assert rows[0]["attainment"] == 1.0 and rows[1]["attainment"] == 0.0
    assert rows[1]["rejected_by_reason"] == {"slo_unattainable": 1}
    assert rows[0]["goodput_tok_s"] == pytest.approx(100 / 60)
    (a,) = led.report(tenants={"a"})
    assert (a["arrived"], a["met_slo"], a["attainment"], a["window_end"]) == (2, 1, 0.5, 120.0)
    assert led.report(since=65) == [r for r in led.report(since=65) if r["window_start"] >= 60]
    (b,) = led.report(request_class=BATCH)
    assert (b["cancelled"], b["retried"], b["output_tokens"], b["goodput_tokens"], b["attainment"]) == (1, 1, 5, 0, 0.0)


def test_fcfs_admits_everything_and_keeps_the_same_ledger() -> None:
    from slomax import FCFS

    f = FCFS()
    for k in range(50):
        assert f.admit(profile(f"r{k}", 50_000 if k % 2 else 100), view(), 0.0).action == "admit"
    f.observe(finished("r0", ttft=0.2))
    assert f.ledger.totals[("t", INTERACTIVE)].met_slo == 1 and f.poll(1.0) == [] and f.next_wakeup(1.0) is None


def test_config_defaults_keep_replace_friendly() -> None:
    cfg = replace(SLOMaxConfig(), knobs=replace(Knobs(), engine_wait_s=0.5))
    assert cfg.knobs.engine_wait_s == 0.5 and cfg.classes[INTERACTIVE].protected == 0.2


def test_a_budget_the_controller_brings_in_holds_the_next_burst_back_at_once() -> None:
    """The prefill budget is unlimited until a control interval's TPOT p95 misses the SLO. When
    that first happens in the middle of a burst, the engines are behind already: the budget must
    bite from that moment. It used to start with full buckets (`burst_s`, 2 s of its rate), so a
    burst arriving then went straight through; live, SLOMax then held nothing for ~8 s of the
    trace's burst of long prompts (bench/latency_live.py at 40/s: 5-17 rejections instead of 37,
    80-100 more TPOT misses; bench/SLOMAX.md, "A budget brought in mid-burst")."""
    sm = SLOMax()  # the defaults: feedback on, no prefill budget until TPOT suffers, 5 s intervals
    v = view(2)
    ends: list[tuple[float, str]] = []
    t, k = 0.0, 0
    # 20 chats a second, 1,000 tokens each, all of them at twice their TPOT SLO (50 ms):
    # 10,000 tokens/s taken per instance, and the engines visibly behind.
    while True:
        assert t < 20.0, "the controller never brought a budget in"
        for end, rid in sorted(e for e in ends if e[0] <= t):
            ends.remove((end, rid))
            sm.observe(finished(rid, ttft=0.05, tpot=0.1, e2e=1.95, out=20))
            sm.poll(end, v)  # as the gateway's pump, after every release
        if sm.snapshot(t)["pools"].get("m", {}).get("prefill_budget_tokens") is not None:
            break
        rid = f"c{k}"
        assert sm.admit(profile(rid, 1000, arrival=t), v, t).action == "admit"
        sm.on_dispatched(rid, f"i{k % 2}", t)
        sm.on_first_token(rid, t + 0.05)
        ends.append((t + 1.95, rid))
        t, k = round(t + 0.05, 6), k + 1
    pool = sm.snapshot(t)["pools"]["m"]
    rate = pool["prefill_rate_per_instance"] * 2
    assert rate >= 15_000  # from what the engines were taking (20,000 tokens/s)
    # A burst of long prompts right then: a 4,000-token prompt every 50 ms for a second (80,000
    # tokens/s), the instances taking turns and each through its prefill 50 ms later, so the
    # engines' valve stays open: only the budget can hold them.
    admitted = 0
    for i in range(20):
        now = round(t + 0.05 * i, 6)
        for d in sm.poll(now, v):  # queued ones the budget lets go
            if d.action == "admit":
                admitted += 1
                sm.on_dispatched(d.request_id, "i0", now)
                sm.on_first_token(d.request_id, now)
        d = sm.admit(profile(f"long{i}", 4000, arrival=now), v, now)
        if d.action == "admit":
            admitted += 1
            sm.on_dispatched(f"long{i}", f"i{i % 2}", now)
            sm.on_first_token(f"long{i}", now + 0.05)
    # A second of the budget's rate, plus the eighth of a bucket a start needs; with the buckets
    # full when it came in (2 s of its rate on top), 18 of the 20 went through.
    assert admitted * 4000 <= rate * (1.0 + 2.0 / 8) + 4000, admitted
    assert pool["prefill_budget_tokens"] == 0.0  # nothing in it when it came in
