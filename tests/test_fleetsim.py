"""The fleet simulator end to end: CLI on the real trace, RTT, prefix hits, determinism, timing."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from engine_adapters.sim.engine import SimEngine, SimRequest
from fleetcore.fleet_config import FleetConfig, parse_fleet
from fleetcore.policies import Admission
from fleetcore.types import FleetView, RequestProfile
from fleetsim.cli import DEFAULT_SIM_FLEET, main, make_policy
from fleetsim.simulator import AdmissionDecision, FleetSimulator, HashCache, fleet_instances, prepare
from tokenpilot.baselines import RoundRobin
from workloads import TraceRequest

from tests.paths import TRACES

TRACE = TRACES / "conversation_trace.jsonl.gz"


def small_fleet(instances: int = 1, rtt: dict[str, float] | None = None, model: str = "llama-3.1-8b",
                gpu: str = "H100", tp: int = 1) -> FleetConfig:
    return parse_fleet({
        "regions": ["us-east", "eu-west"],
        "default_region": "us-east",
        "sites": [{"name": "s1", "region": "us-east", "jurisdiction": "us",
                   "rtt_ms": rtt or {"us-east": 2, "eu-west": 150}}],
        "models": [{"name": model, "engine": {"spec": model, "max_model_len": 32768}}],
        "deployments": [{"site": "s1", "model": model, "instances": instances, "gpu": gpu, "tp": tp}],
    })


def req(t_ms: float, n_in: int, n_out: int, ids: Sequence[int] = (), **kw) -> TraceRequest:
    return TraceRequest(t_ms, n_in, n_out, tuple(ids), **kw)


def run(fleet: FleetConfig, reqs: list[TraceRequest], router=None, **kw):
    sim = FleetSimulator(fleet, router or RoundRobin(), **kw)
    return sim, sim.run(prepare(reqs, fleet))


# --- the command line on the real trace -------------------------------------------------


@pytest.mark.slow
def test_cli_runs_200_requests_of_the_real_trace_and_writes_the_documented_json(tmp_path, capsys) -> None:
    out = tmp_path / "sim.json"
    rc = main(["simulate", "--trace", str(TRACE), "--trace-format", "mooncake", "--max-requests", "200",
               "--policy", "round_robin,least_loaded", "--seed", "3", "--json", str(out), "--no-progress"])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "wall" in stdout and "round_robin" in stdout and "good/1st" in stdout
    rep = json.loads(out.read_text())
    assert set(rep) == {"workload", "fleet", "results"}
    assert rep["workload"]["requests"] == 200 and rep["workload"]["rate_scale"] == 1.0
    assert rep["fleet"]["instances"] == 32 and rep["fleet"]["file"] == str(DEFAULT_SIM_FLEET)
    assert rep["fleet"]["capacity"]["no_cache"]["saturating_rate_scale"] > 1.0
    assert [r["policy"] for r in rep["results"]] == ["round_robin", "least_loaded"]
    for r in rep["results"]:
        for key in ("policy", "requests", "completed", "rejected", "cancelled", "ttft_ms", "tpot_ms", "e2e_ms",
                    "queue_ms", "throughput_tok_s", "goodput_tok_s", "slo_attainment", "cache_hit_rate",
                    "wall_s", "by_class", "by_tenant"):
            assert key in r, key
        assert set(r["ttft_ms"]) == {"p50", "p90", "p95", "p99", "mean"}
        assert set(r["tpot_ms"]) == {"p50", "p95"}
        assert r["requests"] == 200 and r["completed"] + r["rejected"] + r["cancelled"] == 200
        assert r["completed"] == 200  # the fleet fits every prompt of the trace
        assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"]
        assert 0 < r["goodput_tok_s"] <= r["throughput_tok_s"]
        assert r["cache_hit_rate"] > 0.0  # block 0 is shared
        assert set(r["by_class"]) <= {"interactive", "long_context"}
        assert sum(c["requests"] for c in r["by_class"].values()) == 200
        # slo_attainment = met / arrived: a whole count of requests, the sum of the classes' counts,
        # and every completed request met its SLO exactly when goodput equals throughput
        met = r["slo_attainment"] * r["requests"]
        assert met == pytest.approx(round(met), abs=1e-6)
        assert round(met) == round(sum(c["slo_attainment"] * c["requests"] for c in r["by_class"].values()))
        assert 0 < round(met) <= r["completed"]  # goodput > 0: some request met its SLO
        assert (round(met) == r["completed"]) == (r["goodput_tok_s"] == pytest.approx(r["throughput_tok_s"]))
        inter = r["by_class"]["interactive"]
        assert inter["requests"] > 0 and 0 < inter["ttft_ms"]["p50"] <= inter["ttft_ms"]["p99"]


def test_cli_unknown_policy_lists_the_known_ones(capsys) -> None:
    rc = main(["--trace", str(TRACE), "--policy", "round_robin,nope"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "'nope'" in err and "round_robin" in err and "least_loaded" in err


def test_cli_missing_trace_is_a_clear_error(tmp_path, capsys) -> None:
    assert main(["--trace", str(tmp_path / "none.jsonl")]) == 2
    assert "trace file not found" in capsys.readouterr().err


# --- timing physics ---------------------------------------------------------------------


def test_lone_request_ttft_is_prefill_step_plus_rtt() -> None:
    fleet = small_fleet(rtt={"us-east": 40, "eu-west": 150})
    sim, res = run(fleet, [req(1000, 3000, 5, range(6))])
    r = res.records[0]
    engine = SimEngine(fleet_instances(fleet)[0].engine)
    engine.add_request(SimRequest("x", 3000, [], 5, 0.0))
    prefill = engine.step(0.0).duration
    decode = engine.step(prefill).duration
    assert r.status == "completed" and r.output_tokens == 5
    assert r.ttft_s == pytest.approx(prefill + 0.040, abs=1e-9)
    assert r.tpot_s == pytest.approx(decode, rel=0.01)  # later decode steps differ by one token of KV
    assert r.queue_s == pytest.approx(0.0, abs=1e-12)
    assert r.e2e_s == pytest.approx(r.ttft_s + 4 * r.tpot_s, abs=1e-9)
    assert r.end_s == pytest.approx(1.0 + r.e2e_s)


def test_rtt_shows_up_in_ttft() -> None:
    fleet = small_fleet(rtt={"us-east": 2, "eu-west": 150})
    _, near = run(fleet, [req(0, 2000, 3, region="us-east")])
    _, far = run(fleet, [req(0, 2000, 3, region="eu-west")])
    assert far.records[0].site == near.records[0].site == "s1"
    assert far.records[0].ttft_s - near.records[0].ttft_s == pytest.approx(0.148, abs=1e-9)
    assert far.records[0].e2e_s - near.records[0].e2e_s == pytest.approx(0.148, abs=1e-9)


def test_far_site_is_slower_by_its_rtt() -> None:
    """Two sites; the client's home site does not serve the model, so it goes abroad."""
    def fleet(home_serves: bool) -> FleetConfig:
        return parse_fleet({
            "regions": ["us-east", "eu-west"],
            "sites": [{"name": "home", "region": "us-east", "jurisdiction": "us",
                       "rtt_ms": {"us-east": 1, "eu-west": 80}},
                      {"name": "far", "region": "eu-west", "jurisdiction": "eu",
                       "rtt_ms": {"us-east": 81, "eu-west": 1}}],
            "models": [{"name": "m", "engine": {"spec": "llama-3.1-8b"}}],
            "deployments": [{"site": "home" if home_serves else "far", "model": "m", "instances": 1, "gpu": "H100"}],
        })
    _, home = run(fleet(True), [req(0, 1500, 2)])
    _, away = run(fleet(False), [req(0, 1500, 2)])
    assert home.records[0].site == "home" and away.records[0].site == "far"
    assert away.records[0].ttft_s - home.records[0].ttft_s == pytest.approx(0.080, abs=1e-9)


# --- caching and policies -----------------------------------------------------------------


def test_shared_prefix_hits_the_cache_under_a_prefix_affine_router() -> None:
    from tokenpilot import peers
    fleet = small_fleet(instances=4)
    # Two 1,500-token prompts sharing their first two 512-token trace blocks (1,024 tokens).
    reqs = [req(0, 1500, 4, [7, 8, 100]), req(5000, 1500, 4, [7, 8, 200])]
    _, affine = run(fleet, reqs, peers.PEER_ROUTERS["prefix_hash"](seed=0))
    a, b = affine.records
    assert a.instance == b.instance and a.cached_tokens == 0 and b.cached_tokens == 1024
    assert b.ttft_s < a.ttft_s  # less to prefill
    _, rr = run(fleet, reqs, RoundRobin())
    assert rr.records[0].instance != rr.records[1].instance and rr.records[1].cached_tokens == 0


def test_block_hashes_follow_the_trace_ids_and_stop_at_full_engine_blocks() -> None:
    fleet = small_fleet()
    cache = HashCache()
    a, b, c = prepare([req(0, 1500, 1, [7, 8, 100]), req(0, 1040, 1, [7, 8, 9]), req(0, 10, 1, [5])], fleet,
                      hash_cache=cache)
    assert len(a.block_hashes) == 1500 // 16 and len(b.block_hashes) == 1040 // 16
    assert c.block_hashes == ()  # no full engine block
    assert a.block_hashes[:64] == b.block_hashes[:64] and a.block_hashes[64] != b.block_hashes[64]
    assert a.model == "llama-3.1-8b" and a.region == "us-east" and a.request_class == "interactive"


def test_same_seed_gives_identical_results() -> None:
    fleet = small_fleet(instances=4)
    reqs = [req(i * 150.0, 800 + 97 * (i % 13), 5 + i % 7, [i % 3, 1000 + i]) for i in range(120)]
    inputs = prepare(reqs, fleet)
    runs = []
    for seed in (11, 11):
        sim = FleetSimulator(fleet, make_policy("power_of_two", seed, fleet))
        runs.append(sim.run(inputs).records)
    assert runs[0] == runs[1]
    assert len({r.instance for r in runs[0]}) > 1


def test_client_timeout_cancels_and_releases_the_request() -> None:
    fleet = small_fleet(rtt={"us-east": 10, "eu-west": 150})
    reqs = [req(0, 2000, 2000, [1, 2, 3, 4])]
    sim = FleetSimulator(fleet, RoundRobin())
    res = sim.run(prepare(reqs, fleet, timeout_s=1.0))
    r = res.records[0]
    assert r.status == "cancelled" and r.end_s == pytest.approx(1.0)
    assert 0 < r.output_tokens < 2000 and r.ttft_s is not None and r.e2e_s is None
    inst = sim._insts[0]
    assert inst.inflight == 0 and not inst.engine.has_work()
    assert res.sim_end_s < 2.0  # the abort stopped the engine; it did not generate 2,000 tokens


def test_too_long_prompt_is_rejected_not_crashed() -> None:
    fleet = small_fleet()
    _, res = run(fleet, [req(0, 40_000, 10), req(0, 100, 10)])
    assert res.records[0].status == "rejected" and "context_length" in (res.records[0].reason or "")
    assert res.records[1].status == "completed"


class _OneAtATime(Admission):
    """Admission stand-in (the simulator's FIFO mode): queue while anything is in flight, reject tenant 'bad'."""

    def admit(self, profile: RequestProfile, view: FleetView, now: float) -> AdmissionDecision:
        if profile.tenant == "bad":
            return AdmissionDecision("reject", "tenant over budget")
        busy = sum(i.inflight for s in view.sites for i in s.instances)
        return AdmissionDecision("queue" if busy else "admit")


def test_admission_hook_can_queue_and_reject() -> None:
    fleet = small_fleet(instances=2)
    reqs = [req(0, 1000, 20), req(10, 1000, 20), req(20, 1000, 20, tenant="bad")]
    _, res = run(fleet, reqs, admission=_OneAtATime())
    a, b, c = res.records
    assert a.status == b.status == "completed" and c.status == "rejected" and c.reason == "tenant over budget"
    # b waited at the gateway until a had ended there.
    assert b.queue_s == pytest.approx(a.arrival_s + a.e2e_s - b.arrival_s, abs=1e-9)
    assert b.ttft_s > a.e2e_s - 0.01


def test_simulate_subcommand_plugs_into_a_parent_parser() -> None:
    import argparse

    from fleetsim.cli import add_simulate_parser, run_simulate

    parser = argparse.ArgumentParser(prog="tokenfleet")
    add_simulate_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["simulate", "--trace", "t.jsonl", "--policy", "random", "--rate-scale", "2.5",
                              "--max-requests", "10", "--seed", "7", "--json", "o.json", "--plot", "o.png"])
    assert args.func is run_simulate
    assert (args.trace, args.policy, args.rate_scale, args.max_requests, args.seed) == ("t.jsonl", "random", 2.5, 10, 7)
    assert args.trace_format == "auto" and args.fleet is None and args.timeout is None


class _Recorder(RoundRobin):
    """Round robin that remembers what each decision saw, and every outcome."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[float, int, int, int]] = []
        self.outcomes: list = []

    def route(self, profile, candidates, now):
        c = candidates[0]
        self.seen.append((now, c.inflight, c.num_running, c.num_waiting))
        return super().route(profile, candidates, now)

    def observe(self, outcome) -> None:
        self.outcomes.append(outcome)


def test_snapshots_show_gateway_inflight_and_true_engine_state_and_outcomes_feed_back() -> None:
    fleet = small_fleet(rtt={"us-east": 20, "eu-west": 150})
    router = _Recorder()
    # Two at t=0 (the second sees the first on the wire: in flight, not yet at the engine),
    # a third at 15 ms: both reached the engine at 10 ms; the first started a step alone at
    # once, so the second waits for the next step (engine state is exact, per step).
    _, res = run(fleet, [req(0, 500, 50), req(0, 500, 50), req(15, 500, 50)], router)
    assert router.seen[0][1:] == (0, 0, 0)
    assert router.seen[1][1:] == (1, 0, 0)
    assert router.seen[2][1:] == (2, 1, 1)
    assert sorted(o.request_id for o in router.outcomes) == ["r0", "r1", "r2"]
    by_id = {r.request_id: r for r in res.records}
    for o in router.outcomes:
        assert o.ok and not o.cancelled and o.output_tokens == 50
        assert o.ttft_s == pytest.approx(by_id[o.request_id].ttft_s)
        assert o.e2e_s == pytest.approx(by_id[o.request_id].e2e_s)


def test_a_queued_request_can_time_out_at_the_gateway() -> None:
    fleet = small_fleet(instances=2)
    reqs = [req(0, 1000, 400), req(10, 1000, 20)]
    sim = FleetSimulator(fleet, RoundRobin(), admission=_OneAtATime())
    inputs = prepare(reqs, fleet)
    inputs[1].timeout_s = 2.0  # only the second client is impatient
    a, b = sim.run(inputs).records
    assert a.status == "completed" and a.e2e_s > 2.0
    assert b.status == "cancelled" and b.reason == "client timeout while queued" and b.instance is None
    assert b.end_s == pytest.approx(2.01)
