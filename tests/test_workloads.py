"""Workloads: trace loaders on the real files, generators, mixing, replay prompt text."""

from __future__ import annotations

import gzip
import time
from collections import Counter
from pathlib import Path

import pytest

from fleetcore.slo import BATCH, INTERACTIVE, LONG_CONTEXT
from fleetcore.tokens import count_tokens
from tests.paths import TRACES
from workloads import (
    TraceRequest,
    Workload,
    agent_loops,
    assign,
    chat_sessions,
    chunk_text,
    detect_format,
    document_analysis,
    head,
    load_trace,
    merge,
    offline_batch,
    prompt_text,
    scale_rate,
    window,
)



@pytest.fixture(scope="module")
def conversation() -> Workload:
    return load_trace(TRACES / "conversation_trace.jsonl.gz")


# ---------------------------------------------------------------- loaders


def test_conversation_trace_loads_fast_and_matches_sources(conversation: Workload) -> None:
    t = time.perf_counter()
    w = load_trace(TRACES / "conversation_trace.jsonl.gz", fmt="mooncake")
    assert time.perf_counter() - t < 2.0
    assert len(w) == len(conversation) == 12_031
    d = conversation.describe()
    assert d["prefix_repeat_frac"] == pytest.approx(0.3664, abs=5e-4)
    assert d["repeat_frac"] == pytest.approx(0.3664, abs=5e-4)
    assert d["token_prefix_hit"] == pytest.approx(0.3736, abs=5e-4)
    assert d["duration_s"] == pytest.approx(3537.0, abs=0.01)
    assert d["mean_rate_rps"] == pytest.approx(3.40, abs=0.01)
    assert d["input_median"] == 6909 and d["output_median"] == 350
    assert conversation.requests[0].hash_ids[0] == 0 and conversation.requests[0].block_tokens == 512


@pytest.mark.parametrize("name,rows,span_s", [
    ("synthetic_trace.jsonl", 3_993, 1022.025),
    ("AzureLLMInferenceTrace_code.csv", 8_819, 3435.95),
    ("AzureLLMInferenceTrace_conv.csv", 19_366, 3501.72),
])
def test_other_traces_row_counts_and_spans(name: str, rows: int, span_s: float) -> None:
    w = load_trace(TRACES / name)
    assert len(w) == rows
    assert w.duration_s == pytest.approx(span_s, abs=0.01)
    assert w.requests[0].timestamp_ms == 0.0


def test_azure_has_no_shared_prefix_and_exact_ms() -> None:
    w = load_trace(TRACES / "AzureLLMInferenceTrace_code.csv")
    assert detect_format(TRACES / "AzureLLMInferenceTrace_code.csv") == "azure"
    # 18:17:03.9799600 → 18:17:04.0319600 is 52 ms, exactly.
    assert w.requests[1].timestamp_ms == pytest.approx(52.0, abs=1e-9)
    r = w.requests[0]
    assert (r.input_length, r.output_length, len(r.hash_ids)) == (4808, 10, 10)
    d = w.describe()
    assert d["repeat_frac"] == 0.0 and d["unique_blocks"] == d["block_refs"]


def test_malformed_line_names_file_and_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n'
                 '\n'
                 '{"timestamp": 5, "input_length": "ten", "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: input_length"):
        load_trace(p)
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2:"):
        load_trace(p)
    c = tmp_path / "bad.csv"
    c.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,12,3\n"
                 "2023-11-16 18:17:04.0,x,3\n")
    with pytest.raises(ValueError, match=r"bad\.csv:3:"):
        load_trace(c)
    with pytest.raises(ValueError, match="unknown trace format"):
        load_trace(c, fmt="parquet")


def test_jsonl_round_trip_with_optional_keys_and_header(tmp_path: Path) -> None:
    reqs = [
        TraceRequest(0.0, 700, 5, (1, 2), 512, tenant="a", request_class=INTERACTIVE,
                     region="eu", model="m", session="s1"),
        TraceRequest(12.5, 20, 3, (3, 4), 16, request_class=BATCH, deadline_s=600.0),
    ]
    w = Workload("rt", reqs, 512, {"note": "x"})
    for name, header in (("rt.jsonl", True), ("rt.jsonl.gz", False)):
        p = tmp_path / name
        w.to_jsonl(p, header=header)
        back = Workload.from_jsonl(p)
        assert back.requests == w.requests
        assert load_trace(p).requests == w.requests
    assert Workload.from_jsonl(tmp_path / "rt.jsonl").metadata["note"] == "x"
    with gzip.open(tmp_path / "rt.jsonl.gz", "rt") as f:
        first = f.readline()
    assert first.startswith('{"timestamp": 0, ') and '"class": "interactive"' in first
    # A header line sets the file's default block size.
    p = tmp_path / "hdr.jsonl"
    p.write_text('{"block_tokens": 16}\n{"timestamp": 1, "input_length": 20, "output_length": 1, '
                 '"hash_ids": [7, 8]}\n')
    assert load_trace(p).requests[0].block_tokens == 16


# ---------------------------------------------------------------- generators


def test_generators_are_deterministic_per_seed() -> None:
    for gen in (chat_sessions, agent_loops, document_analysis, offline_batch):
        a, b, c = gen(seed=1), gen(seed=1), gen(seed=2)
        assert a.requests == b.requests, gen.__name__
        assert a.requests != c.requests, gen.__name__
        assert len(a) > 0


def test_chat_turns_grow_their_prefix() -> None:
    w = chat_sessions(sessions=30, seed=3)
    by_session: dict[str, list[TraceRequest]] = {}
    for r in w:
        by_session.setdefault(r.session or "", []).append(r)
    multi = 0
    for turns in by_session.values():
        for prev, cur in zip(turns, turns[1:]):
            multi += 1
            assert cur.hash_ids[:len(prev.hash_ids)] == prev.hash_ids
            assert cur.input_length > prev.input_length + prev.output_length - 1
            assert cur.timestamp_ms > prev.timestamp_ms
        for r in turns:
            assert len(r.hash_ids) == -(-r.input_length // r.block_tokens)
    assert multi > 10
    # The app's system prompt (1024 tokens = 2 blocks) is shared by every session.
    firsts = {r.hash_ids[:2] for r in w}
    assert len(firsts) == 1


def test_agents_share_the_tool_prefix_and_grow_history() -> None:
    w = agent_loops(agents=10, seed=4, shared_prefix_tokens=4096)
    prefix = w.requests[0].hash_ids[:8]
    assert all(r.hash_ids[:8] == prefix for r in w)
    assert len({r.session for r in w}) == 10
    assert w.describe()["prefix_repeat_frac"] > 0.5
    two = agent_loops(agents=20, seed=4, prefixes=2, shared_prefix_tokens=4096)
    assert len({r.hash_ids[:8] for r in two}) == 2


def test_docs_and_batch_classes_and_sharing() -> None:
    d = document_analysis(documents=5, seed=5)
    assert all(r.request_class == LONG_CONTEXT and r.input_length >= 8192 for r in d)
    per_doc = Counter(r.hash_ids[0] for r in d)
    assert max(per_doc.values()) > 1 and len(per_doc) == 5
    b = offline_batch(bursts=2, burst_size=50, seed=6)
    assert len(b) == 100
    assert all(r.request_class == BATCH and r.deadline_s == 600.0 for r in b)


def test_generated_ids_never_collide() -> None:
    seen: set[int] = set()
    conv_max = 182_789  # the conversation trace's largest id
    for gen in (chat_sessions, agent_loops, document_analysis, offline_batch):
        for seed in (0, 1):
            ids = {h for r in gen(seed=seed) for h in r.hash_ids}
            assert min(ids) > conv_max
            assert not ids & seen, (gen.__name__, seed)
            seen |= ids


# ---------------------------------------------------------------- mix


def test_merge_is_time_ordered_union() -> None:
    a, b = chat_sessions(sessions=5, seed=1), offline_batch(bursts=1, burst_size=20, seed=1)
    m = merge(a, b)
    assert len(m) == len(a) + len(b)
    ts = [r.timestamp_ms for r in m]
    assert ts == sorted(ts)


def test_scale_rate_halves_the_span() -> None:
    w = chat_sessions(sessions=20, seed=7)
    fast = scale_rate(w, 2.0)
    assert fast.duration_s == pytest.approx(w.duration_s / 2)
    assert fast.mean_rate == pytest.approx(w.mean_rate * 2)
    with pytest.raises(ValueError):
        scale_rate(w, 0)


def test_window_boundaries_and_head() -> None:
    reqs = [TraceRequest(float(t), 10, 1, (t,)) for t in (0, 999, 1000, 1500, 2999, 3000, 4000)]
    w = Workload("w", reqs)
    win = window(w, 1.0, 2.0)
    assert [r.timestamp_ms for r in win] == [0.0, 500.0, 1999.0]  # [1000, 3000) rebased
    assert [r.hash_ids[0] for r in window(w, 1.0, 2.0, rebase=False)] == [1000, 1500, 2999]
    assert [r.hash_ids[0] for r in head(w, 2)] == [0, 999]


def test_assign_fractions_follow_weights_and_keep_sessions_together() -> None:
    w = chat_sessions(sessions=400, seed=8)
    a = assign(w, tenants={"gold": 3, "free": 1}, regions={"eu": 1, "us": 1}, seed=1)
    sessions = {r.session: r.tenant for r in a}
    frac_gold = sum(t == "gold" for t in sessions.values()) / len(sessions)
    assert frac_gold == pytest.approx(0.75, abs=0.07)
    for r in a:
        assert sessions[r.session] == r.tenant  # one tenant per session
        assert r.request_class == (LONG_CONTEXT if r.input_length >= 8192 else INTERACTIVE)
    reqs = [TraceRequest(float(i), 100, 1, (i,)) for i in range(4000)]
    c = assign(Workload("x", reqs), classes={INTERACTIVE: 1, BATCH: 1}, seed=2)
    assert Counter(r.request_class for r in c)[BATCH] / 4000 == pytest.approx(0.5, abs=0.04)
    # Set fields are kept.
    kept = assign(offline_batch(bursts=1, burst_size=10), classes={INTERACTIVE: 1})
    assert all(r.request_class == BATCH for r in kept)


# ---------------------------------------------------------------- prompts


def test_prompt_text_token_count_and_shared_prefix_bytes() -> None:
    assert count_tokens(chunk_text(42, 512)) == 512
    a = prompt_text((1, 2, 3), 1300, 512)
    b = prompt_text((1, 2, 9, 10), 1900, 512)
    assert count_tokens(a) == 1300 and count_tokens(b) == 1900
    shared = len(chunk_text(1)) + len(chunk_text(2))
    assert a[:shared] == b[:shared] and a[shared:shared + 50] != b[shared:shared + 50]
    assert prompt_text((1, 2, 3), 1300, 512) == a  # deterministic
    assert prompt_text((1, 2, 3), 1300, 512, seed=1) != a
    # A truncated last block is a byte prefix of the same id's full block (growing chat).
    assert prompt_text((1, 2, 3), 1536, 512).startswith(a)
    # Ids covering too little: filler makes up the count.
    assert count_tokens(prompt_text((5,), 2000, 512)) == 2000


def test_prompt_text_for_trace_requests(conversation: Workload) -> None:
    t = time.perf_counter()
    for r in conversation.requests[:200]:
        assert count_tokens(prompt_text(r.hash_ids, r.input_length, r.block_tokens)) == r.input_length
    assert time.perf_counter() - t < 5.0
    # Every conversation request starts with block 0: the same leading text.
    p0 = prompt_text(conversation.requests[0].hash_ids, 600)
    p1 = prompt_text(conversation.requests[1].hash_ids, 600)
    n0 = len(chunk_text(0))
    assert p0[:n0] == p1[:n0] and p0 != p1
