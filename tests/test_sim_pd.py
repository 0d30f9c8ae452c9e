"""Prefill/decode disaggregation in the engine model, the link model and the simulator (issue 17)."""

from __future__ import annotations

import pytest

from engine_adapters.sim.engine import EngineConfig, SimEngine, SimRequest
from fleetcore.hardware import gpu, model
from fleetcore.interconnect import Link, LinkQueue, kv_bytes

BS = 16


def hashes(tag: object, n_blocks: int) -> list[int]:
    return [hash((tag, i)) for i in range(n_blocks)]


def engine(**kw: object) -> SimEngine:
    cfg: dict[str, object] = dict(model=model("llama-3.1-8b"), gpu=gpu("h100"), num_gpu_blocks_override=64)
    cfg.update(kw)
    return SimEngine(EngineConfig(**cfg))  # type: ignore[arg-type]


def req(rid: str, prompt: int, out: int, tag: object = None, mode: str = "full") -> SimRequest:
    return SimRequest(rid, prompt, hashes(tag if tag is not None else rid, prompt // BS), out, 0.0,
                      mode=mode)  # type: ignore[arg-type]


def drain(e: SimEngine, now: float = 0.0) -> tuple[float, list[tuple[str, int, bool, bool]]]:
    """Step until idle: (end time, events as (id, new tokens, first, finished))."""
    out = []
    while e.has_work():
        res = e.step(now)
        assert res.duration > 0
        now += res.duration
        out += [(ev.request_id, ev.new_tokens, ev.first_token, ev.finished) for ev in res.events]
    return now, out


# --- engine: prefill-only and decode-only ------------------------------------------


def test_prefill_only_ends_at_first_token_and_holds_its_kv_until_released() -> None:
    e = engine()
    e.add_request(req("a", 100, 50, mode="prefill"))
    _, events = drain(e)
    assert events == [("a", 1, True, True)]  # one token, the first; no decoding here
    assert e.kv.num_free_blocks == 64 - 7  # ceil(100 / 16) blocks stay held while the KV is sent
    assert e.has_request("a") and e.num_held == 1 and not e.has_work()
    assert e.release_kv("a") and not e.release_kv("a")
    assert e.kv.num_free_blocks == 64 and e.num_held == 0 and not e.has_request("a")
    assert e.kv.num_cached_blocks == 6  # its full prompt blocks stay reusable here


def test_receive_reserves_the_prompt_and_decodes_only_after_the_kv_arrived() -> None:
    e = engine()
    assert e.receive(req("a", 100, 5)) == 0
    assert e.kv.num_free_blocks == 64 - 7  # ceil(101 / 16): prompt + the first token
    assert not e.has_work()  # in transfer: nothing to schedule
    assert e.step(0.0).events == []
    e.kv_arrived("a")
    _, events = drain(e)
    # four more tokens (the prefill engine made the first), none of them "first"
    assert events == [("a", 1, False, False)] * 3 + [("a", 1, False, True)]
    assert e.kv.num_free_blocks == 64 and e.kv.num_cached_blocks == 6 and not e.has_request("a")


def test_decode_step_costs_a_decode_not_a_prefill() -> None:
    e = engine(num_gpu_blocks_override=None)
    e.receive(req("a", 4000, 3))
    e.kv_arrived("a")
    decode_step = e.step(0.0)
    assert decode_step.num_tokens == 1
    full = engine(num_gpu_blocks_override=None)
    full.add_request(req("b", 4000, 3))
    assert full.step(0.0).duration > 5 * decode_step.duration


def test_receive_reuses_a_prefix_already_here_and_refuses_without_room() -> None:
    e = engine()
    e.add_request(req("warm", 64, 1, tag="doc"))
    drain(e)
    assert e.receive(req("b", 80, 4, tag="doc")) == 64  # four shared blocks need not cross
    assert e.receive(req("big", 60 * BS, 4)) is None  # 61 blocks do not fit next to b's 6
    assert not e.has_request("big") and e.kv.num_free_blocks == 64 - 6
    with pytest.raises(ValueError, match="one output token"):
        e.receive(req("one", 32, 1))


def test_abort_frees_held_receiving_and_arrived_requests() -> None:
    e = engine()
    e.add_request(req("p", 32, 9, mode="prefill"))
    drain(e)
    e.receive(req("r", 32, 9))
    e.receive(req("q", 32, 9))
    e.kv_arrived("q")
    assert e.kv.num_free_blocks == 64 - 2 - 3 - 3  # held 32 tokens; 33 reserved each
    assert e.abort("p") and e.abort("r") and e.abort("q")
    assert e.kv.num_free_blocks == 64 and not e.has_work() and e.num_held == 0


def test_preempted_decode_request_recomputes_locally() -> None:
    e = engine(num_gpu_blocks_override=10)
    e.receive(req("a", 70, 60))  # 5 blocks now, grows to 9
    e.kv_arrived("a")
    e.add_request(req("b", 70, 60))
    _, events = drain(e)
    done = {rid for rid, _, _, fin in events if fin}
    assert done == {"a", "b"} and e.num_preemptions >= 1
    assert sum(n for rid, n, _, _ in events if rid == "a") == 59


# --- the link -----------------------------------------------------------------------


def test_transfer_time_is_latency_plus_kv_bytes_over_bandwidth() -> None:
    m = model("llama-3.1-70b")
    assert m.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2  # 320 KiB per token
    link = Link(50e9, 1e-5)
    assert link.transfer_s(kv_bytes(m, 8192)) == pytest.approx(1e-5 + 8192 * 327680 / 50e9)  # ~54 ms
    q = LinkQueue(link)
    assert q.reserve(1.0, 50e9) == pytest.approx((1.0, 2.00001))
    assert q.wait_s(1.5) == pytest.approx(0.5)
    start, end = q.reserve(1.5, 25e9)  # queued behind the first transfer
    assert start == pytest.approx(2.0) and end == pytest.approx(2.50001)


# --- TokenPilot's per-request decision on hand-made fleets ----------------------------

from fleetcore.types import InstanceSnapshot, RequestProfile  # noqa: E402
from tokenpilot.disagg import DisaggConfig, PDDecision, TokenPilotDisagg  # noqa: E402
from tokenpilot.disagg_baselines import DynamoConditional, LlmDDecider  # noqa: E402
from tokenpilot.priors import prior_from_physics  # noqa: E402
from tokenpilot.router import TokenPilot  # noqa: E402

KV_70B = model("llama-3.1-70b").kv_bytes_per_token


class FakeLinks:
    """Transfers over 50 GB/s links; `wait` seconds of queue on the named senders."""

    def __init__(self, wait: dict[str, float] | None = None, bandwidth: float = 50e9) -> None:
        self.wait = wait or {}
        self.link = Link(bandwidth, 1e-5)
        self.asked: list[tuple[str, str, int]] = []

    def predict_s(self, src: str, dst: str, tokens: int, now: float) -> float:
        self.asked.append((src, dst, tokens))
        return self.wait.get(src, 0.0) + self.link.transfer_s(kv_bytes(model("llama-3.1-70b"), tokens))


def snap(iid: str, role: str, running: int = 0, kv: float = 0.0) -> InstanceSnapshot:
    return InstanceSnapshot(iid, "s", "m", "v1", f"sim://{iid}", role=role,  # type: ignore[arg-type]
                            num_running=running, kv_usage=kv)


def pilot() -> TokenPilot:
    prior = prior_from_physics("llama-3.1-70b", "H200", 2)
    return TokenPilot(priors={i: prior for i in ("p0", "p1", "d0", "d1")}, seed=0)


def profile(rid: str, prompt: int, out: int = 200, tag: str | None = None) -> RequestProfile:
    return RequestProfile(rid, "m", prompt, tuple(hashes(tag or rid, prompt // BS)), BS, max_tokens=out)


# A decode pool with 8 streams decoding on each instance, and an idle prefill pool.
FLEET = [snap("p0", "prefill"), snap("p1", "prefill"), snap("d0", "decode", 8), snap("d1", "decode", 8)]


def test_short_uncached_prompt_stays_local() -> None:
    d = TokenPilotDisagg(pilot()).decide(profile("a", 200), FLEET, FakeLinks(), 0.0)
    assert not d.split and d.decode in ("d0", "d1") and d.prefill is None
    assert d.reason.startswith("local: predicted cost")


def test_long_prompt_goes_to_a_prefill_instance() -> None:
    links = FakeLinks()
    d = TokenPilotDisagg(pilot()).decide(profile("a", 16000), FLEET, links, 0.0)
    assert d.split and d.prefill in ("p0", "p1") and d.decode in ("d0", "d1")
    # the whole prompt crosses (nothing cached on the decode side): ~105 ms at 50 GB/s
    assert d.transfer_s == pytest.approx(1e-5 + 16000 * KV_70B / 50e9)
    assert d.predicted_ttft_s is not None and d.predicted_ttft_s > d.transfer_s


def test_congested_link_keeps_a_long_prompt_local() -> None:
    d = TokenPilotDisagg(pilot()).decide(profile("a", 16000), FLEET, FakeLinks(wait={"p0": 30.0, "p1": 30.0}), 0.0)
    assert not d.split and d.decode in ("d0", "d1")


def test_cache_reuse_counts_on_the_prefill_side_and_on_the_decode_side() -> None:
    tp = pilot()
    pd = TokenPilotDisagg(tp)
    first = pd.decide(profile("a", 16000, tag="doc"), FLEET, FakeLinks(), 0.0)
    assert first.split
    # The same document again: the prefill instance that holds it wins; and the decode
    # instance that received its KV holds it too, so fewer tokens would cross to it.
    links = FakeLinks()
    again = pd.decide(profile("b", 16000, tag="doc"), FLEET, links, 1.0)
    assert again.cached_tokens > 15000
    if again.split:
        assert again.prefill == first.prefill
        assert any(dst == first.decode and tokens < 1000 for _, dst, tokens in links.asked)
    else:  # prefilling locally where the KV already is is the cheapest of all
        assert again.decode == first.decode


def test_split_books_prefill_on_one_instance_and_the_stream_on_the_other() -> None:
    tp = pilot()
    d = TokenPilotDisagg(tp).decide(profile("a", 16000), FLEET, FakeLinks(), 0.0)
    assert d.split and d.prefill is not None and d.decode is not None
    assert tp.explain(d.prefill)["backlog_s"] > 0 and tp.explain(d.prefill)["streams"] == 0
    assert tp.explain(d.decode)["backlog_s"] == 0 and tp.explain(d.decode)["streams"] == 1


def test_no_decode_capable_instance_is_an_answer_with_a_reason() -> None:
    d = TokenPilotDisagg(pilot()).decide(profile("a", 100), FLEET[:2], FakeLinks(), 0.0)
    assert d == PDDecision(None, "no ready decode or mixed instance")
    assert TokenPilotDisagg(pilot()).decide(profile("a", 100), [], FakeLinks(), 0.0).decode is None


def test_one_output_token_never_splits() -> None:
    d = TokenPilotDisagg(pilot(), DisaggConfig()).decide(profile("a", 16000, out=1), FLEET, FakeLinks(), 0.0)
    assert not d.split


# --- the published rules -----------------------------------------------------------


def test_dynamo_isl_bounding_needs_both_bounds_to_stay_local() -> None:
    pol = DynamoConditional(pilot())
    assert pol.remote(1000, 1000)  # under 2048 tokens, but all of the prompt is uncached (>= 0.7)
    assert not pol.remote(1000, 4000)  # under 2048 and a quarter of the prompt: local
    assert pol.remote(3000, 40000)  # a small share, but over 2048 tokens
    assert pol.remote(2048, 100000) and not pol.remote(2047, 100000)
    with pytest.raises(ValueError):
        DynamoConditional(pilot(), eff_isl_ratio_threshold=1.5)


def test_dynamo_and_llm_d_decide_on_the_decode_instances_uncached_tokens() -> None:
    # 1500 uncached tokens: llm-d (>= 512) splits; Dynamo (ratio 1.0 >= 0.7) splits as well
    for pol in (DynamoConditional(pilot()), LlmDDecider(pilot())):
        assert pol.decide(profile("a", 1500), FLEET, FakeLinks(), 0.0).split, pol.name
    # 400 uncached: llm-d stays local; Dynamo still splits (its ratio rule: 400/400 >= 0.7)
    assert not LlmDDecider(pilot()).decide(profile("b", 400), FLEET, FakeLinks(), 0.0).split
    assert DynamoConditional(pilot()).decide(profile("b", 400), FLEET, FakeLinks(), 0.0).split
    # a long prompt mostly cached on the decode instance: both stay local
    for pol in (DynamoConditional(pilot()), LlmDDecider(pilot())):
        warm = pol.decide(profile("w", 8000, tag="doc"), FLEET, FakeLinks(), 0.0)
        assert warm.split  # cold: remote prefill, the KV lands on the decode instance
        again = pol.decide(profile("x", 8000 + 300, tag="doc"), FLEET, FakeLinks(), 1.0)
        assert not again.split and again.decode == warm.decode, pol.name
    assert not LlmDDecider(pilot(), non_cached_tokens=0).remote(10**6, 10**6)  # 0 disables it there
