"""The decisions made once: the policy contracts (fleetcore.policies), request placement
(fleetmind.place, shared by the relay and the simulator) and the fleet's one SLO map."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from fleetcore.fleet_config import FleetConfig, parse_fleet
from fleetcore.policies import Admission, InstanceRouter, SiteChooser
from fleetcore.slo import DEFAULT_SLOS, ClassSLO
from fleetcore.types import AdmissionDecision, FleetView, InstanceSnapshot, RequestProfile, RouteDecision, SiteSnapshot
from fleetmind.place import place
from fleetmind.site_choice import FleetMind, NearestReadySite
from fleetsim.cli import main
from fleetsim.simulator import AdmitAll, FleetSimulator, prepare
from slomax import FCFS, SLOMax, from_fleet
from tokenpilot.registry import ROUTER_NAMES, make_router
from workloads import TraceRequest

# --- place ------------------------------------------------------------------------------


def _site(name: str, ids: Sequence[str], region: str = "r") -> SiteSnapshot:
    return SiteSnapshot(name, region, "j", {"r": 1.0}, tuple(
        InstanceSnapshot(i, name, "m", "v1", f"http://{i}") for i in ids))


VIEW = FleetView((_site("a", ["a0", "a1"]), _site("b", ["b0"])))
PROFILE = RequestProfile(request_id="r", model="m", prompt_tokens=100, client_region="r")


class _Lowest(InstanceRouter):
    """Lowest id in the pool it was given; records every pool it saw."""

    def __init__(self) -> None:
        self.pools: list[tuple[str, ...]] = []

    def route(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot], now: float) -> RouteDecision:
        ids = tuple(sorted(c.instance_id for c in candidates))
        self.pools.append(ids)
        return RouteDecision(ids[0] if ids else None, "lowest" if ids else "empty pool")


class _Stubborn(InstanceRouter):
    """Always names one instance, in the pool or not (a buggy or stale router)."""

    def route(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot], now: float) -> RouteDecision:
        return RouteDecision("a0", "always a0")


def test_place_honours_the_avoid_hint_when_it_leaves_a_candidate() -> None:
    router = _Lowest()
    c = place(PROFILE, VIEW, 0.0, NearestReadySite(), router, avoid=["a0"])
    assert c.instance is not None and c.instance.instance_id == "a1"
    assert router.pools == [("a1",)] and c.avoided is None and len(c.tries()) == 1


def test_place_drops_the_avoid_hint_when_it_leaves_nothing_but_never_an_exclusion() -> None:
    router = _Lowest()
    c = place(PROFILE, VIEW, 0.0, NearestReadySite(), router, exclude=["b0"], avoid=["a0", "a1"])
    # avoiding a0, a1 with b0 failed leaves no site; the hint gives way, the failure does not
    assert c.instance is not None and c.instance.instance_id == "a0"
    first, second = c.tries()
    assert first.site.site is None and set(first.excluded) == {"a0", "a1", "b0"}
    assert second.excluded == ("b0",)
    everything = place(PROFILE, VIEW, 0.0, NearestReadySite(), router, exclude=["a0", "a1", "b0"])
    assert everything.instance is None and everything.route is None and "no site" in everything.reason


def test_place_treats_a_router_answer_outside_the_pool_as_nowhere() -> None:
    c = place(PROFILE, VIEW, 0.0, NearestReadySite(), _Stubborn(), exclude=["a0"])
    assert c.instance is None and c.site.site == "a" and c.reason == "always a0"
    # with only the (soft) hint against a0, the second try may have it
    c = place(PROFILE, VIEW, 0.0, NearestReadySite(), _Stubborn(), avoid=["a0"])
    assert c.instance is not None and c.instance.instance_id == "a0" and c.avoided is not None


# --- the contracts ------------------------------------------------------------------------


def test_every_policy_implements_its_contract() -> None:
    for name in ROUTER_NAMES:
        assert isinstance(make_router(name, seed=0), InstanceRouter), name
    assert isinstance(NearestReadySite(), SiteChooser) and isinstance(FleetMind(slos=DEFAULT_SLOS), SiteChooser)
    for adm in (SLOMax(), FCFS(), AdmitAll()):
        assert isinstance(adm, Admission)
    assert SLOMax.holds_queue and FCFS.holds_queue and not AdmitAll.holds_queue
    assert make_router("tokenpilot").follows_kv_events and not make_router("round_robin").follows_kv_events


class _OnlyRoute(InstanceRouter):
    name = "only_route"

    def route(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot], now: float) -> RouteDecision:
        return RouteDecision(min(c.instance_id for c in candidates), "first")


def _fleet(classes: dict | None = None, sites: int = 1) -> FleetConfig:
    doc: dict = {
        "sites": [{"name": f"s{k}", "region": "r", "jurisdiction": "j", "rtt_ms": {"r": 1 + k}} for k in range(sites)],
        "models": [{"name": "m", "engine": {"spec": "llama-3.1-8b", "max_model_len": 32768}}],
        "deployments": [{"site": f"s{k}", "model": "m", "instances": 1, "gpu": "H100"} for k in range(sites)],
    }
    if classes is not None:
        doc["admission"] = {"classes": classes}
    return parse_fleet(doc)


def test_a_policy_with_only_the_decision_runs_everywhere_on_the_defaults() -> None:
    """Nothing calls a method the contract does not give a default for (sim with FleetMind and
    SLOMax: predict, register_instance, observe, on_dispatched, on_first_token, poll ...)."""
    fleet = _fleet(sites=2)
    router = _OnlyRoute()
    sim = FleetSimulator(fleet, router, site_chooser=FleetMind.from_fleet(fleet, router),
                         admission=SLOMax(from_fleet(fleet)))
    sim.add_instance("s1", "m", 0.0, 0.5)  # register_instance: a no-op for this router
    reqs = [TraceRequest(100.0 * i, 500, 8, (i,)) for i in range(6)]
    res = sim.run(prepare(reqs, fleet))
    assert [r.status for r in res.records] == ["completed"] * 6


class _QueueThenAdmit(Admission):
    """admit-only hook: the simulator's own FIFO holds what it queues."""

    def __init__(self) -> None:
        self.seen = 0

    def admit(self, profile: RequestProfile, view: FleetView, now: float) -> AdmissionDecision:
        self.seen += 1
        return AdmissionDecision("queue" if self.seen == 2 else "admit")


def test_an_admit_only_hook_gets_the_simulators_fifo() -> None:
    fleet = _fleet()
    res = FleetSimulator(fleet, _OnlyRoute(), admission=_QueueThenAdmit()).run(
        prepare([TraceRequest(0.0, 500, 8, ()), TraceRequest(1.0, 500, 8, ())], fleet))
    a, b = res.records
    assert a.status == b.status == "completed" and b.queue_s is not None and b.queue_s > 0


# --- the fleet's SLO map --------------------------------------------------------------------


PREMIUM = {"premium": {"ttft_s": 0.2, "share": 2}, "interactive": {"ttft_s": 0.25}}


def test_fleet_slo_map_extends_and_overrides_the_defaults() -> None:
    slos = _fleet(PREMIUM).admission.slos()
    assert slos["premium"] == ClassSLO(ttft_s=0.2)
    assert slos["interactive"] == ClassSLO(ttft_s=0.25, tpot_s=DEFAULT_SLOS["interactive"].tpot_s)
    assert slos["batch"] == DEFAULT_SLOS["batch"]
    assert _fleet().admission.slos() == dict(DEFAULT_SLOS)
    # admission holds requests to the same map
    assert {c: p.slo for c, p in from_fleet(_fleet(PREMIUM)).classes.items()} == slos


class _Fixed(InstanceRouter):
    """Predicts a fixed TTFT per site (what TokenPilot would say)."""

    def __init__(self, ttft: dict[str, float]) -> None:
        self.ttft = ttft

    def route(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot], now: float) -> RouteDecision:
        return RouteDecision(candidates[0].instance_id, "first")

    def predict(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot],
                now: float) -> tuple[float, int] | None:
        return (self.ttft[candidates[0].site], 0)


@pytest.mark.parametrize("cls", ["premium", "interactive"])
def test_a_fleet_class_slo_reaches_site_choice(cls: str) -> None:
    """Home predicts 0.5 s: within the default interactive SLO (1 s), past the fleet's own
    (premium 0.2 s, interactive tuned to 0.25 s), so only the fleet's map makes FleetMind spill."""
    fleet = _fleet(PREMIUM, sites=2)
    view = FleetView((_site("s0", ["s0/m/0"]), _site("s1", ["s1/m/0"])))
    profile = RequestProfile(request_id="r", model="m", prompt_tokens=100, client_region="r", request_class=cls)
    pred = _Fixed({"s0": 0.5, "s1": 0.05})
    on_defaults = FleetMind(predictor=pred, slos=DEFAULT_SLOS).choose(profile, view, 0.0)
    assert on_defaults.site == "s0"
    spilled = FleetMind.from_fleet(fleet, pred).choose(profile, view, 0.0)
    assert spilled.site == "s1" and "spill" in spilled.reason


def test_a_fleet_class_slo_reaches_the_simulators_report_and_planner(tmp_path: Path) -> None:
    """A fleet class with a TTFT bound no request can meet: the report counts every one of its
    requests a miss (judged by the default map the class would have had no bound)."""
    fleet_doc = {
        "sites": [{"name": "s1", "region": "r", "jurisdiction": "j"}],
        "models": [{"name": "m", "engine": {"spec": "llama-3.1-8b"}}],
        "deployments": [{"site": "s1", "model": "m", "instances": 1, "gpu": "H100"}],
        "admission": {"classes": {"premium": {"ttft_s": 0.001}}},
    }
    fleet_file = tmp_path / "f.yaml"
    fleet_file.write_text(json.dumps(fleet_doc))
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 200 * i, "input_length": 600, "output_length": 4,
                                         "hash_ids": [i], "class": "premium" if i % 2 else "interactive"}) + "\n"
                             for i in range(8)))
    out = tmp_path / "r.json"
    assert main(["--trace", str(trace), "--fleet", str(fleet_file), "--policy", "round_robin",
                 "--json", str(out), "--no-progress"]) == 0
    row = json.loads(out.read_text())["results"][0]
    assert row["completed"] == 8
    assert row["by_class"]["premium"]["slo_attainment"] == 0.0
    assert row["by_class"]["interactive"]["slo_attainment"] == 1.0
    assert row["slo_attainment"] == 0.5
    # The planner judges goodput from the admission ledger (fleetmind.placement_cycle), which
    # books met/missed by the admission's classes: those are the fleet's too.
    fleet = parse_fleet(fleet_doc)
    assert from_fleet(fleet).classes["premium"].slo.ttft_s == 0.001
    assert fleet.admission.slos()["premium"].ttft_s == 0.001
