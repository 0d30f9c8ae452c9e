"""Engine failures in the simulator: seeded deaths and stalls, retry before the first token,
continuation after it (fleetcore.continuation's rules, fleetmind.place's choice), the report."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict

import pytest

from fleetcore.continuation import ContinuationLimits
from fleetcore.fleet_config import FleetConfig
from fleetcore.policies import InstanceRouter
from fleetcore.prefix import synthetic_block_hashes
from fleetcore.types import InstanceSnapshot, RequestOutcome, RequestProfile, RouteDecision
from fleetsim.cli import main, make_policy
from fleetsim.failures import FailureModel, FaultClock, tail_block_hashes
from fleetsim.metrics import RequestRecord, summarize_all
from fleetsim.simulator import FleetSimulator, SimResult, prepare
from tokenpilot.baselines import RoundRobin
from workloads import TraceRequest

from tests.paths import TRACES
from tests.test_fleetsim import req, small_fleet

TRACE = TRACES / "conversation_trace.jsonl.gz"
I0, I1, I2 = (f"s1/llama-3.1-8b/{k}" for k in range(3))


def sim_run(fleet: FleetConfig, reqs: list[TraceRequest], failures: FailureModel | None = FailureModel(),
            faults: Sequence[tuple[str, str, float]] = (), router: InstanceRouter | None = None,
            **kw) -> tuple[FleetSimulator, SimResult]:
    sim = FleetSimulator(fleet, router or RoundRobin(), failures=failures, **kw)
    for iid, kind, at in faults:
        sim.inject(iid, kind, at)  # type: ignore[arg-type]
    return sim, sim.run(prepare(reqs, fleet))


def one(res: SimResult) -> RequestRecord:
    assert len(res.records) == 1
    return res.records[0]


class ReadyLog:
    """A controller that samples one instance's readiness every `every_s` (the routing view)."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self.seen: list[tuple[float, bool]] = []

    def __call__(self, sim: FleetSimulator, now: float) -> None:
        snap = next(i for i in sim.view().instances() if i.instance_id == self.instance_id)
        self.seen.append((now, snap.ready))

    def ready_at(self, t0: float, t1: float) -> set[bool]:
        return {ok for t, ok in self.seen if t0 < t < t1}


# --- the failure schedule --------------------------------------------------------------


def test_fault_clock_is_seeded_per_instance_and_kind() -> None:
    a, b = FaultClock(FailureModel(fail_rate_per_h=2.0, seed=7)), FaultClock(FailureModel(fail_rate_per_h=2.0, seed=7))
    draws_a = [a.next_after(I0, "death", 0.0) for _ in range(5)]
    # another instance's draws in between change nothing for I0
    draws_b = []
    for _ in range(5):
        b.next_after(I1, "death", 0.0)
        draws_b.append(b.next_after(I0, "death", 0.0))
    assert draws_a == draws_b
    other_seed = FaultClock(FailureModel(fail_rate_per_h=2.0, seed=8))
    assert [other_seed.next_after(I0, "death", 0.0) for _ in range(5)] != draws_a
    assert FaultClock(FailureModel(fail_rate_per_h=2.0)).next_after(I0, "stall", 0.0) is None  # rate 0: never
    # mean wait ~ 1/rate: 2 per hour -> 1800 s
    clock = FaultClock(FailureModel(fail_rate_per_h=2.0, seed=1))
    waits = [clock.next_after(I0, "death", 0.0) for _ in range(4000)]
    assert 1650 < sum(waits) / len(waits) < 1950  # type: ignore[arg-type]


def trace_head(n: int) -> list[TraceRequest]:
    from workloads import head, load_trace
    return list(head(load_trace(str(TRACE), "mooncake"), n).requests)


def test_random_deaths_are_seeded_and_reproducible() -> None:
    fleet = small_fleet(4)
    reqs = [req(i * 150.0, 1500 + 37 * (i % 11), 200 + 13 * (i % 7), (i % 5, 100 + i)) for i in range(160)]

    def go(seed: int) -> tuple[list[dict], dict]:
        _, res = sim_run(fleet, reqs, FailureModel(fail_rate_per_h=600.0, restart_s=2.0, seed=seed))
        assert res.failures is not None
        return [asdict(r) for r in res.records], res.failures

    recs1, f1 = go(3)
    recs2, f2 = go(3)
    assert recs1 == recs2 and f1 == f2
    assert f1["deaths"] >= 3 and sum(f1["continuations"].values()) >= 1
    recs3, f3 = go(4)
    assert (recs3, f3) != (recs1, f1)
    # every request is accounted for: completed with its whole output, or failed with a reason
    for r, q in zip(sorted(recs1, key=lambda r: int(r["request_id"][1:])), reqs):
        if r["status"] == "completed":
            assert r["output_tokens"] == q.output_length
        else:
            assert r["status"] == "failed" and r["reason"]


# --- deaths -----------------------------------------------------------------------------


def test_death_mid_stream_is_continued_with_exactly_the_output_length() -> None:
    fleet = small_fleet(2)
    _, clean = sim_run(fleet, [req(0, 2000, 400, (1, 2, 3, 4))], failures=None)
    base = one(clean)
    assert base.instance == I0 and base.output_tokens == 400 and clean.failures is None
    log = ReadyLog(I0)
    sim, res = sim_run(fleet, [req(0, 2000, 400, (1, 2, 3, 4))],
                       FailureModel(restart_s=1.0), faults=[(I0, "death", 1.1)], controllers=[(0.25, log)])
    r = one(res)
    assert r.status == "completed" and r.output_tokens == 400 and r.instance == I1
    assert r.ttft_s == base.ttft_s  # TTFT is the first token's, unchanged
    assert r.e2e_s is not None and base.e2e_s is not None and r.e2e_s > base.e2e_s  # the gap is in e2e / TPOT
    assert r.tpot_s is not None and base.tpot_s is not None and r.tpot_s > base.tpot_s
    f = res.failures
    assert f is not None
    assert f["deaths"] == 1 and f["continuations"] == {"engine_died": 1} and f["continued_requests"] == 1
    # generated before the death: what the clean run had made by then (one token per step)
    generated = f["reprefill_tokens"] - 2000
    assert 0 < generated < 400 and f["reprefill_cached_tokens"] == 0  # I1 never saw the prompt
    lost = f["time_lost_per_continuation_ms"]
    assert lost["p50"] is not None and 0 < lost["p50"] < r.e2e_s * 1e3
    # the routing view: unready from the death until the restart (1 s later), ready again after
    assert log.ready_at(0.0, 1.1) == {True} and log.ready_at(1.1, 2.1) == {False}
    assert log.ready_at(2.1, 2.6) == {True}
    assert sim._by_id[I0].engine.num_finished == 0  # the new process saw nothing of it


def test_death_before_the_first_token_is_retried_elsewhere_once() -> None:
    fleet = small_fleet(3)
    _, res = sim_run(fleet, [req(0, 16000, 50)], faults=[(I0, "death", 0.05)])
    r = one(res)
    assert r.status == "completed" and r.output_tokens == 50 and r.instance == I1
    f = res.failures
    assert f is not None and f["retries_before_first_token"] == 1 and f["continuations"] == {}
    # the retry fails too: the relay's retry is spent, the request fails (no continuation: no token yet)
    _, res = sim_run(fleet, [req(0, 16000, 50)], faults=[(I0, "death", 0.05), (I1, "death", 0.3)])
    r = one(res)
    assert r.status == "failed" and r.output_tokens == 0 and "retry is spent" in (r.reason or "")
    assert res.failures is not None and res.failures["failed_by_reason"] == {"retry_spent": 1}


def test_a_request_sent_to_an_engine_that_died_on_the_way_is_refused_and_retried() -> None:
    fleet = small_fleet(2, rtt={"us-east": 400, "eu-west": 150})  # 200 ms each way
    _, res = sim_run(fleet, [req(0, 1000, 20)], faults=[(I0, "death", 0.1)])
    r = one(res)
    assert r.status == "completed" and r.instance == I1
    assert res.failures is not None and res.failures["retries_before_first_token"] == 1
    assert r.ttft_s is not None and r.ttft_s > 0.2 + 0.2 + 0.4  # reached, refused, heard, sent again


class PinFirstLeg(InstanceRouter):
    """Test router: a request's first attempt goes where `pins` says (the wrapped router is
    told, so its prefix index learns it); any later attempt is the wrapped router's choice."""

    name = "pin_first_leg"

    def __init__(self, inner: InstanceRouter, pins: dict[str, str]) -> None:
        self.inner = inner
        self.pins = dict(pins)

    def route(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot], now: float) -> RouteDecision:
        pin = self.pins.pop(profile.request_id, None)
        if pin is not None:
            return self.inner.route(profile, [c for c in candidates if c.instance_id == pin], now)
        return self.inner.route(profile, candidates, now)

    def observe(self, outcome: RequestOutcome) -> None:
        self.inner.observe(outcome)


@pytest.mark.parametrize("policy", ["tokenpilot", "sglang_cache_aware"])
def test_continuation_prefers_the_instance_holding_the_prefix_and_re_prefills_only_the_tail(policy: str) -> None:
    fleet = small_fleet(3)
    # r0 leaves the 2048-token prefix (ids 1-4) cached on I2; r1 shares it and streams on I0
    reqs = [req(0, 2048, 5, (1, 2, 3, 4)), req(200, 2100, 600, (1, 2, 3, 4, 9))]
    router = PinFirstLeg(make_policy(policy, 0, fleet), {"r0": I2, "r1": I0})
    sim, res = sim_run(fleet, reqs, faults=[(I0, "death", 1.5)], router=router)
    r1 = next(r for r in res.records if r.request_id == "r1")
    assert r1.status == "completed" and r1.output_tokens == 600 and r1.instance == I2
    f = res.failures
    assert f is not None and f["continuations"] == {"engine_died": 1}
    assert f["reprefill_cached_tokens"] == 2048  # the prompt's shared blocks: a hit on I2
    generated = f["reprefill_tokens"] + 2048 - 2100
    assert 0 < generated < 600  # so only the prompt's own tail and the generated tokens were computed
    assert sim._by_id[I2].engine.prefix_hits_tokens == 2048  # the engine's metrics agree


def test_tail_block_hashes_chain_on_from_the_prompt_and_extend() -> None:
    prompt = tuple(synthetic_block_hashes([1, 2], 4))
    short = tail_block_hashes("r5", prompt, len(prompt) + 3)
    long = tail_block_hashes("r5", prompt, len(prompt) + 6)
    assert len(short) == 3 and long[:3] == short  # a later continuation's tail extends the earlier one
    assert tail_block_hashes("r5", prompt[:4], 4 + 3) != short  # chained: depends on the prefix
    assert tail_block_hashes("r6", prompt, len(prompt) + 3) != short  # each request's own tail
    assert tail_block_hashes("r5", prompt, len(prompt)) == ()


def test_the_continuation_limit_ends_the_stream_on_the_next_failure() -> None:
    fleet = small_fleet(2)
    limits = ContinuationLimits(max_continuations=1)
    _, res = sim_run(fleet, [req(0, 2000, 1000)], FailureModel(limits=limits, restart_s=60.0),
                     faults=[(I0, "death", 1.0), (I1, "death", 3.0)])
    r = one(res)
    assert r.status == "failed" and 0 < r.output_tokens < 1000 and "limit" in (r.reason or "")
    f = res.failures
    assert f is not None and f["continuations"] == {"engine_died": 1}
    assert f["continuation_refused"] == {"limit": 1} and f["failed_requests"] == 1
    # with the default limit (2) the second failure is continued too, on an instance that has
    # not failed this request (the relay's rule: a failed instance is not tried again for it)
    _, res = sim_run(small_fleet(3), [req(0, 2000, 1000)], FailureModel(restart_s=1.0),
                     faults=[(I0, "death", 1.0), (I1, "death", 3.0)])
    r = one(res)
    assert r.status == "completed" and r.output_tokens == 1000 and r.instance == I2
    assert res.failures is not None and res.failures["continuations"] == {"engine_died": 2}


def test_without_continuation_a_death_after_the_first_token_fails_the_request() -> None:
    fleet = small_fleet(2)
    off = FailureModel(limits=ContinuationLimits(enabled=False))
    _, res = sim_run(fleet, [req(0, 2000, 400)], off, faults=[(I0, "death", 1.0)])
    r = one(res)
    assert r.status == "failed" and 0 < r.output_tokens < 400 and r.e2e_s is None
    assert r.ttft_s is not None  # the client had its first token
    assert res.failures is not None and res.failures["continuation_refused"] == {"disabled": 1}
    s = summarize_all(res.records, fleet.admission.slos())
    assert s["slo_attainment"] == 0.0 and s["goodput_tok_s"] == 0.0 and s["completed"] == 0


# --- stalls -----------------------------------------------------------------------------


def test_a_stall_is_noticed_at_the_idle_deadline_and_continued() -> None:
    fleet = small_fleet(2)
    idle = fleet.gateway.stream_idle_timeout_s
    log = ReadyLog(I0)
    sim, res = sim_run(fleet, [req(0, 2000, 400)], FailureModel(stall_s=120.0),
                       faults=[(I0, "stall", 1.0)], controllers=[(0.5, log)])
    r = one(res)
    assert r.status == "completed" and r.output_tokens == 400 and r.instance == I1
    f = res.failures
    assert f is not None and f["stalls"] == 1 and f["continuations"] == {"stalled": 1}
    lost = f["time_lost_per_continuation_ms"]["p50"]
    assert lost is not None and idle * 1e3 - 50 < lost < idle * 1e3 + 500  # the idle deadline + re-prefill
    # unready once the health checks missed (3 x 2 s) until the stall ends; ready before
    assert log.ready_at(7.5, 120.0) == {False} and log.ready_at(0.0, 1.0) == {True}
    assert sim._by_id[I0].ready  # the stall ended (the run lasts until then): healthy again
    eng = sim._by_id[I0].engine
    assert not eng.has_work() and eng.num_aborted == 1  # the abandoned leg was aborted, not finished


def test_a_stall_shorter_than_the_deadline_only_delays_the_stream() -> None:
    fleet = small_fleet(2)
    _, clean = sim_run(fleet, [req(0, 2000, 400)], failures=None)
    _, res = sim_run(fleet, [req(0, 2000, 400)], FailureModel(stall_s=5.0), faults=[(I0, "stall", 1.0)])
    r, base = one(res), one(clean)
    assert r.status == "completed" and r.output_tokens == 400 and r.instance == I0
    assert res.failures is not None and res.failures["continuations"] == {}
    assert base.e2e_s is not None and r.e2e_s == pytest.approx(base.e2e_s + 5.0, abs=1e-6)


def test_a_request_waiting_on_a_stalled_engine_is_retried_at_its_first_byte_deadline() -> None:
    fleet = small_fleet(2)
    g = fleet.gateway
    _, res = sim_run(fleet, [req(0, 2000, 50)], FailureModel(stall_s=300.0), faults=[(I0, "stall", 0.0)])
    r = one(res)
    assert r.status == "completed" and r.instance == I1
    assert res.failures is not None and res.failures["retries_before_first_token"] == 1
    assert r.ttft_s is not None and g.first_byte_timeout_floor_s < r.ttft_s < g.first_byte_timeout_floor_s + 1.0


# --- the command line -------------------------------------------------------------------


def cli_json(tmp_path, *extra: str) -> dict:
    out = tmp_path / f"r{len(list(tmp_path.iterdir()))}.json"
    rc = main(["simulate", "--trace", str(TRACE), "--max-requests", "150", "--policy", "round_robin",
               "--rate-scale", "2", "--no-progress", "--json", str(out), *extra])
    assert rc == 0
    rep = json.loads(out.read_text())
    for row in rep["results"]:
        row.pop("wall_s")
    return rep


def test_fail_rate_zero_reports_exactly_as_without_failures(tmp_path) -> None:
    plain = cli_json(tmp_path)
    zero = cli_json(tmp_path, "--fail-rate", "0", "--stall-rate", "0", "--no-continuation")
    assert zero == plain
    assert "failures" not in plain["workload"] and "failures" not in plain["results"][0]


def test_cli_failures_block(tmp_path, capsys) -> None:
    rep = cli_json(tmp_path, "--fail-rate", "400", "--stall-rate", "100", "--seed", "2", "--restart-s", "5")
    assert rep["workload"]["failures"]["fail_rate_per_instance_h"] == 400.0
    assert rep["workload"]["failures"]["continuation"] is True
    f = rep["results"][0]["failures"]
    assert set(f) == {"deaths", "stalls", "retries_before_first_token", "continuations", "continued_requests",
                      "continuation_refused", "failed_requests", "failed_by_reason", "reprefill_tokens",
                      "reprefill_cached_tokens", "time_lost_per_continuation_ms"}
    assert f["deaths"] > 0 and f["stalls"] > 0
    assert set(f["continuations"]) <= {"engine_died", "stalled"}
    assert "deaths" in capsys.readouterr().out
    assert main(["simulate", "--trace", str(TRACE), "--fail-rate", "-1", "--no-progress"]) == 2
    assert main(["simulate", "--trace", str(TRACE), "--stall-s", "0", "--no-progress"]) == 2
