"""The routing report's floors: the issue's (idle fleet, ideal shared cache) and the causal
reference beside it (only what earlier prompts carried, once their prefill ran, at engine-block
granularity), on hand-made two-turn sessions whose numbers can be worked out by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.bench_scripts import load_bench
from workloads.trace import TraceRequest, Workload

report = load_bench("routing_report")


def _two_turns(tmp_path: Path, gap_ms: float) -> str:
    # Turn 1: 700 tokens = block 1 (512) + 188 of block 2. Turn 2 re-sends them, plus the reply and
    # a new message filling block 2 and 300 tokens of block 3: the trace reuses id 2 for the full block.
    wl = Workload("t", [TraceRequest(0.0, 700, 50, (1, 2)), TraceRequest(gap_ms, 1324, 50, (1, 2, 3))])
    path = tmp_path / "t.jsonl"
    wl.to_jsonl(path)
    return str(path)


def test_issue_floor_counts_the_reused_partial_block_whole(tmp_path: Path) -> None:
    t = report.floor_times(_two_turns(tmp_path, 10_000.0))
    # Turn 2's ideal hit is both trace blocks, 1,024 tokens: 300 left to prefill.
    assert t[1] == report.prefill_s(np.array(300.0), np.array(1024.0))


def test_causal_floor_holds_only_the_prompt_tokens_already_prefilled(tmp_path: Path) -> None:
    path = _two_turns(tmp_path, 10_000.0)
    ttft, cached = report.causal_floor_times(path)
    # Turn 1 carried 700 tokens: 43 full engine blocks (688 tokens) are what turn 2 can reuse.
    assert cached.tolist() == [0.0, 688.0]
    assert ttft[1] == report.prefill_s(np.array(1324.0 - 688.0), np.array(688.0))
    assert ttft[1] > report.floor_times(path)[1]


def test_causal_floor_has_nothing_before_the_first_prefill_ran(tmp_path: Path) -> None:
    # Turn 2 arrives 1 ms after turn 1, before turn 1's prefill (tens of ms) could have run.
    path = _two_turns(tmp_path, 1.0)
    _, cached = report.causal_floor_times(path)
    assert cached.tolist() == [0.0, 0.0]
    # The rate scale moves arrivals: the 10 s gap scaled 10,000x is 1 ms again.
    _, cached = report.causal_floor_times(_two_turns(tmp_path, 10_000.0), rate_scale=10_000.0)
    assert cached.tolist() == [0.0, 0.0]
