"""The pure placement cycle both the gateway and the simulator execute: demand booked with what
is known at arrival, goodput as the met share of requests that ended (from ledger-like
counts), make-before-break moves, timeouts, rollback and modes. No I/O, no clock: every
test drives `now` by hand."""

from __future__ import annotations

from pathlib import Path

from fleetcore.fleet_config import load_fleet_file
from fleetcore.types import RequestProfile
from fleetmind.demand import DemandModel
from fleetmind.placement_cycle import (
    DEFAULT_OUTPUT_TOKENS,
    Command,
    CycleSettings,
    PlacementCycle,
    Replica,
    booked_output,
    placement_cycle_for,
)
from fleetmind.planner import Move, Planner, PlannerConfig
from slomax.ledger import Cell

CONFIG = load_fleet_file(Path(__file__).with_name("fleet_planner.yaml"))
MODEL = "llama-3.1-8b"


def rep(iid: str, *, up: bool = True, draining: bool = False, inflight: int = 0) -> Replica:
    site = iid.split("/")[0]
    return Replica(iid, site, MODEL, up, draining, inflight == 0, inflight)


def make(**settings: float) -> PlacementCycle:
    return PlacementCycle(Planner(), DemandModel(CONFIG), CycleSettings(**settings))  # type: ignore[arg-type]


def kinds(c: PlacementCycle) -> list[tuple[str, str | None]]:
    return [(a.kind, a.instance) for a in c.actions]


def profile(max_tokens: int | None, region: str = "r-a") -> RequestProfile:
    return RequestProfile(request_id="q", model=MODEL, prompt_tokens=1000, max_tokens=max_tokens, client_region=region)


def test_booked_output_is_the_mean_capped_by_max_tokens() -> None:
    assert booked_output(256.0, None) == 256
    assert booked_output(256.0, 4000) == 256  # a generous budget is not a prediction
    assert booked_output(256.0, 16) == 16


def test_demand_is_booked_with_what_is_known_at_arrival_not_the_true_length() -> None:
    c = make()
    c.arrived(profile(max_tokens=10_000))
    booked = c.planner._demand[("a", MODEL)].pending
    assert booked == c.demand.work_s(MODEL, 1000, round(DEFAULT_OUTPUT_TOKENS))
    # completed requests teach the mean output (an EWMA), failed ones do not
    c.ended("a", MODEL, 1000, 2000, ok=True)
    c.ended("a", MODEL, 1000, 0, ok=False)
    assert c._mean_output[MODEL] == DEFAULT_OUTPUT_TOKENS + 0.05 * (2000 - DEFAULT_OUTPUT_TOKENS)
    assert c.planner._served[("a", MODEL)].pending == (c.demand.work_s(MODEL, 1000, 2000)
                                                      + c.demand.work_s(MODEL, 1000, 0))


def test_verdicts_reach_the_planner_per_site_and_gate_moves_toward_a_settled_site() -> None:
    placement, reps = {("a", MODEL): 1, ("b", MODEL): 2}, [rep("a/0"), rep("b/0"), rep("b/1")]

    def busy_a(gate: float | None) -> PlacementCycle:
        cfg = PlannerConfig(window_s=10, lead_s=0, cooldown_s=0, settled_met_share=gate)
        c = PlacementCycle(Planner({MODEL: 0.01}, config=cfg), DemandModel(CONFIG))
        c.arrived(profile(max_tokens=256))
        c.planner.wanted(0.0)  # a's demand rate starts its clock
        for _ in range(40):
            c.arrived(profile(max_tokens=256))  # home a (region r-a): a wants more than its 1
        c.judged("a", MODEL, True, 1.0)
        c.judged("b", MODEL, False, 1.0)
        return c

    c = busy_a(None)  # no gate: demand alone moves a replica b -> a
    assert [(x.kind, x.site) for x in c.cycle(2.0, placement, reps)] == [("start", "a")]
    c = busy_a(0.9)
    assert c.planner.met_share(("a", MODEL), 1.0) == 1.0 and c.planner.met_share(("b", MODEL), 1.0) == 0.0
    assert c.cycle(2.0, placement, reps) == []  # a serves what it gets within its SLO: not short
    c.judged("a", MODEL, False, 3.0)
    c.judged("a", MODEL, False, 3.0)  # 1 of 3 met
    assert [(x.kind, x.site) for x in c.cycle(4.0, placement, reps)] == [("start", "a")]


def test_goodput_is_the_met_share_of_requests_that_ended_since_the_last_cycle() -> None:
    c = make()
    c.goodput_from([Cell(completed=10, met_slo=10)])
    c.cycle(0.0, {}, [])
    c.goodput_from([Cell(completed=14, met_slo=12), Cell(rejected=3, cancelled=1, failed=2)])
    c.cycle(30.0, {}, [])
    c.cycle(60.0, {}, [])  # nothing ended since: no news is 1.0
    assert [g for _, g in c.planner._goodput] == [1.0, 0.2, 1.0]  # 2 met of 4 + 6 that ended


def test_a_move_starts_first_and_drains_the_least_busy_source_replica_once_the_new_one_is_up() -> None:
    c = make()
    reps = [rep("a/0"), rep("b/0", inflight=3), rep("b/1", inflight=1)]
    [start] = c.carry_out(Move(MODEL, "b", "a"), 0.0, reps)
    assert start == Command("start", f"{MODEL}: b -> a", "a", MODEL, step=start.step)
    assert c.started(start.step, "a/new", 1.0) == [] and c.busy
    reps.append(rep("a/new", up=False))
    assert c.advance(5.0, reps) == []  # still loading: the source keeps serving
    reps[-1] = rep("a/new")
    [drain] = c.advance(9.0, reps)
    assert (drain.kind, drain.instance_id) == ("drain", "b/1")
    reps[2] = rep("b/1", draining=True, inflight=1)
    assert c.advance(10.0, reps) == []  # draining with a request in flight
    reps[2] = rep("b/1", draining=True)
    [stop] = c.advance(12.0, reps)
    assert (stop.kind, stop.instance_id) == ("stop", "b/1")
    c.stopped("b/1", 13.0)
    assert kinds(c) == [("start", "a/new"), ("ready", "a/new"), ("drain", "b/1"), ("stop", "b/1")]
    assert "ready after 8.0 s" in c.actions[1].detail and "drained in 3.0 s" in c.actions[3].detail
    assert not c.busy


def test_a_busy_drain_is_stopped_at_its_timeout() -> None:
    c = make(drain_timeout_s=60)
    [drain] = c.carry_out(Move(MODEL, "b", None), 0.0, [rep("b/0", inflight=2)])
    busy = [rep("b/0", draining=True, inflight=2)]
    assert c.next_due() == 60.0 and c.advance(59.0, busy) == []
    [stop] = c.advance(60.0, busy)
    assert stop.instance_id == "b/0"
    c.stopped("b/0", 60.0)
    assert "timed out with requests in flight" in c.actions[-1].detail


def test_a_replica_that_never_gets_up_is_stopped_and_the_source_keeps_its_own() -> None:
    c = make(ready_timeout_s=100)
    [start] = c.carry_out(Move(MODEL, "b", "a"), 0.0, [rep("b/0")])
    c.started(start.step, "a/new", 0.0)
    reps = [rep("b/0"), rep("a/new", up=False)]
    assert c.advance(99.0, reps) == []
    [stop] = c.advance(100.0, reps)
    assert (stop.kind, stop.instance_id) == ("stop", "a/new")
    c.stopped("a/new", 101.0)
    assert [k for k, _ in kinds(c)] == ["start", "failed", "stop"] and not c.busy


def test_a_start_that_fails_drops_the_rest_of_the_move_and_the_planner_is_told() -> None:
    c = make()
    [start] = c.carry_out(Move(MODEL, "b", "a", 3), 0.0, [rep("b/0"), rep("b/1"), rep("b/2")])
    [second] = c.started(start.step, "a/new1", 0.0)  # starts go one after the other
    assert c.start_failed(second.step, 0.0, "no free GPUs") == []
    assert [k for k, _ in kinds(c)] == ["start", "failed"] and not c._starting


def test_a_planned_move_is_watched_from_when_it_takes_effect() -> None:
    """Make-before-break: until the new replicas are up nothing has changed, so the watch (and
    its baseline) starts when they are, and no other move is planned meanwhile."""
    planner = Planner(config=PlannerConfig(window_s=1, lead_s=0, target_utilisation=0.1, cooldown_s=0))
    c = PlacementCycle(planner, DemandModel(CONFIG))
    placement = {("a", MODEL): 1, ("b", MODEL): 3}
    reps = [rep("a/0"), rep("b/0"), rep("b/1"), rep("b/2")]
    cmds: list[Command] = []
    for t in range(5):
        planner.record_demand("a", MODEL, 5.0)
        planner.record_served("b", MODEL, 0.0)
        cmds += c.cycle(float(t), placement, reps)
        if cmds:
            break
    assert [e.kind for e in planner.log] == ["plan"]  # not applied before the executor answers
    assert c.cycle(10.0, placement, reps) == []  # one change at a time while starts are unanswered
    more = c.started(cmds[0].step, "a/new1", 10.0)
    c.start_failed(more[0].step, 10.0, "no free GPUs")
    assert [e.kind for e in planner.log] == ["plan"]  # a/new1 is still loading
    reps.append(rep("a/new1", up=False))
    assert c.cycle(20.0, placement, reps) == [] and [e.kind for e in planner.log] == ["plan"]
    reps[-1] = rep("a/new1")
    done = c.advance(25.0, reps)
    assert [x.kind for x in done] == ["drain", "stop"]  # an idle source replica stops at once
    assert [e.kind for e in planner.log] == ["plan", "apply"]
    assert planner._watch is not None and planner._watch.started == 25.0


def test_a_move_that_cannot_start_at_all_is_advised_not_watched() -> None:
    planner = Planner(config=PlannerConfig(window_s=1, lead_s=0, target_utilisation=0.1))
    c = PlacementCycle(planner, DemandModel(CONFIG))
    for t in range(5):
        planner.record_demand("a", MODEL, 5.0)
        cmds = c.cycle(float(t), {("a", MODEL): 1, ("b", MODEL): 3}, [])
        if cmds:
            break
    c.start_failed(cmds[0].step, 5.0, "nowhere to start it", skipped=True)
    assert [e.kind for e in planner.log] == ["plan", "advise"] and planner._watch is None
    assert c.actions[-1].kind == "skipped"


def test_a_rollback_drains_the_still_loading_replica_first() -> None:
    c = make()
    [start] = c.carry_out(Move(MODEL, "b", "a"), 0.0, [rep("a/0"), rep("b/0")])
    c.started(start.step, "a/new", 0.0)
    [drain] = c.carry_out(Move(MODEL, "a", None), 1.0, [rep("a/0", inflight=0), rep("a/new", up=False),
                                                        rep("b/0")])
    assert drain.instance_id == "a/new"  # not serving yet: the cheapest to give back
    assert c.advance(2.0, [rep("a/0"), rep("a/new", draining=True), rep("b/0")])[0].kind == "stop"


def test_advise_and_off_modes() -> None:
    planner = Planner(config=PlannerConfig(window_s=1, lead_s=0, target_utilisation=0.1, cooldown_s=0))
    c = PlacementCycle(planner, DemandModel(CONFIG), CycleSettings(mode="advise"))
    for t in range(5):
        planner.record_demand("a", MODEL, 5.0)
        assert c.cycle(float(t), {("a", MODEL): 1, ("b", MODEL): 3}, []) == []
    assert "advise" in [e.kind for e in planner.log]
    c.set_mode("off", "ops", 6.0)
    n = len(planner.log)
    planner.record_demand("a", MODEL, 5.0)
    assert c.cycle(7.0, {("a", MODEL): 1, ("b", MODEL): 3}, []) == [] and len(planner.log) == n
    assert c.actions[-1].kind == "mode" and c.actions[-1].detail == "advise -> off by ops"


def test_timings_come_from_the_fleet_files_planner_block() -> None:
    c = placement_cycle_for(CONFIG, DemandModel(CONFIG))
    p = CONFIG.planner
    assert (c.settings.cycle_s, c.settings.drain_timeout_s, c.settings.ready_timeout_s) == \
        (p.cycle_s, p.drain_timeout_s, p.ready_timeout_s) == (0.5, 30, 20)
    assert (c.planner.config.cooldown_s, c.planner.config.watch_s, c.planner.config.rollback_drop) == (1, 3, 0.5)


def test_a_slow_start_keeps_the_goodput_baseline_from_before_the_move() -> None:
    """Applied only when the new replica is up, which may be later than the planner's window:
    the baseline is still the last level seen (0 would disable the rollback)."""
    planner = Planner(config=PlannerConfig(window_s=2, watch_s=3, rollback_drop=0.5))
    c = PlacementCycle(planner, DemandModel(CONFIG))
    c.goodput_from([Cell(completed=10, met_slo=9)])
    c.cycle(0.0, {}, [])
    c.goodput_from([Cell(completed=20, met_slo=18)])
    c.cycle(1.0, {}, [])  # 0.9 met
    [start] = c.carry_out(Move(MODEL, "b", "a"), 1.0, [rep("b/0")])
    c._starting[start.step].plan = True  # as if planned this cycle
    c.started(start.step, "a/new", 2.0)
    c.advance(6.0, [rep("b/0"), rep("a/new")])  # up 4 s later, longer than the window
    assert planner.log[-1].kind == "apply" and planner.log[-1].reason == "goodput before: 0.90"
