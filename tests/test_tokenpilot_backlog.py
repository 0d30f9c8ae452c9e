"""TokenPilot's backlog model under held and queued dispatch: the 90k-token misroute and its fix.

The misroute (bench/SLOMAX.md): an engine slower than TokenPilot's prediction still holds
~90k prompt tokens in prefill after the router's clock-drained backlog says they are done,
while another engine, faster than predicted, has gone idle but still looks busy. The
router then sent chats behind the 90k tokens. First tokens now reconcile the backlog.
"""

from __future__ import annotations

import numpy as np

from fleetcore.types import InstanceSnapshot, RequestOutcome, RequestProfile
from tokenpilot.backlog import Outstanding, reconcile
from tokenpilot.priors import prior_from_physics
from tokenpilot.router import TokenPilot, TokenPilotConfig

PRIOR = prior_from_physics("llama-3.1-8b", "H100", max_batched_tokens=2048)  # bench/fleet_slomax.yaml's engines


def inst(iid: str, **kw: object) -> InstanceSnapshot:
    return InstanceSnapshot(**{"instance_id": iid, "site": "s", "model": "m", "version": "v",
                               "url": f"http://{iid}", **kw})  # type: ignore[arg-type]


def prompt(rid: str, tokens: int, first_block: int, stream: bool = True) -> RequestProfile:
    n = tokens // 16
    return RequestProfile(request_id=rid, model="m", prompt_tokens=tokens, stream=stream,
                          block_hashes=tuple(range(first_block, first_block + n)))


def pilot() -> TokenPilot:
    return TokenPilot({"a": PRIOR, "b": PRIOR}, config=TokenPilotConfig(explore=0.0))


def queue_s(tp: TokenPilot, rid: str, now: float, a: InstanceSnapshot, b: InstanceSnapshot) -> dict[str, float]:
    d = tp.route(prompt(rid, 300, 10_000_000), [a, b], now)
    return {c.name: c.detail["queue_s"] for c in d.candidates} | {"chosen": d.instance_id}  # type: ignore[dict-item]


def test_chat_is_not_sent_behind_90k_queued_prefill_tokens_while_another_instance_idles() -> None:
    tp = pilot()
    # Instance a gets three 30k-token documents (90k tokens of prefill); b gets three too.
    for k in range(3):
        tp.route(prompt(f"a{k}", 30_000, 1_000_000 * (k + 1)), [inst("a")], 0.0)
        tp.route(prompt(f"b{k}", 30_000, 1_000_000 * (k + 4)), [inst("b")], 0.0)
    predicted = tp.explain("a")["backlog_s"]
    assert predicted > 1.0  # seconds of prefill on each
    # b is faster than predicted: all its first tokens are in early; then it gets more work,
    # whose first tokens are in too. a is slower: not one first token yet, well after the
    # clock says its backlog is done.
    for k in range(3):
        tp.on_first_token(f"b{k}", 0.5 * predicted)
    for k in range(3):
        tp.route(prompt(f"b2{k}", 30_000, 1_000_000 * (k + 7)), [inst("b", num_running=3)], 0.5 * predicted)
        tp.on_first_token(f"b2{k}", 0.9 * predicted)
    now = 1.2 * predicted
    # The engines' reports agree with that: a has its three prompts running (in prefill),
    # b has six streams decoding; neither has a waiting queue.
    a = inst("a", inflight=3, num_running=3, kv_usage=0.2)
    b = inst("b", inflight=6, num_running=6, kv_usage=0.4)
    q = queue_s(tp, "chat", now, a, b)
    assert q["chosen"] == "b"
    # a: at least the two documents behind the one in progress; b: nothing outstanding.
    assert q["a"] >= 2 * predicted / 3 * 0.99 and q["b"] == 0.0


def test_first_tokens_bring_an_overestimated_backlog_down() -> None:
    tp = pilot()
    tp.route(prompt("long", 30_000, 1), [inst("a")], 0.0)
    assert tp.explain("a")["backlog_s"] > 0.5
    tp.on_first_token("long", 0.1)  # far sooner than predicted
    assert tp.explain("a")["backlog_s"] == 0.0
    assert tp.explain("a")["outstanding"] == 0.0


def test_a_request_without_a_first_token_leaves_when_it_ends() -> None:
    tp = pilot()
    tp.route(prompt("x", 30_000, 1), [inst("a")], 0.0)
    assert tp.explain("a")["outstanding"] == 1.0
    tp.observe(RequestOutcome("x", "a", "s", ok=False, error="upstream failed"))
    assert tp.explain("a")["outstanding"] == 0.0 and tp.explain("a")["backlog_s"] == 0.0


def test_unstreamed_requests_keep_the_clock_estimate() -> None:
    tp = pilot()
    tp.route(prompt("x", 30_000, 1, stream=False), [inst("a")], 0.0)
    b0 = tp.explain("a")["backlog_s"]
    assert tp.explain("a")["outstanding"] == 0.0 and b0 > 0.5
    q = queue_s(tp, "later", b0 / 2, inst("a"), inst("b"))
    assert abs(q["a"] - b0 / 2) < 1e-9  # drained by the clock only


def test_a_retry_elsewhere_moves_the_outstanding_prefill() -> None:
    tp = pilot()
    p = prompt("r", 30_000, 1)
    tp.route(p, [inst("a")], 0.0)
    tp.route(p, [inst("b")], 0.1)  # a failed before the first token; the gateway routes it again
    assert tp.explain("a")["outstanding"] == 0.0 and tp.explain("a")["streams"] == 0.0
    assert tp.explain("b")["outstanding"] == 1.0


def test_reconcile_bounds() -> None:
    clock = np.array([0.0, 5.0, 1.0])
    untracked = np.array([0.0, 0.0, 0.5])
    out = np.array([3.0, 1.0, 2.0])
    head = np.array([1.0, 1.0, 2.0])
    assert [reconcile(*x) for x in zip(clock, untracked, out, head)] == [2.0, 1.0, 1.0]


def test_outstanding_totals_follow_adds_and_removals() -> None:
    o = Outstanding()
    assert o.add(2, "x", 1.0) == (1.0, 1.0)
    assert o.add(2, "y", 2.0) == (3.0, 1.0)
    assert o.remove(2, "x") == (2.0, 2.0)
    assert o.remove(2, "x") is None
    assert o.remove(2, "y") == (0.0, 0.0) and o.count(2) == 0
