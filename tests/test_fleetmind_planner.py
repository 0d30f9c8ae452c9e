"""The placement planner: follows demand with pre-warming, one move at a time, and rolls back a move that hurts."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetcore.fleet_config import FleetConfigError, load_fleet_file, parse_fleet
from fleetmind.demand import DemandModel
from fleetmind.planner import Move, Planner, PlannerConfig, planner_for

CFG = PlannerConfig(window_s=10, lead_s=10, target_utilisation=0.5, cooldown_s=30, watch_s=20,
                    rollback_drop=0.15)


def feed(p: Planner, t0: float, t1: float, demand: dict[str, float], goodput: float = 100.0) -> None:
    t = t0
    while t < t1:
        for site, work in demand.items():
            p.record_demand(site, "m", work)
        p.record_goodput(goodput, t)
        t += 1.0
        p.wanted(t)


def test_moves_a_replica_toward_demand() -> None:
    p = Planner({"m": 1.0}, config=CFG)
    placement = {("a", "m"): 4, ("b", "m"): 4}
    feed(p, 0, 60, {"a": 3.9, "b": 0.2})  # a needs ~8 replicas at 50% target, b ~1
    move = p.plan(placement, 60)
    # a wants ~8, b ~1 and keeps at least one: three move at once (batch <= 4)
    assert move == Move("m", "b", "a", 3)
    assert p.log[-1].kind == "plan" and "a needs" in p.log[-1].reason


def test_one_move_then_cooldown_and_watch() -> None:
    p = Planner({"m": 1.0}, config=CFG)
    placement = {("a", "m"): 4, ("b", "m"): 4}
    feed(p, 0, 60, {"a": 3.9, "b": 0.2})
    move = p.plan(placement, 60)
    assert move is not None
    p.applied(move, 60)
    assert p.plan(placement, 61) is None  # watching


def test_rolls_back_a_move_that_hurts_goodput() -> None:
    p = Planner({"m": 1.0}, config=CFG)
    placement = {("a", "m"): 4, ("b", "m"): 4}
    feed(p, 0, 60, {"a": 3.9, "b": 0.2}, goodput=100)
    move = p.plan(placement, 60)
    assert move is not None
    p.applied(move, 60)
    feed(p, 60, 85, {"a": 3.9, "b": 0.2}, goodput=60)  # 40% worse
    undo = p.check(85)
    assert undo == move.inverse()
    assert [e.kind for e in p.log] == ["plan", "apply", "rollback"]
    assert "fell 40%" in p.log[-1].reason


def test_keeps_a_move_that_helps() -> None:
    p = Planner({"m": 1.0}, config=CFG)
    placement = {("a", "m"): 4, ("b", "m"): 4}
    feed(p, 0, 60, {"a": 3.9, "b": 0.2}, goodput=100)
    move = p.plan(placement, 60)
    assert move is not None
    p.applied(move, 60)
    feed(p, 60, 85, {"a": 3.9, "b": 0.2}, goodput=130)
    assert p.check(85) is None and p.log[-1].kind == "keep"


def test_prewarms_on_a_rising_trend() -> None:
    """Demand still fits today's replicas but is climbing: ask for one before the peak."""
    p = Planner({"m": 1.0}, config=PlannerConfig(window_s=10, lead_s=40, target_utilisation=0.5, cooldown_s=0),
                gpu_budget={"a": 16}, gpus_per_replica={"m": 2})
    placement = {("a", "m"): 2}
    t = 0.0
    while t < 40:
        p.record_demand("a", "m", 0.02 * t)  # grows by 0.02 work-s/s every second
        t += 1
        p.wanted(t)
    rate = p._demand[("a", "m")]
    assert rate.value / 0.5 <= 2  # today's demand fits the two replicas...
    assert p.wanted(40)[("a", "m")] > 2  # ...the demand 40 s ahead does not
    assert p.plan(placement, 40) == Move("m", None, "a")  # free GPUs: add, nothing to take from


def test_respects_gpu_budget() -> None:
    p = Planner({"m": 1.0}, gpu_budget={"a": 4}, gpus_per_replica={"m": 2}, config=CFG)
    feed(p, 0, 60, {"a": 3.9})
    assert p.plan({("a", "m"): 2}, 60) is None  # wants more, but the site's 4 GPUs are in use


def test_planner_for_a_fleet_file_takes_its_tuning_and_gpu_budgets() -> None:
    fleet = load_fleet_file(Path(__file__).with_name("fleet_planner.yaml"))
    p = planner_for(fleet, DemandModel(fleet), window_s=99.0, cooldown_s=7.0)
    assert p.config.window_s == 2 and p.config.cooldown_s == 1  # the file wins over the defaults given
    assert p.config.block_s == PlannerConfig().block_s  # what neither sets keeps the planner's default
    assert p.gpu_budget == {} and p.gpus_per_replica == {"llama-3.1-8b": 1}
    data = fleet.model_dump(exclude_none=True)
    data["sites"][0]["gpus"] = 4
    data["deployments"][0]["tp"] = 2
    fleet = parse_fleet(data, "f.yaml")
    p = planner_for(fleet, DemandModel(fleet))
    assert p.gpu_budget == {"a": 4} and p.gpus_per_replica == {"llama-3.1-8b": 2}
    data["planner"]["rollback_drop"] = 1.5
    with pytest.raises(FleetConfigError, match="planner.rollback_drop"):
        parse_fleet(data, "f.yaml")


def test_demand_is_engine_work_booked_to_the_nearest_serving_site() -> None:
    d = DemandModel(load_fleet_file(Path(__file__).with_name("fleet_3sites.yaml")))
    assert d.home("us-east", "llama-3.1-8b") == "use1" and d.home("eu-west", "llama-3.1-8b") == "euw1"
    assert d.home(None, "llama-3.1-8b") == "use1"  # the fleet's entry region
    short, long_prompt, long_output = (d.work_s("llama-3.1-8b", 100, 10), d.work_s("llama-3.1-8b", 8000, 10),
                                       d.work_s("llama-3.1-8b", 100, 1000))
    assert 0 < short < long_prompt and short < long_output
    # 8k tokens of prefill on one H100 take a good part of a second, not microseconds nor minutes
    assert 0.2 < long_prompt < 3.0


def test_a_site_busy_with_spilled_in_work_is_not_spare() -> None:
    """b's own clients are few, but b serves a's overflow: taking replicas from b would only
    move the queue, so no move."""
    p = Planner({"m": 1.0}, config=CFG)
    placement = {("a", "m"): 4, ("b", "m"): 4}
    t = 0.0
    while t < 60:
        p.record_demand("a", "m", 3.9)
        p.record_served("a", "m", 2.0)  # a runs what fits ...
        p.record_served("b", "m", 1.9)  # ... and spills the rest to b
        p.record_goodput(100.0, t)
        t += 1.0
        p.wanted(t)
    assert p.wanted(60)[("b", "m")] >= 4
    assert p.plan(placement, 60) is None


def test_replicas_do_not_move_to_much_slower_gpus() -> None:
    def planner(min_speed_ratio: float) -> Planner:
        cfg = PlannerConfig(window_s=10, lead_s=10, target_utilisation=0.5, cooldown_s=30, watch_s=20,
                            min_speed_ratio=min_speed_ratio)
        return Planner({"m": 1.0}, config=cfg, replica_speed={("a", "m"): 0.4, ("b", "m"): 1.0})

    placement = {("a", "m"): 4, ("b", "m"): 4}
    p = planner(0.8)
    feed(p, 0, 60, {"a": 1.5, "b": 0.2})
    assert p.wanted(60)[("a", "m")] == 8  # a's slow replicas: twice as many for the same work
    assert p.plan(placement, 60) is None
    p = planner(0.0)  # speed-blind
    feed(p, 0, 60, {"a": 1.5, "b": 0.2})
    assert p.plan(placement, 60) == Move("m", "b", "a", 3)


def test_replica_speed_follows_each_sites_hardware() -> None:
    fleet = load_fleet_file(Path(__file__).parents[1] / "deploy" / "local" / "fleet.yaml")
    d = DemandModel(fleet)
    assert d.replica_speed("us-east-1", "llama-3.1-8b") == 1.0  # the model's first deployment: reference
    assert 0.3 < d.replica_speed("us-west-2", "llama-3.1-8b") < 0.7  # A100 vs H100
    assert d.replica_speed("eu-west-1", "llama-3.1-8b") > 1.0  # H200


def test_a_site_keeps_a_share_of_its_replicas() -> None:
    """keep_fraction: the quiet site keeps half of what the fleet file gives it, for the burst
    the demand average has not seen yet."""
    placement = {("a", "m"): 6, ("b", "m"): 6}
    cfg = PlannerConfig(window_s=10, lead_s=10, target_utilisation=0.5, cooldown_s=30, watch_s=20,
                        keep_fraction=0.5)
    p = Planner({"m": 1.0}, config=cfg, initial=dict(placement))
    feed(p, 0, 60, {"a": 5.9, "b": 0.2})
    assert p.plan(placement, 60) == Move("m", "b", "a", 3)
    assert p.plan({("a", "m"): 9, ("b", "m"): 3}, 200) is None  # b is at its floor


def test_live_replica_speed_counts_the_simulated_workers_time_scale() -> None:
    """A sim worker at time_scale 0.3 does 1/0.3 physical seconds of work per wall second."""
    fleet = load_fleet_file(Path(__file__).with_name("fleet_planner.yaml"))
    assert DemandModel(fleet).replica_speed("a", "llama-3.1-8b") == 1.0
    assert abs(DemandModel(fleet, wall_clock=True).replica_speed("a", "llama-3.1-8b") - 1 / 0.3) < 1e-9


def test_no_replicas_move_to_a_site_that_meets_its_slo_for_what_it_serves() -> None:
    """Under admission control the demand booked at arrival includes requests admission turns
    away whatever the site's size (deploy/scenarios/README.md: SLOMax rejected ~1,570 long
    prompts at east with 6 replicas and with 9). A site that serves what it gets within its SLO
    is not short: no move, until what it serves starts missing."""
    cfg = PlannerConfig(window_s=10, lead_s=10, target_utilisation=0.5, cooldown_s=30, watch_s=20,
                        settled_met_share=0.9)
    p = Planner({"m": 1.0}, config=cfg)
    placement = {("a", "m"): 4, ("b", "m"): 4}
    feed(p, 0, 60, {"a": 3.9, "b": 0.2})
    for k in range(20):  # 19 of 20 served at a met their SLO: 95% >= 90%
        p.record_verdict("a", "m", k != 0, 55 + k * 0.25)
    assert p.met_share(("a", "m"), 60) == 0.95
    assert p.plan(placement, 60) is None
    for k in range(20):  # now a misses: 19/40 met
        p.record_verdict("a", "m", False, 60 + k * 0.1)
    assert p.met_share(("a", "m"), 62) == 19 / 40
    move = p.plan(placement, 62)  # (demand has decayed a little since 60: fewer than 3)
    assert move is not None and (move.from_site, move.to_site) == ("b", "a")


def test_settled_sites_verdicts_age_out_and_the_gate_is_off_by_default() -> None:
    cfg = PlannerConfig(window_s=10, lead_s=10, target_utilisation=0.5, cooldown_s=30, watch_s=20,
                        settled_met_share=0.9)
    placement = {("a", "m"): 4, ("b", "m"): 4}
    p = Planner({"m": 1.0}, config=cfg)
    feed(p, 0, 60, {"a": 3.9, "b": 0.2})
    p.record_verdict("a", "m", True, 45)  # older than the window at 60: no verdict, demand decides
    assert p.met_share(("a", "m"), 60) is None
    assert p.plan(placement, 60) == Move("m", "b", "a", 3)
    off = Planner({"m": 1.0}, config=CFG)  # settled_met_share None: verdicts are kept but never gate
    feed(off, 0, 60, {"a": 3.9, "b": 0.2})
    off.record_verdict("a", "m", True, 59)
    assert off.plan(placement, 60) == Move("m", "b", "a", 3)


def test_a_settled_site_does_not_hide_another_short_one() -> None:
    """The most short site meets its SLO: the next short one still gets replicas."""
    cfg = PlannerConfig(window_s=10, lead_s=10, target_utilisation=0.5, cooldown_s=30, watch_s=20,
                        settled_met_share=0.9, keep_fraction=0)
    p = Planner({"m": 1.0}, config=cfg)
    placement = {("a", "m"): 2, ("b", "m"): 2, ("c", "m"): 6}
    feed(p, 0, 60, {"a": 3.9, "b": 2.4, "c": 0.2})  # a needs ~8, b ~5, c ~1
    p.record_verdict("a", "m", True, 59)
    p.record_verdict("b", "m", False, 59)
    move = p.plan(placement, 60)
    assert move is not None and (move.from_site, move.to_site) == ("c", "b")


def test_settled_met_share_is_read_from_the_planner_block() -> None:
    fleet = load_fleet_file(Path(__file__).resolve().parent.parent / "deploy" / "scenarios" / "demand-shift.yaml")
    assert planner_for(fleet, DemandModel(fleet)).config.settled_met_share == 0.9
    data = fleet.model_dump(exclude_none=True)
    data["planner"]["settled_met_share"] = 1.5
    with pytest.raises(FleetConfigError, match="planner.settled_met_share"):
        parse_fleet(data, "f.yaml")
