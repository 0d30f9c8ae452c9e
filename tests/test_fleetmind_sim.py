"""FleetMind in the simulator on the shipped multi-site scenario: spill relieves the hot site,
residency and model versions are never violated, and `simulate --placement` reports it."""

from __future__ import annotations

import json
from dataclasses import replace
import subprocess
import sys
from pathlib import Path

import pytest

from fleetcore.fleet_config import load_fleet_file
from fleetsim.cli import make_placement, make_policy, residency_violations
from fleetsim.metrics import summarize_all
from fleetsim.simulator import FleetSimulator, prepare
from fleetcore.region_policy import PolicySet
from tests.paths import REPO, TRACES

SCENARIOS = REPO / "deploy" / "scenarios"
FLEET = load_fleet_file(SCENARIOS / "multisite.yaml")


def workload(tmp: Path, n: int = 500) -> Path:
    subprocess.run([sys.executable, str(SCENARIOS / "make_workloads.py"), str(tmp), "--requests", str(n),
                    "--traces", str(TRACES)], check=True, capture_output=True)
    return tmp / "multisite.jsonl"


def run(path: Path, placement: str, rate_scale: float = 1.0):  # type: ignore[no-untyped-def]
    from workloads import load_trace, scale_rate

    wl = scale_rate(load_trace(path), rate_scale)
    inputs = prepare(wl.requests, FLEET)
    router = make_policy("tokenpilot", 0, FLEET)
    res = FleetSimulator(FLEET, router, site_chooser=make_placement(placement, FLEET, router)).run(inputs)
    return inputs, res.records


@pytest.mark.slow
def test_spill_relieves_the_hot_site_within_policy(tmp_path: Path) -> None:
    path = workload(tmp_path)
    _, home = run(path, "home", 0.5)
    inputs, spill = run(path, "fleetmind", 0.5)
    s_home, s_spill = summarize_all(home, FLEET.admission.slos()), summarize_all(spill, FLEET.admission.slos())
    # Deterministic run; observed: P95 TTFT 0.48x home-only, goodput 2.9x. The old bound (0.5x) sat
    # 4% from the observed value, so any small change to the roofline or a tie-break flipped it
    # without saying anything about spilling. Relief means a clear cut on both: a quarter off the
    # P95 and twice the goodput, each well clear of what such changes move.
    assert s_spill["ttft_ms"]["p95"] <= 0.75 * s_home["ttft_ms"]["p95"]
    assert s_spill["goodput_tok_s"] >= 2 * s_home["goodput_tok_s"]
    policies = PolicySet(FLEET.region_policies)
    assert residency_violations(spill, policies, FLEET) == 0
    assert not any(r.tenant == "acme" and r.site == "eu-west-1" for r in spill)
    assert any(r.tenant == "globex" and r.site == "eu-west-1" for r in spill)  # others may go
    version = {i.request_id: i.model_version for i in inputs}
    v2_sites = {r.site for r in spill if version[r.request_id] == "v2" and r.site}
    assert v2_sites == {"us-west-2"}
    # with home-only placement the v2 requests cannot be served at all (home has no v2)
    assert all(r.status == "rejected" for r in home if version[r.request_id] == "v2")


@pytest.mark.slow
def test_simulate_reports_placement_residency_and_sites(tmp_path: Path) -> None:
    path = workload(tmp_path, 150)
    out = tmp_path / "out.json"
    r = subprocess.run([sys.executable, "-m", "tokenfleet", "simulate", "--trace", str(path), "--fleet",
                        str(SCENARIOS / "multisite.yaml"), "--policy", "tokenpilot", "--placement",
                        "home,fleetmind", "--no-progress", "--json", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["results"]
    assert [row["placement"] for row in rows] == ["home", "fleetmind"]
    for row in rows:
        assert row["residency_violations"] == 0
        assert set(row["by_site"]) <= {"us-east-1", "us-west-2", "eu-west-1"}
    assert set(rows[0]["by_site"]) == {"us-east-1"}
    assert "tokenpilot/home" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "tokenfleet", "simulate", "--trace", str(path),
                          "--placement", "moon"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown placement 'moon'" in bad.stderr


@pytest.mark.slow
def test_planner_moves_replicas_toward_a_flash_crowd(tmp_path: Path) -> None:
    """The long cycle in virtual time: demand appears at west, a replica moves there and
    starts after its start-up delay; every step is logged."""
    from fleetsim.cli import placement_controllers
    from workloads import Workload, head, load_trace

    subprocess.run([sys.executable, str(SCENARIOS / "make_workloads.py"), str(tmp_path), "--requests", "10",
                    "--traces", str(TRACES)], check=True, capture_output=True)
    wl = load_trace(tmp_path / "flash-crowd.jsonl")
    wl = Workload("slice", [r for r in wl.requests if r.timestamp_ms < 900_000], wl.block_tokens)
    fleet = load_fleet_file(SCENARIOS / "demand-shift.yaml")
    router = make_policy("tokenpilot", 0, fleet)
    controllers = placement_controllers("fleetmind+planner", fleet)
    sim = FleetSimulator(fleet, router, site_chooser=make_placement("fleetmind", fleet, router),
                         controllers=controllers)
    res = sim.run(prepare(head(wl, len(wl)).requests, fleet))
    log = controllers[0][1].core.planner.log
    kinds = [e.kind for e in log]
    assert "apply" in kinds
    moved_to_west = [e for e in log if e.kind == "apply" and e.move and e.move.to_site == "west"]
    assert moved_to_west, [(e.kind, e.reason) for e in log]
    started = [i for i in sim.view().instances() if i.instance_id.startswith("west/llama-3.1-70b/+")]
    assert started and all(i.ready for i in started)  # came up after its start-up delay
    placement = sim.placement()
    assert placement[("east", "llama-3.1-70b")] >= 1 and placement[("west", "llama-3.1-70b")] >= 1
    assert all(r.status == "completed" for r in res.records)


@pytest.mark.slow
def test_the_simulated_planner_hears_admissions_verdict_on_every_request_a_site_served(tmp_path: Path) -> None:
    """`fleetsim.planning` books, per site, the ledger's own verdict on each request that ran
    there (what the gateway's `on_released` hands the live loop): the planner's met share per
    site is the report's SLO attainment per site over the same requests."""
    from collections import Counter

    from fleetsim.cli import placement_controllers
    from fleetsim.metrics import slo_met
    from slomax import from_fleet as slomax_config
    from slomax import make_admission
    from workloads import Workload, load_trace

    subprocess.run([sys.executable, str(SCENARIOS / "make_workloads.py"), str(tmp_path), "--requests", "10",
                    "--traces", str(TRACES)], check=True, capture_output=True)
    wl = load_trace(tmp_path / "flash-crowd.jsonl")
    wl = Workload("slice", [r for r in wl.requests if r.timestamp_ms < 120_000], wl.block_tokens)
    fleet = load_fleet_file(SCENARIOS / "demand-shift.yaml")
    router = make_policy("tokenpilot", 0, fleet)
    controllers = placement_controllers("fleetmind+planner", fleet)
    core = controllers[0][1].core
    core.planner.config = replace(core.planner.config, window_s=1e9)  # keep every verdict for the comparison
    sim = FleetSimulator(fleet, router, site_chooser=make_placement("fleetmind", fleet, router),
                         admission=make_admission("fcfs", slomax_config(fleet)), controllers=controllers)
    res = sim.run(prepare(wl.requests, fleet))
    ends = max(r.end_s for r in res.records if r.end_s is not None)
    slos = fleet.admission.slos()
    judged = {s: (len(q), sum(m for _, m in q)) for (s, _), q in core.planner._verdicts.items()}
    # the loop hears what ended before its last cycle: compare over those
    last = max(t for q in core.planner._verdicts.values() for t, _ in q)
    want: Counter[tuple[str, bool]] = Counter((r.site, slo_met(r, slos)) for r in res.records
                                              if r.site and r.end_s is not None and r.end_s <= last)
    assert judged and sum(n for n, _ in judged.values()) > 20 and last <= ends
    assert judged == {s: (want[(s, True)] + want[(s, False)], want[(s, True)]) for s in judged}
