"""`bench live` (fleetsim.live): the load generator against in-process simulated workers.

No peer router is needed here: the SGLang router is a benchmark dependency
(bench/peers.py), not a test one.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from engine_adapters.sim.worker import start_worker
from fleetcore.prefix import block_hashes
from fleetcore.sse import StreamReader
from fleetcore.tokens import count_tokens, encode
from fleetsim import live
from fleetsim.live import Target, TargetError, base_url, live_row, prepare_workload, replay, request_body
from fleetsim.metrics import RequestRecord
from fleetsim.report import GROUP_KEYS, RESULT_KEYS, build_report
from workloads import TraceRequest, Workload, prompt_text

MODEL = "bench-sim"
SCALE = 0.02  # 50x faster than the physical GPU: a tiny trace replays in well under a second
BT = 16  # trace block = engine block, so shared ids map to whole cacheable engine blocks


@pytest.fixture
async def worker() -> AsyncIterator[str]:
    runner, url = await start_worker(served_model_name=MODEL, time_scale=SCALE, instance_id="bench-w")
    try:
        yield url
    finally:
        await runner.cleanup()


def tiny_trace() -> Workload:
    """Three requests: the second re-sends the first's first three blocks (48 tokens) after it
    has finished; the third shares nothing."""
    rows = [TraceRequest(0.0, 64, 8, (1, 2, 3, 4), BT),
            TraceRequest(400.0, 64, 6, (1, 2, 3, 5), BT),
            TraceRequest(450.0, 40, 5, (7, 8, 9), BT)]
    return Workload("tiny", rows, BT)


# --- prompts --------------------------------------------------------------------------


def test_shared_hash_ids_give_identical_prompt_prefixes() -> None:
    a = prompt_text((10, 11, 12, 13), 4 * 512)
    b = prompt_text((10, 11, 12, 99), 4 * 512)
    c = prompt_text((10, 42, 12, 13), 4 * 512)
    ta, tb, tc = encode(a), encode(b), encode(c)
    assert len(ta) == len(tb) == count_tokens(a) == 4 * 512  # exactly input_length tokens
    assert ta[:3 * 512] == tb[:3 * 512] and ta[3 * 512:] != tb[3 * 512:]
    assert ta[:512] == tc[:512] and ta[512:1024] != tc[512:1024]
    # So the engines' chained block hashes agree exactly on the shared blocks, and only there.
    ha, hb = block_hashes(ta, 16), block_hashes(tb, 16)
    shared = sum(1 for x, y in zip(ha, hb) if x == y)
    assert shared == 3 * 512 // 16


def test_request_body_has_exact_output_and_trace_prompt() -> None:
    row = TraceRequest(0.0, 100, 7, (3, 4), 64)
    t = Target("http://127.0.0.1:1", "m")
    body = request_body(row, t)
    assert body["max_tokens"] == 7 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["prompt"] == prompt_text((3, 4), 100, 64) and count_tokens(body["prompt"]) == 100
    chat = request_body(row, Target("http://127.0.0.1:1", "m", endpoint="chat"))
    assert chat["messages"] == [{"role": "user", "content": body["prompt"]}]


def test_target_url_normalised_and_loopback_only() -> None:
    assert base_url("http://127.0.0.1:8080/v1/") == "http://127.0.0.1:8080"
    assert base_url("http://localhost:9") == "http://localhost:9"
    assert base_url("http://[::1]:9/v1") == "http://[::1]:9"
    with pytest.raises(TargetError, match="loopback"):
        base_url("http://10.0.0.7:8000/v1")
    assert base_url("http://10.0.0.7:8000/v1", allow_remote=True) == "http://10.0.0.7:8000"
    with pytest.raises(TargetError):
        base_url("ftp://127.0.0.1/")


def test_bench_counts_reasoning_and_tool_call_chunks_as_output() -> None:
    """The bench reads streams as the gateway does (fleetcore.sse): a reasoning model's first
    token is its first reasoning chunk, a tool call's chunks are output."""
    def ev(obj: Any) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    reader = StreamReader()
    reader.feed(ev({"choices": [{"delta": {"role": "assistant", "content": ""}}]}), 10.0)
    reader.feed(ev({"choices": [{"delta": {"reasoning_content": "hmm"}}]}), 10.5)
    reader.feed(ev({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}}]}), 11.0)
    reader.feed(ev({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]}) + ev(
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3,
                                  "prompt_tokens_details": {"cached_tokens": 4}}}) + b"data: [DONE]\n\n", 11.2)
    rec = RequestRecord(request_id="r", arrival_s=0.0, prompt_tokens=5, status="cancelled")
    live._fill(rec, reader.stats, 10.0, 11.3)
    assert rec.status == "completed" and rec.ttft_s == pytest.approx(0.5)
    assert (rec.prompt_tokens, rec.output_tokens, rec.cached_tokens) == (7, 3, 4)
    assert rec.tpot_s == pytest.approx(0.25)  # (11.0 - 10.5) / (3 - 1)


def test_window_applies_after_rate_scaling(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [{"timestamp": 1000 * i, "input_length": 16, "output_length": 2, "hash_ids": [i]} for i in range(10)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    wl = prepare_workload(path, rate_scale=2.0, window_s=2.0)  # arrivals at 0, .5, 1, 1.5 s
    assert [r.timestamp_ms for r in wl.requests] == [0.0, 500.0, 1000.0, 1500.0]
    assert len(prepare_workload(path, max_requests=3)) == 3


# --- against a worker -----------------------------------------------------------------


async def test_replay_measures_ttft_and_cached_tokens(worker: str) -> None:
    target = Target(worker, MODEL)
    wl = tiny_trace()
    run = await replay(wl, target, concurrency=4, timeout_s=10)
    recs = run.records
    assert [r.status for r in recs] == ["completed"] * 3, [r.reason for r in recs]
    assert [r.output_tokens for r in recs] == [8, 6, 5]  # ignore_eos + max_tokens: exact lengths
    assert [r.prompt_tokens for r in recs] == [64, 64, 40]
    assert all(r.ttft_s is not None and 0 < r.ttft_s <= r.e2e_s for r in recs)
    assert all(r.tpot_s is not None and r.tpot_s > 0 for r in recs)
    # The second request re-sends the first one's three leading blocks: the engine reuses them.
    assert recs[0].cached_tokens == 0
    assert recs[1].cached_tokens == 3 * BT
    assert recs[2].cached_tokens == 0
    assert recs[1].arrival_s == pytest.approx(0.4)

    row = live_row("live", run, target)
    assert tuple(k for k in row if k in RESULT_KEYS) == RESULT_KEYS  # simulate's keys, in its order
    assert set(GROUP_KEYS) <= set(row["by_class"]["interactive"])
    assert row["completed"] == 3 and row["ttft_ms"]["p50"] > 0
    assert row["cache_hit_rate"] == pytest.approx(48 / 168)
    assert row["live"]["errors"] == 0 and row["live"]["target"] == worker
    report = build_report(wl.describe(), {"target": worker}, [row])
    assert json.loads(json.dumps(report))["results"][0]["policy"] == "live"


async def test_errors_are_counted_not_raised(worker: str) -> None:
    run = await replay(tiny_trace(), Target(worker, "no-such-model"), timeout_s=10)
    assert [r.status for r in run.records] == ["rejected"] * 3
    assert "404" in (run.records[0].reason or "")
    assert live_row("x", run, Target(worker, "no-such-model"))["live"]["errors"] == 3


async def test_concurrency_bound_holds_requests_back(worker: str) -> None:
    rows = [TraceRequest(0.0, 32, 20, (100 + i, 200 + i), BT) for i in range(4)]
    run = await replay(Workload("burst", rows, BT), Target(worker, MODEL), concurrency=1, timeout_s=10)
    assert all(r.status == "completed" for r in run.records)
    assert run.slot_waits == 3
    assert all(r.queue_s is not None and r.queue_s > 0 for r in run.records[1:])


async def test_cli_writes_simulate_shaped_json(worker: str, tmp_path: Path) -> None:
    trace = tmp_path / "tiny.jsonl"
    tiny_trace().to_jsonl(trace)
    out = tmp_path / "live.json"
    argv = ["--trace", str(trace), "--target", worker + "/v1", "--json", str(out), "--no-progress",
            "--concurrency", "8", "--window", "10"]
    # The CLI runs its own event loop; the worker keeps serving on this one.
    rc = await asyncio.to_thread(live.main, argv)
    assert rc == 0
    report = json.loads(out.read_text())
    assert set(report) == {"workload", "fleet", "results"}
    assert report["fleet"]["model"] == MODEL  # discovered from GET /v1/models
    (row,) = report["results"]
    assert row["completed"] == 3 and 0 < row["ttft_ms"]["p50"] <= row["ttft_ms"]["p99"]
    assert row["cache_hit_rate"] > 0


def test_cli_refuses_remote_target_and_bad_args(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "tiny.jsonl"
    tiny_trace().to_jsonl(trace)
    assert live.main(["--trace", str(trace), "--target", "http://192.0.2.1:8000/v1"]) == 2
    assert "loopback" in capsys.readouterr().err
    assert live.main(["--trace", str(trace), "--target", "http://127.0.0.1:9", "--rate-scale", "0"]) == 2
    assert live.main(["--trace", str(tmp_path / "missing"), "--target", "http://127.0.0.1:9"]) == 2


def test_add_bench_parser_wires_live() -> None:
    import argparse

    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command", required=True)
    live.add_bench_parser(sub)
    args = p.parse_args(["bench", "live", "--trace", "t", "--target", "http://127.0.0.1:1", "--window", "5"])
    assert args.func is live.run_bench and args.bench_command == "live" and args.window == 5.0


def test_time_scale_stretches_arrivals_and_reports_physical_times(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [{"timestamp": 1000 * i, "input_length": 16, "output_length": 2, "hash_ids": [i]} for i in range(4)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    wl = prepare_workload(path, window_s=2.5, time_scale=2.0)  # physical 0, 1, 2 s -> wall 0, 2, 4 s
    assert [r.timestamp_ms for r in wl.requests] == [0.0, 2000.0, 4000.0]
    rec = live.RequestRecord("r", arrival_s=4.0, prompt_tokens=16, status="completed", output_tokens=2,
                             ttft_s=0.5, tpot_s=0.04, e2e_s=0.54, queue_s=0.0, end_s=4.54)
    (phys,) = live.to_physical([rec], 2.0)
    assert (phys.arrival_s, phys.ttft_s, phys.tpot_s, phys.e2e_s, phys.end_s) == (2.0, 0.25, 0.02, 0.27, 2.27)
    assert rec.ttft_s == 0.5  # the wall-clock record is left alone


# --- bench/peers.py: the parts that need no peer router --------------------------------


def _peers_module() -> object:
    import importlib.util

    if "bench_peers" in sys.modules:
        return sys.modules["bench_peers"]
    spec = importlib.util.spec_from_file_location("bench_peers", Path(__file__).parents[1] / "bench" / "peers.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_peers"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_peers_fleet_files_and_fidelity_simulation() -> None:
    from fleetcore.fleet_config import parse_fleet

    peers: Any = _peers_module()
    shape = peers.FleetShape(workers=2)
    static = parse_fleet(peers.gateway_fleet(shape, ["http://127.0.0.1:1", "http://127.0.0.1:2"]))
    assert [d.adapter for d in static.deployments] == ["static"] and static.deployments[0].instance_count == 2
    wl = peers.fixed_rate_workload(rate=50.0, n=20)
    assert len(wl) == 20 and wl.requests[1].timestamp_ms == pytest.approx(20.0)
    assert not set(wl.requests[0].hash_ids) & set(wl.requests[1].hash_ids)  # no shared prefix
    sims = peers.simulate_rows(shape, wl, ["tokenpilot", "sglang_cache_aware"])
    assert sims["tokenpilot"]["completed"] == 20 and sims["tokenpilot"]["ttft_ms"]["p50"] > 0


def test_peers_sustained_rate_and_cpu_ratios() -> None:
    peers: Any = _peers_module()

    def table(rate: float, mode: str, paths: dict[str, tuple[int, float | None, float]]) -> dict[str, Any]:
        return {"rate_rps": rate, "connections": mode,
                "paths": {name: {"completed": done, "requests": 10, "cpu_ms_per_req": cpu,
                                 "added_ms": {"ttft_p99": p99}} for name, (done, p99, cpu) in paths.items()}}

    tables = [table(200, "keepalive", {"direct": (10, 0.0, 1.0), "tokenfleet/x": (10, 12.0, 1.5),
                                       "sglang-router/c": (10, 3.0, 0.5), "litellm-proxy": (9, 10.0, 40.0)}),
              table(500, "keepalive", {"direct": (10, 0.0, 1.0), "tokenfleet/x": (10, 80.0, 1.4),
                                       "sglang-router/c": (10, 4.0, 0.5)}),
              table(1000, "keepalive", {"direct": (10, 0.0, 1.0), "tokenfleet/x": (10, 49.0, 1.3),
                                        "sglang-router/c": (10, None, 0.5)})]
    got = peers.sustained(tables)["keepalive"]
    # highest passing rate, even above a failing one; errors or no figure never pass; direct is no path
    assert got == {"tokenfleet/x": 1000, "sglang-router/c": 500, "litellm-proxy": None}
    ratios = peers.cpu_ratios(tables[0], "sglang-router")
    assert ratios["tokenfleet/x"] == pytest.approx(3.0) and ratios["sglang-router/c"] == pytest.approx(1.0)
    assert peers.cpu_ratios(tables[0], "nobody")["tokenfleet/x"] is None
