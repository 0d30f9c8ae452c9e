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
