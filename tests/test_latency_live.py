"""bench/latency_live.py: what its process mode reads from a gateway of its own (the access log,
the decision log), and that a run through `tokenfleet up` gets a record of every request."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import latency_live as ll  # noqa: E402


def test_access_records_reads_the_gateway_json_access_lines_only() -> None:
    lines = [
        "2026-12-03 gateway http://127.0.0.1:1/v1",  # the CLI's own text lines
        json.dumps({"ts": "t", "level": "info", "logger": "tokenfleet.access", "request_id": "a",
                    "ttft_ms": 12.5, "tpot_ms": 4.0, "tokens_in": 300}),
        json.dumps({"logger": "tokenfleet.access", "request_id": "b", "ttft_ms": 30.0, "tokens_in": 10}),  # 1 token out
        json.dumps({"logger": "tokenfleet.access", "request_id": "c", "status": "503"}),  # no first token: left out
        json.dumps({"logger": "tokenfleet.audit", "request_id": "d", "ttft_ms": 1.0}),
        "{not json",
    ]
    seen = ll.access_records("\n".join(lines))
    assert set(seen) == {"a", "b"}
    assert seen["a"][0] == 0.0125 and math.isnan(seen["a"][1]) and seen["a"][2] == 0.004 and seen["a"][3] == 300
    assert math.isnan(seen["a"][4]) and math.isnan(seen["a"][5])  # the decision's time, the hold: from the decision log
    assert seen["b"][0] == 0.03 and math.isnan(seen["b"][2])


def test_decisions_seen_takes_the_chosen_instance_and_the_latest_decision() -> None:
    def decision(rid: str, chosen: str, tpots: dict[str, float], at: float = 1.0,
                 held: float | None = None) -> dict[str, object]:
        return {"request_id": rid, "instance": chosen, "time": at,
                "candidates": [{"name": n, "score": 0.0, "detail": {"tpot_s": t}} for n, t in tpots.items()],
                **({} if held is None else {"held_s": held})}

    into: dict[str, tuple[float, float, float]] = {}
    ll.decisions_seen([decision("a", "i1", {"i0": 0.01, "i1": 0.02}),
                       decision("b", "i1", {"i0": 0.03, "i1": 0.04}, held=0.25),
                       {"request_id": "c", "instance": None, "time": 1.0, "candidates": []}], into)
    ll.decisions_seen([decision("a", "i0", {"i0": 0.05, "i1": 0.06}, 2.0)], into)  # a's retry, in a later poll
    # (a log without `held_s`: a gateway before i19-arrive, whose header held no hold)
    assert into == {"a": (0.05, 2.0, 0.0), "b": (0.04, 1.0, 0.25)}


def test_process_fleet_turns_the_learned_model_off_for_prior_only() -> None:
    setup = ll.sim_setup()
    prior, learned = ll.process_fleet(setup, "prior"), ll.process_fleet(setup, "learned")
    assert ll.parse_fleet(prior).gateway.learned_latency is False
    assert ll.parse_fleet(learned).gateway.learned_latency is True
    assert ll.parse_fleet(prior).gateway.health_interval_s == ll.HEALTH_INTERVAL_S
    assert "gateway" not in setup.fleet  # the setup's own fleet is left as it was


def test_prompts_are_the_same_for_a_seed_and_fresh_per_request() -> None:
    setup = ll.sim_setup()
    a, b, c = ll.prompts(setup, 6, 0), ll.prompts(setup, 6, 0), ll.prompts(setup, 6, 1)
    assert a == b and a != c
    assert len({t[:200] for t, _ in a}) == 6


@pytest.mark.slow
def test_process_mode_has_the_gateway_record_of_every_request(tmp_path: Path) -> None:
    """`tokenfleet up` over the sim fleet in its own process: every answered request has the
    gateway's TTFT (access log) and predicted TPOT (decision log), and the gateway's TTFT lies
    inside the client's (its arrival is after the client's send, its first token before the
    client reads it), the decision between the client's send and its first token, the hold before it inside that."""
    setup = ll.sim_setup()
    work = ll.prompts(setup, 24, 0)
    sent, seen = asyncio.run(ll.run_process(setup, "prior", work, 20.0, tmp_path))
    rows = np.array(ll.joined(sent, seen))
    assert len(rows) == len(work)
    assert np.isfinite(rows[:, ll.G_TTFT]).all() and np.isfinite(rows[:, ll.P_TPOT]).all()
    assert (rows[:, ll.G_TTFT] > 0).all() and (rows[:, ll.G_TTFT] <= rows[:, ll.C_TTFT]).all()
    assert (rows[:, ll.PROMPT] > 0).all()
    assert (rows[:, ll.PRE] > 0).all() and (rows[:, ll.PRE] < rows[:, ll.C_TTFT]).all()
    # the header's hold (the decision log's `held_s`): the gateway's part of the client's send-to-decision
    # (two clocks: the gateway's loop clock, the wall clock; a millisecond of slack)
    assert (rows[:, ll.HELD] > 0).all() and (rows[:, ll.HELD] <= rows[:, ll.PRE] + 1e-3).all()


def test_the_probe_reads_vllm_gauges_and_histogram_sums_and_means_from_a_time_on() -> None:
    text = "\n".join([
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0',  # summed over label sets
        'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0',
        'vllm:request_queue_time_seconds_bucket{engine="0",le="0.3"} 7.0',  # buckets: not read
        'vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 0.5',
        'vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 10.0',
        'vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 2.0',
        'vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 10.0',
        'vllm:num_requests_running_total{engine="0"} 99.0',  # a longer name: not the gauge
    ])
    got = ll.engine_metrics(text)
    assert got == {"vllm:num_requests_running": 5.0, "vllm:num_requests_waiting": 1.0,
                   "vllm:request_queue_time_seconds_sum": 0.5, "vllm:request_queue_time_seconds_count": 10.0,
                   "vllm:request_prefill_time_seconds_sum": 2.0, "vllm:request_prefill_time_seconds_count": 10.0}
    probe = ll.Probe()
    later = {**got, "vllm:request_queue_time_seconds_sum": 0.9, "vllm:request_queue_time_seconds_count": 14.0,
             "vllm:request_prefill_time_seconds_sum": 4.0, "vllm:request_prefill_time_seconds_count": 14.0}
    probe.timeline = [(1.0, {}), (2.0, got), (3.0, later)]
    means = probe.engine_means(since_wall=1.5)  # from the first poll at or after it to the last
    assert means["vllm:request_queue_time_seconds"] == pytest.approx(0.1)
    assert means["vllm:request_prefill_time_seconds"] == pytest.approx(0.5)
    assert math.isnan(means["vllm:time_to_first_token_seconds"])  # none recorded
