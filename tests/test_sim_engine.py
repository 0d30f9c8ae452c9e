"""Simulated engine: KV block manager and continuous-batching scheduler."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from engine_adapters.sim.engine import EngineConfig, SimEngine, SimRequest, StepResult
from engine_adapters.sim.kv_cache import KVCacheManager
from fleetcore.hardware import gpu, model

BS = 16


def hashes(tag: object, n_blocks: int) -> list[int]:
    """Stand-in chained block hashes: equal tags give equal prefixes."""
    return [hash((tag, i)) for i in range(n_blocks)]


def make_engine(**kw) -> SimEngine:
    cfg = dict(model=model("llama-3.1-8b"), gpu=gpu("h100"))
    cfg.update(kw)
    return SimEngine(EngineConfig(**cfg))


def req(rid: str, prompt_len: int, output_len: int, tag: object = None, arrival: float = 0.0) -> SimRequest:
    return SimRequest(rid, prompt_len, hashes(tag if tag is not None else rid, prompt_len // BS), output_len, arrival)


@dataclass
class Trace:
    first_token_at: dict[str, float] = field(default_factory=dict)
    finished_at: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)
    preempted: dict[str, int] = field(default_factory=dict)
    steps: list[StepResult] = field(default_factory=list)


def run(engine: SimEngine, reqs: list[SimRequest], now: float = 0.0, max_steps: int = 1_000_000) -> Trace:
    """Drive the engine in virtual time: arrivals by timestamp, steps back to back."""
    pending = sorted(reqs, key=lambda r: r.arrival)
    tr = Trace()
    i = 0
    for _ in range(max_steps):
        while i < len(pending) and pending[i].arrival <= now:
            engine.add_request(pending[i])
            i += 1
        if not engine.has_work():
            if i == len(pending):
                return tr
            now = pending[i].arrival
            continue
        res = engine.step(now)
        assert res.duration > 0 and res.start == now
        tr.steps.append(res)
        now += res.duration
        for ev in res.events:
            if ev.preempted:
                tr.preempted[ev.request_id] = tr.preempted.get(ev.request_id, 0) + 1
                continue
            assert ev.new_tokens == 1
            tr.tokens[ev.request_id] = tr.tokens.get(ev.request_id, 0) + 1
            if ev.first_token:
                assert ev.request_id not in tr.first_token_at
                tr.first_token_at[ev.request_id] = now
                tr.cached[ev.request_id] = ev.cached_tokens
            if ev.finished:
                assert ev.request_id not in tr.finished_at
                tr.finished_at[ev.request_id] = now
    raise AssertionError("engine did not drain")


# -- KV cache manager ---------------------------------------------------------


def test_kv_prefix_match_cap_and_counters() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    h = hashes("p", 4)
    assert kv.allocate_prompt("a", h, 64) == 0
    assert kv.commit_full_blocks("a", 64) == 4
    assert kv.match_prefix(h) == 4
    assert kv.prefix_queries_tokens == 64 and kv.prefix_hits_tokens == 0
    # Fully cached 64-token prompt: the last block is recomputed (>= 1 token).
    assert kv.allocate_prompt("b", h, 64) == 48
    assert kv.prefix_queries_tokens == 128 and kv.prefix_hits_tokens == 48
    # Shared blocks counted once in usage.
    assert kv.num_free_blocks == 16 - 5
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 16 and kv.usage() == 0.0
    assert kv.num_cached_blocks == 4


def test_kv_allocation_failure_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    assert kv.allocate_prompt("a", [], 48) == 0
    before = (kv.num_free_blocks, kv.prefix_queries_tokens)
    assert kv.allocate_prompt("b", [], 32) is None
    assert (kv.num_free_blocks, kv.prefix_queries_tokens) == before
    assert kv.ensure_capacity("a", 64) and not kv.ensure_capacity("a", 65)
    assert kv.num_free_blocks == 0


def test_kv_incremental_allocation() -> None:
    kv = KVCacheManager(num_blocks=100, block_size=BS)
    assert kv.allocate_prompt("a", hashes("a", 62), 1000, max_new_tokens=100) == 0
    assert kv.num_blocks_of("a") == 7  # ceil(100/16): only the first chunk
    assert kv.ensure_capacity("a", 1000) and kv.num_blocks_of("a") == 63


def test_kv_lru_eviction_order_and_events() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    ha, hb = hashes("a", 2), hashes("b", 2)
    for sid, h in (("a", ha), ("b", hb)):
        kv.allocate_prompt(sid, h, 33)  # 2 full blocks + 1 token = all 3 blocks
        kv.commit_full_blocks(sid, 33)
        kv.free(sid)
    events = kv.drain_events()
    assert [e.kind for e in events] == ["stored", "removed", "stored"]
    assert events[0].block_hashes == ha and events[0].parent_block_hash is None
    # b needed 3 blocks with only a's partial block uncached: a's two cached
    # blocks were evicted, leaf first since a was freed tail-first.
    assert events[1].block_hashes == [ha[1], ha[0]]
    assert kv.match_prefix(ha) == 0 and kv.match_prefix(hb) == 2


def test_kv_lru_touch_refreshes_recency() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    ha, hb = hashes("a", 2), hashes("b", 2)
    for sid, h in (("a", ha), ("b", hb)):
        kv.allocate_prompt(sid, h, 32)
        kv.commit_full_blocks(sid, 32)
        kv.free(sid)
    # Reuse a -> a becomes most recently used; b is now the LRU victim.
    assert kv.allocate_prompt("a2", ha, 33) == 32
    kv.free("a2")
    kv.drain_events()
    assert kv.allocate_prompt("c", [], 80) == 0  # 5 blocks: 2 uncached free + 3 evictions
    removed = [h for e in kv.drain_events() if e.kind == "removed" for h in e.block_hashes]
    assert removed[:2] == [hb[1], hb[0]]
    assert kv.match_prefix(hb) == 0


def test_kv_reset_prefix_cache() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    kv.allocate_prompt("a", hashes("a", 2), 40)
    kv.commit_full_blocks("a", 40)
    assert kv.reset_prefix_cache() is False
    kv.free("a")
    kv.drain_events()
    assert kv.reset_prefix_cache() is True
    assert [e.kind for e in kv.drain_events()] == ["all_cleared"]
    assert kv.num_cached_blocks == 0 and kv.num_free_blocks == 8
    assert kv.match_prefix(hashes("a", 2)) == 0


def test_kv_duplicate_hash_left_uncached() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    h = hashes("p", 2)
    kv.allocate_prompt("a", h, 40)
    kv.allocate_prompt("b", h, 40)  # concurrent: nothing cached yet
    assert kv.commit_full_blocks("a", 40) == 2
    assert kv.commit_full_blocks("b", 40) == 0
    kv.free("b")
    kv.free("a")
    assert kv.num_cached_blocks == 2 and kv.num_free_blocks == 10


# -- engine -----------------------------------------------------------------


def test_single_request_token_counts_exact() -> None:
    eng = make_engine()
    tr = run(eng, [req("a", 500, 20)])
    assert tr.tokens == {"a": 20}
    assert len(tr.steps) == 20  # 1 prefill step (emits token 1) + 19 decode steps
    assert eng.generation_tokens_total == 20 and eng.prompt_tokens_total == 500
    assert eng.num_finished == 1 and not eng.has_work() and eng.kv_usage == 0.0


def test_prefix_hit_shortens_prefill() -> None:
    eng = make_engine()
    shared = hashes("sys", 4000 // BS)
    a = SimRequest("a", 4000, shared, 5, 0.0)
    tr_a = run(eng, [a])
    b = SimRequest("b", 4000, shared, 5, 10.0)
    tr_b = run(eng, [b], now=10.0)
    assert tr_a.cached["a"] == 0
    assert tr_b.cached["b"] == (4000 - 1) // BS * BS
    ttft_a = tr_a.first_token_at["a"] - 0.0
    ttft_b = tr_b.first_token_at["b"] - 10.0
    assert ttft_b < 0.5 * ttft_a
    assert tr_b.steps[0].num_tokens == 4000 - tr_b.cached["b"]
    assert eng.prefix_hits_tokens == tr_b.cached["b"] and eng.prefix_queries_tokens == 8000


def test_prefix_shared_while_prefilling_in_chunks() -> None:
    # b arrives while a's chunks are being computed: a's committed blocks are hit.
    eng = make_engine(max_num_batched_tokens=1024)
    shared = hashes("sys", 3000 // BS)
    tr = run(eng, [SimRequest("a", 3000, shared, 3, 0.0), SimRequest("b", 3000, shared, 3, 1e-6)])
    assert tr.cached["a"] == 0 and tr.cached["b"] > 0


def test_chunked_prefill_respects_budget() -> None:
    eng = make_engine(max_num_batched_tokens=256)
    tr = run(eng, [req("a", 1000, 3)])
    assert [s.num_tokens for s in tr.steps] == [256, 256, 256, 232, 1, 1]
    first_step = next(i for i, s in enumerate(tr.steps) if s.events)
    assert first_step == 3  # first token only when the last chunk is done
    assert all(s.num_tokens <= 256 for s in tr.steps)


def test_decode_prioritised_over_new_prefill() -> None:
    eng = make_engine(max_num_batched_tokens=512)
    eng.add_request(req("a", 100, 50))
    eng.step(0.0)  # a prefilled, now decoding
    eng.add_request(req("b", 2000, 5))
    for k in range(4):
        res = eng.step(1.0 + k)
        ids = {e.request_id for e in res.events}
        assert "a" in ids, "running decode must be scheduled every step"
        assert res.num_tokens <= 512
        assert res.num_seqs == 2
    # b got the leftover budget: 4 steps * 511 tokens >= 2000 -> its first token came.
    assert eng.num_running == 2


def test_max_num_seqs_respected() -> None:
    eng = make_engine(max_num_seqs=3)
    for k in range(5):
        eng.add_request(req(f"r{k}", 50, 10))
    eng.step(0.0)
    assert eng.num_running == 3 and eng.num_waiting == 2
    tr = run(eng, [], now=1.0)
    assert eng.num_finished == 5 and len(tr.finished_at) == 5


def test_preemption_when_kv_runs_out_and_request_completes() -> None:
    # 24 blocks = 384 tokens; 4 requests of 64 + 120 tokens each need 12 blocks at the end.
    eng = make_engine(num_gpu_blocks_override=24)
    reqs = [req(f"r{k}", 64, 120) for k in range(4)]
    tr = run(eng, reqs)
    assert eng.num_preemptions > 0 and tr.preempted
    # Most recently admitted is preempted first.
    assert "r3" in tr.preempted and "r0" not in tr.preempted
    assert tr.tokens == {f"r{k}": 120 for k in range(4)}
    assert eng.generation_tokens_total == 480 and eng.prompt_tokens_total == 256
    assert eng.num_finished == 4 and eng.kv_usage == 0.0
    assert eng.kv.num_free_blocks == 24


def test_abort_frees_blocks() -> None:
    eng = make_engine(num_gpu_blocks_override=100, max_num_seqs=1)
    eng.add_request(req("a", 300, 50))
    eng.add_request(req("b", 300, 50))
    eng.step(0.0)
    assert eng.num_running == 1 and eng.num_waiting == 1 and eng.kv_usage > 0
    assert eng.abort("b") and eng.num_waiting == 0
    assert eng.abort("a") and eng.num_running == 0
    assert eng.kv_usage == 0.0 and eng.kv.num_free_blocks == 100
    assert not eng.abort("a") and not eng.has_work()
    # Aborted prompt blocks stay cached for the next request.
    assert eng.kv.match_prefix(hashes("a", 300 // BS)) == 300 // BS
    assert eng.step(5.0).duration == 0.0


def test_engine_kv_events_stored_and_removed() -> None:
    eng = make_engine(num_gpu_blocks_override=20)
    run(eng, [req("a", 160, 2)])  # 10 full prompt blocks
    ev = eng.drain_kv_events()
    assert [e.kind for e in ev] == ["stored"]
    assert ev[0].block_hashes == hashes("a", 10) and ev[0].block_size == BS
    run(eng, [req("b", 300, 2)], now=1.0)  # 19 blocks needed: evicts some of a's
    kinds = [e.kind for e in eng.drain_kv_events()]
    assert "removed" in kinds and "stored" in kinds
    assert eng.kv.match_prefix(hashes("a", 10)) < 10
    assert eng.drain_kv_events() == []
    assert eng.reset_prefix_cache()
    assert [e.kind for e in eng.drain_kv_events()] == ["all_cleared"]


def test_add_request_validation() -> None:
    eng = make_engine(num_gpu_blocks_override=10)
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request(req("big", 150, 20))
    eng.add_request(req("a", 10, 1))
    with pytest.raises(ValueError, match="duplicate"):
        eng.add_request(req("a", 10, 1))
    with pytest.raises(ValueError):
        eng.add_request(req("z", 10, 0))


def test_default_capacity_from_physics() -> None:
    eng = make_engine()
    assert eng.num_gpu_blocks == eng.timer.kv_capacity_tokens(0.9) // BS
    with pytest.raises(ValueError, match="does not fit"):
        make_engine(model=model("llama-3.1-70b"))
    assert make_engine(model=model("llama-3.1-70b"), tp=4).num_gpu_blocks > 10_000


def test_throughput_smoke_200_requests() -> None:
    rng = random.Random(7)
    eng = make_engine(gpu=gpu("h200"), max_num_batched_tokens=4096, num_gpu_blocks_override=4000)
    reqs = []
    t = 0.0
    for k in range(200):
        t += rng.expovariate(20.0)
        plen = rng.randint(200, 6000)
        sys_tag = rng.randrange(5)
        hs = hashes(("sys", sys_tag), min(plen // BS, 64)) + hashes(("u", k), plen // BS)[64:]
        reqs.append(SimRequest(f"r{k}", plen, hs, rng.randint(1, 300), t))
    tr = run(eng, reqs)
    assert eng.num_finished == 200 and len(tr.finished_at) == 200
    assert tr.tokens == {r.request_id: r.output_len for r in reqs}
    assert eng.generation_tokens_total == sum(r.output_len for r in reqs)
    assert eng.prefix_hits_tokens > 0 and eng.kv_usage == 0.0
    for r in reqs:
        assert r.arrival < tr.first_token_at[r.request_id] <= tr.finished_at[r.request_id]
