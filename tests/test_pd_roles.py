"""FleetMind's elastic P/D role controller (fleetmind/pd_roles.py): hysteresis, drain, rollback."""

from __future__ import annotations

from fleetmind.pd_roles import PDRoleController, PDRolesConfig, RoleCommand, RoleInstance, SLOWindow

CFG = PDRolesConfig(margin=0.05, streak=2, min_samples=20, cooldown_s=60, drain_timeout_s=100, watch_s=60,
                    rollback_drop=0.1, block_s=600, min_per_role=1, max_step=4,
                    gradual=False,  # the drain path; gradual flips: the tests at the end
                    urgent_kv=False, min_prefill=None,  # the rules without urgency: the last tests
                    start_colocated=False)  # from the fleet file's roles: the start, the tests at the end


def fleet(roles: dict[str, str], busy: set[str] = frozenset(), draining: set[str] = frozenset()) -> list[RoleInstance]:
    return [RoleInstance(i, r, i in draining, i not in busy, 3 if i in busy else 0)  # type: ignore[arg-type]
            for i, r in sorted(roles.items())]


TTFT = SLOWindow(ended=100, met=50, ttft_missed=40, tpot_missed=5)
TPOT = SLOWindow(ended=100, met=50, ttft_missed=5, tpot_missed=40)
CALM = SLOWindow(ended=100, met=90, ttft_missed=5, tpot_missed=6)
ROLES = {"p0": "prefill", "d0": "decode", "d1": "decode", "d2": "decode"}


def test_ttft_pressure_drains_the_least_loaded_decode_instance_after_a_streak() -> None:
    c = PDRoleController(CFG)
    insts = fleet(ROLES, busy={"d0", "d2"})
    assert c.cycle(0, insts, TTFT) == []  # one cycle of pressure is not enough (hysteresis)
    assert c.cycle(30, insts, TTFT) == [RoleCommand("drain", "d1")]
    assert c.log[-1].kind == "drain" and "TTFT pressure" in c.log[-1].reason


def test_small_differences_and_few_samples_do_nothing() -> None:
    c = PDRoleController(CFG)
    insts = fleet(ROLES)
    for t in range(0, 600, 30):
        assert c.cycle(t, insts, CALM) == []
        assert c.cycle(t + 15, insts, SLOWindow(ended=10, met=0, ttft_missed=10, tpot_missed=0)) == []
    assert c.log == []


def test_the_switch_waits_for_the_drain_and_gives_up_after_its_timeout() -> None:
    c = PDRoleController(CFG)
    c.cycle(0, fleet(ROLES), TPOT)
    assert c.cycle(30, fleet(ROLES), TPOT) == []
    # TPOT pressure wants a decode instance, but the prefill pool is at its minimum (one): nothing
    assert c.log == []
    roles = {**ROLES, "p1": "prefill"}
    c = PDRoleController(CFG)
    c.cycle(0, fleet(roles), TPOT)
    assert c.cycle(30, fleet(roles), TPOT) == [RoleCommand("drain", "p0")]
    busy = fleet(roles, busy={"p0"}, draining={"p0"})
    assert c.cycle(60, busy, TPOT) == []  # still busy: not switched under its requests
    assert c.cycle(90, fleet(roles, draining={"p0"}), TPOT) == [RoleCommand("set_role", "p0", "decode")]
    # a second flip: drained but never idle -> back to its old role after drain_timeout_s
    c = PDRoleController(CFG)
    c.cycle(0, fleet(roles), TPOT)
    c.cycle(30, fleet(roles), TPOT)
    assert c.cycle(100, busy, TPOT) == []
    assert c.cycle(131, busy, TPOT) == [RoleCommand("set_role", "p0", "prefill")]
    assert c.log[-1].kind == "abandon"


def test_goodput_drop_after_a_flip_rolls_it_back_and_blocks_that_direction() -> None:
    c = PDRoleController(CFG)
    good = SLOWindow(ended=100, met=60, ttft_missed=35, tpot_missed=5)
    c.cycle(0, fleet(ROLES), good)
    c.cycle(30, fleet(ROLES), good)  # drain d0 (all idle: the smallest id)
    assert c.cycle(60, fleet(ROLES, draining={"d0"}), good) == [RoleCommand("set_role", "d0", "prefill")]
    flipped = {**ROLES, "d0": "prefill"}
    worse = SLOWindow(ended=100, met=20, ttft_missed=10, tpot_missed=70)  # overshot: TPOT pressure now
    assert c.cycle(90, fleet(flipped), worse) == []  # watching
    assert c.cycle(120, fleet(flipped), worse) == [RoleCommand("drain", "d0")]
    assert c.log[-1].kind == "rollback"
    assert c.cycle(150, fleet(flipped, draining={"d0"}), worse) == [RoleCommand("set_role", "d0", "decode")]
    # TTFT pressure persists, but decode -> prefill is blocked for block_s
    for t in range(180, 700, 30):
        assert c.cycle(t, fleet(ROLES), TTFT) == []
    assert c.cycle(720, fleet(ROLES), TTFT) == [RoleCommand("drain", "d0")]  # 600 s after the rollback


def test_a_flip_that_helps_is_kept_and_the_next_waits_for_the_cooldown() -> None:
    c = PDRoleController(CFG)
    c.cycle(0, fleet(ROLES), TTFT)
    c.cycle(30, fleet(ROLES), TTFT)
    c.cycle(60, fleet(ROLES, draining={"d0"}), TTFT)
    flipped = {**ROLES, "d0": "prefill"}
    better = SLOWindow(ended=100, met=80, ttft_missed=15, tpot_missed=5)
    c.cycle(90, fleet(flipped), better)
    assert c.cycle(120, fleet(flipped), better) == [] and c.log[-1].kind == "keep"
    assert c.cycle(150, fleet(flipped), TTFT) == []  # cooldown (60 s from 120)
    assert c.cycle(180, fleet(flipped), TTFT) == [RoleCommand("drain", "d1")]


def test_no_verdict_on_a_flip_until_enough_requests_ended_after_it() -> None:
    c = PDRoleController(CFG)
    c.cycle(0, fleet(ROLES), TTFT)
    c.cycle(30, fleet(ROLES), TTFT)
    c.cycle(60, fleet(ROLES, draining={"d0"}), TTFT)
    flipped = {**ROLES, "d0": "prefill"}
    quiet = SLOWindow(ended=3, met=0, ttft_missed=3, tpot_missed=0)  # the trace's tail, say
    for t in range(90, 270, 30):  # six windows, 18 requests: fewer than min_samples
        assert c.cycle(t, fleet(flipped), quiet) == []
    assert c.log[-1].kind == "flip"  # neither kept nor rolled back yet
    assert c.cycle(270, fleet(flipped), quiet) == [RoleCommand("drain", "d0")]  # 21: judged (and worse)


def test_strong_pressure_moves_several_instances_and_a_stuck_one_stays() -> None:
    roles = {"p0": "prefill", **{f"d{k}": "decode" for k in range(10)}}
    c = PDRoleController(CFG)
    c.cycle(0, fleet(roles), TTFT)
    cmds = c.cycle(30, fleet(roles, busy={"d0"}), TTFT)  # 35% of 10 instances: 4 (max_step)
    assert cmds == [RoleCommand("drain", i) for i in ("d1", "d2", "d3", "d4")]
    draining = {"d1", "d2", "d3", "d4"}
    assert c.cycle(60, fleet(roles, busy={"d4"}, draining=draining), TTFT) == []  # d4 still busy
    assert c.cycle(130, fleet(roles, busy={"d4"}, draining=draining), TTFT) == [
        RoleCommand("set_role", "d1", "prefill"), RoleCommand("set_role", "d2", "prefill"),
        RoleCommand("set_role", "d3", "prefill"), RoleCommand("set_role", "d4", "decode")]
    assert [e.kind for e in c.log] == ["drain", "abandon", "flip"]


def test_ttft_misses_from_prefills_waiting_for_decode_kv_ask_for_decode_instances() -> None:
    roles = {"p0": "prefill", "p1": "prefill", "p2": "prefill", "d0": "decode"}
    blocked = SLOWindow(ended=100, met=40, ttft_missed=50, tpot_missed=5, decode_blocked=30)
    c = PDRoleController(CFG)
    c.cycle(0, fleet(roles), blocked)
    assert c.cycle(30, fleet(roles, busy={"p0"}), blocked) == [RoleCommand("drain", "p1")]  # 30% of 3: 1
    assert "decode KV pressure" in c.log[-1].reason


def test_a_pool_nearly_out_of_kv_gives_no_instance_up_and_a_rollback_waits_for_its_drain() -> None:
    full = [RoleInstance(i, r, False, True, 0, 0.9 if r == "decode" else 0.1)  # type: ignore[arg-type]
            for i, r in sorted(ROLES.items())]
    c = PDRoleController(CFG)
    for t in range(0, 300, 30):
        assert c.cycle(t, full, TTFT) == []  # TTFT pressure, but the decode pool's KV is 90% full
    c = PDRoleController(CFG)
    good = SLOWindow(ended=100, met=60, ttft_missed=35, tpot_missed=5)
    c.cycle(0, fleet(ROLES), good)
    c.cycle(30, fleet(ROLES), good)
    c.cycle(60, fleet(ROLES, draining={"d0"}), good)
    flipped = {**ROLES, "d0": "prefill"}
    worse = SLOWindow(ended=100, met=20, ttft_missed=10, tpot_missed=70)  # overshot: TPOT pressure now
    c.cycle(90, fleet(flipped), worse)
    assert c.cycle(120, fleet(flipped), worse) == [RoleCommand("drain", "d0")]  # rollback
    stuck = fleet(flipped, busy={"d0"}, draining={"d0"})
    for t in range(150, 600, 30):  # far past drain_timeout_s: a rollback is not given up
        assert c.cycle(t, stuck, worse) == []
    assert c.cycle(600, fleet(flipped, draining={"d0"}), worse) == [RoleCommand("set_role", "d0", "decode")]


GRADUAL = PDRolesConfig(margin=0.05, streak=2, min_samples=20, cooldown_s=60, watch_s=60, rollback_drop=0.1,
                        block_s=600, min_per_role=1, max_step=4, decode_kv_high=0.5, kv_band=0.1,
                        urgent_kv=False, min_prefill=None, start_colocated=False)


def kv_fleet(roles: dict[str, str], decode_kv: float, busy: set[str] = frozenset()) -> list[RoleInstance]:
    return [RoleInstance(i, r, False, i not in busy, 3 if i in busy else 0,  # type: ignore[arg-type]
                         decode_kv if r == "decode" else 0.1) for i, r in sorted(roles.items())]


def test_a_gradual_flip_switches_at_once_even_with_work_in_flight() -> None:
    c = PDRoleController(GRADUAL)
    roles = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}
    busy = kv_fleet(roles, 0.2, busy={"p0", "p1"})  # both prefill instances still busy
    assert c.cycle(0, busy, TPOT) == []
    assert c.cycle(30, busy, TPOT) == [RoleCommand("set_role", "p0", "decode")]  # no drain, no wait
    assert c.log[-1].kind == "flip" and "gradual" in c.log[-1].reason


def test_decode_kv_above_the_mark_asks_for_decode_and_holds_ttft_moves_back() -> None:
    roles = {"p0": "prefill", "p1": "prefill", "p2": "prefill", "d0": "decode", "d1": "decode"}
    c = PDRoleController(GRADUAL)
    # TTFT misses dominate, but the decode pool's KV is 75% used: its memory is the bound
    c.cycle(0, kv_fleet(roles, 0.75), TTFT)
    cmds = c.cycle(30, kv_fleet(roles, 0.75), TTFT)
    assert cmds and all(x.role == "decode" and x.instance_id.startswith("p") for x in cmds)
    assert "decode KV pressure" in c.log[-1].reason
    # TTFT pressure with decode KV inside the band (0.4-0.5): no move either way
    c = PDRoleController(GRADUAL)
    for t in range(0, 300, 30):
        assert c.cycle(t, kv_fleet(roles, 0.45), TTFT) == []
    # ... and below it: a decode instance goes to prefill
    c = PDRoleController(GRADUAL)
    c.cycle(0, kv_fleet(roles, 0.2), TTFT)
    assert [x.role for x in c.cycle(30, kv_fleet(roles, 0.2), TTFT)] == ["prefill"]


def test_a_goodput_drop_while_the_same_pressure_persists_keeps_the_move() -> None:
    roles = {"p0": "prefill", "p1": "prefill", "p2": "prefill", "d0": "decode", "d1": "decode"}
    c = PDRoleController(GRADUAL)
    good = SLOWindow(ended=100, met=60, ttft_missed=30, tpot_missed=10)
    c.cycle(0, kv_fleet(roles, 0.7), good)
    moved = c.cycle(30, kv_fleet(roles, 0.7), good)
    assert moved
    worse = SLOWindow(ended=100, met=20, ttft_missed=60, tpot_missed=20)
    flipped = {**roles, **{x.instance_id: "decode" for x in moved}}
    assert c.cycle(60, kv_fleet(flipped, 0.7), worse) == []
    assert c.cycle(90, kv_fleet(flipped, 0.7), worse) == []  # decode KV still high: the load, kept
    assert c.log[-1].kind == "keep"
    # the same drop once the decode pool has KV to spare (the move overshot): rolled back at once
    c = PDRoleController(GRADUAL)
    c.cycle(0, kv_fleet(roles, 0.7), good)
    moved = c.cycle(30, kv_fleet(roles, 0.7), good)
    flipped = {**roles, **{x.instance_id: "decode" for x in moved}}
    c.cycle(60, kv_fleet(flipped, 0.2), worse)
    back = c.cycle(90, kv_fleet(flipped, 0.2), worse)
    assert back == [RoleCommand("set_role", x.instance_id, "prefill") for x in moved]
    assert c.log[-1].kind == "rollback"


# --- urgency: decode KV that fills moves prefill instances at once, in proportion -------

URGENT = PDRolesConfig(margin=0.05, streak=2, min_samples=20, cooldown_s=60, watch_s=60, rollback_drop=0.1,
                       block_s=600, min_per_role=1, max_step=4, decode_kv_high=0.5, kv_band=0.1,
                       kv_horizon_s=30.0, urgent_whole_pool=False,  # urgent_kv, min_prefill=0: defaults
                       start_colocated=False)
# the default urgent move: the whole movable prefill pool at once
WHOLE = PDRolesConfig(margin=0.05, streak=2, min_samples=20, cooldown_s=60, watch_s=60, rollback_drop=0.1,
                      block_s=600, min_per_role=1, max_step=4, decode_kv_high=0.5, kv_band=0.1,
                      kv_horizon_s=30.0, start_colocated=False)
FEW = SLOWindow(ended=3, met=1, ttft_missed=1, tpot_missed=1)  # too few ended for a verdict
HALVES = {**{f"p{k:02d}": "prefill" for k in range(16)}, **{f"d{k:02d}": "decode" for k in range(16)}}


def test_urgent_decode_kv_moves_as_many_prefill_instances_as_bring_it_back_and_may_empty_the_pool() -> None:
    # First cycle, three requests ended, decode KV 90%: no streak, no sample minimum. Moving k of
    # the 16 prefill instances (KV 10%) brings the 16 decode ones' mean to (16*0.9 + 0.1k)/(16 + k)
    # <= 0.5 for k >= 16: the whole prefill pool (min_prefill 0), past max_step (4).
    c = PDRoleController(URGENT)
    cmds = c.cycle(15, kv_fleet(HALVES, 0.9), FEW)
    assert cmds == [RoleCommand("set_role", f"p{k:02d}", "decode") for k in range(16)]
    assert "decode KV urgent" in c.log[-1].reason
    # 62% used: k >= 16 * 0.12 / 0.4 = 4.8
    c = PDRoleController(URGENT)
    assert len(c.cycle(15, kv_fleet(HALVES, 0.62), FEW)) == 5
    # without urgency (the rules before): nothing on the first cycle, one max_step after a streak
    c = PDRoleController(GRADUAL)
    assert c.cycle(15, kv_fleet(HALVES, 0.9), FEW) == []
    assert c.cycle(30, kv_fleet(HALVES, 0.9), TPOT) == []
    assert len(c.cycle(45, kv_fleet(HALVES, 0.9), TPOT)) == 4


def test_an_urgent_move_takes_the_whole_prefill_pool_by_default() -> None:
    # 62% used: the proportional step would move 5 (the test above); the default moves all 16
    c = PDRoleController(WHOLE)
    cmds = c.cycle(15, kv_fleet(HALVES, 0.62), FEW)
    assert cmds == [RoleCommand("set_role", f"p{k:02d}", "decode") for k in range(16)]
    assert "decode KV urgent" in c.log[-1].reason
    # below the urgent mark (and no rate yet) nothing moves, whole pool or not
    assert PDRoleController(WHOLE).cycle(15, kv_fleet(HALVES, 0.55), FEW) == []
    # a floor of prefill instances still holds: only the ones above it go
    from dataclasses import replace

    c = PDRoleController(replace(WHOLE, min_prefill=4))
    assert len(c.cycle(15, kv_fleet(HALVES, 0.62), FEW)) == 12


def test_decode_kv_rising_fast_is_urgent_before_it_reaches_the_mark() -> None:
    c = PDRoleController(URGENT)
    assert c.cycle(15, kv_fleet(HALVES, 0.2), FEW) == []  # 20%, no rate yet
    # 45% at 30 s: +1.67%/s, 95% in 30 s: urgent now, sized on the projection
    cmds = c.cycle(30, kv_fleet(HALVES, 0.45), FEW)
    assert cmds and all(x.role == "decode" and x.instance_id.startswith("p") for x in cmds)
    assert len(cmds) == 16 and "95% ahead" in c.log[-1].reason
    # the same level reached slowly is not urgent
    c = PDRoleController(URGENT)
    c.cycle(15, kv_fleet(HALVES, 0.44), FEW)
    assert c.cycle(30, kv_fleet(HALVES, 0.45), FEW) == []


def test_an_urgent_move_under_watch_is_extended_and_rolled_back_whole() -> None:
    from dataclasses import replace

    c = PDRoleController(replace(URGENT, kv_horizon_s=0.0))  # levels only: no projection
    assert c.cycle(0, kv_fleet(HALVES, 0.3), CALM) == []
    assert c.cycle(15, kv_fleet(HALVES, 0.3), CALM) == []
    first = c.cycle(30, kv_fleet(HALVES, 0.62), FEW)
    assert len(first) == 5
    moved = {x.instance_id for x in first}
    roles = {**HALVES, **{i: "decode" for i in moved}}
    # 20 s later (watch_s 60) the decode pool is at 70%: more follow at once
    more = c.cycle(50, kv_fleet(roles, 0.7), FEW)
    assert more and not moved & {x.instance_id for x in more} and "extends the move" in c.log[-1].reason
    roles.update({x.instance_id: "decode" for x in more})
    # judged as one move: goodput fell and the pressure is gone (decode KV 20%) -> all back
    worse = SLOWindow(ended=100, met=5, ttft_missed=90, tpot_missed=5)
    assert c.cycle(80, kv_fleet(roles, 0.2), worse) == []
    back = c.cycle(95, kv_fleet(roles, 0.2), worse)
    assert {x.instance_id for x in back} == moved | {x.instance_id for x in more}
    assert all(x.role == "prefill" for x in back) and c.log[-1].kind == "rollback"
    # and the direction is blocked: urgency does not override a rollback's block
    assert c.cycle(110, kv_fleet(HALVES, 0.9), FEW) == []


# --- the start: elastic begins as the colocated fleet and grows a prefill pool on pressure --

START = PDRolesConfig(margin=0.05, streak=2, min_samples=20, cooldown_s=60, watch_s=60, rollback_drop=0.1,
                      block_s=600, min_per_role=1, max_step=4, decode_kv_high=0.5, kv_band=0.1,
                      kv_horizon_s=30.0)  # start_colocated, urgent_kv, min_prefill=0, gradual: the defaults
NONE = SLOWindow(ended=0, met=0, ttft_missed=0, tpot_missed=0)
ALL_DECODE = {i: "decode" for i in HALVES}


def test_the_first_cycle_turns_the_whole_prefill_pool_decode_before_any_request_ended() -> None:
    assert PDRolesConfig().start_colocated
    c = PDRoleController(START)
    cmds = c.cycle(0, kv_fleet(HALVES, 0.0), NONE)
    assert cmds == [RoleCommand("set_role", f"p{k:02d}", "decode") for k in range(16)]
    assert c.log[-1].kind == "flip" and c.log[-1].reason.startswith("start colocated: 16 of 16")
    # not a move under watch: a calm colocated fleet stays as it is, nothing to roll back
    for t in range(2, 300, 2):
        assert c.cycle(t, kv_fleet(ALL_DECODE, 0.2), CALM) == []
    assert len(c.log) == 1
    # a floor of prefill instances is kept; the start is only the first cycle's
    from dataclasses import replace

    c = PDRoleController(replace(START, min_prefill=2))
    assert [x.instance_id for x in c.cycle(0, kv_fleet(HALVES, 0.0), NONE)] == [f"p{k:02d}" for k in range(14)]
    assert c.cycle(2, kv_fleet(HALVES, 0.0), NONE) == []
    # off: the fleet file's split, as before
    assert PDRoleController(replace(START, start_colocated=False)).cycle(0, kv_fleet(HALVES, 0.0), NONE) == []


def test_a_started_flip_drains_busy_prefill_instances_and_is_never_given_up_or_watched() -> None:
    from dataclasses import replace

    c = PDRoleController(replace(START, gradual=False, drain_timeout_s=10))
    roles = {"p0": "prefill", "p1": "prefill", "d0": "decode"}
    assert c.cycle(0, fleet(roles, busy={"p1"}), NONE) == [RoleCommand("drain", "p0"), RoleCommand("drain", "p1")]
    draining = fleet(roles, busy={"p1"}, draining={"p0", "p1"})
    assert c.cycle(30, draining, NONE) == []  # past drain_timeout_s, still waiting for p1
    done = c.cycle(60, fleet(roles, draining={"p0", "p1"}), NONE)
    assert done == [RoleCommand("set_role", "p0", "decode"), RoleCommand("set_role", "p1", "decode")]
    assert [e.kind for e in c.log] == ["drain", "flip"]
    worse = SLOWindow(ended=100, met=5, ttft_missed=5, tpot_missed=5)
    for t in range(62, 300, 2):  # goodput falls to nothing: still no rollback of the start
        assert c.cycle(t, fleet({"p0": "decode", "p1": "decode", "d0": "decode"}), worse) == []


def test_from_colocated_ttft_pressure_grows_a_prefill_pool_which_is_rolled_back_when_goodput_falls() -> None:
    c = PDRoleController(START)
    c.cycle(0, kv_fleet(HALVES, 0.0), NONE)
    good = SLOWindow(ended=100, met=60, ttft_missed=35, tpot_missed=5)
    for t in range(2, 62, 2):  # a minute of goodput at 30 met/s; TTFT misses, decode KV 20%
        assert c.cycle(t, kv_fleet(ALL_DECODE, 0.2), CALM) == []
    assert c.cycle(62, kv_fleet(ALL_DECODE, 0.2), good) == []  # one cycle is not a streak
    grown = c.cycle(64, kv_fleet(ALL_DECODE, 0.2), good)
    # max_step of the least loaded (all idle here: by id)
    assert grown == [RoleCommand("set_role", f"d{k:02d}", "prefill") for k in range(4)]
    assert "TTFT pressure" in c.log[-1].reason
    roles = {**ALL_DECODE, **{x.instance_id: "prefill" for x in grown}}
    # a minute later goodput has halved and the TTFT pressure is gone: back to colocated
    worse = SLOWindow(ended=100, met=30, ttft_missed=5, tpot_missed=5)
    back = []
    for t in range(66, 130, 2):
        back += c.cycle(t, kv_fleet(roles, 0.2), worse)
    assert back == [RoleCommand("set_role", x.instance_id, "decode") for x in grown]
    assert c.log[-1].kind == "rollback"
    # and that direction stays blocked (block_s) while the pressure comes back
    for t in range(130, 400, 2):
        assert c.cycle(t, kv_fleet(ALL_DECODE, 0.2), good) == []


# --- the back-off: no regrowth of a prefill pool the urgent decode-KV rule took back ---------

def test_after_an_urgent_take_back_no_prefill_growth_until_the_hold_off_and_the_kv_have_cleared() -> None:
    from dataclasses import replace

    cfg = replace(START, regrow_holdoff_s=100.0, regrow_holdoff_max_s=150.0, grow_kv_guard=False, cooldown_s=10)
    c = PDRoleController(cfg)
    c.cycle(0, kv_fleet(HALVES, 0.0), NONE)
    good = SLOWindow(ended=100, met=60, ttft_missed=35, tpot_missed=5)
    for t in range(2, 62, 2):
        c.cycle(t, kv_fleet(ALL_DECODE, 0.2), CALM)
    c.cycle(62, kv_fleet(ALL_DECODE, 0.2), good)
    grown = c.cycle(64, kv_fleet(ALL_DECODE, 0.2), good)
    assert len(grown) == 4 and all(x.role == "prefill" for x in grown)
    roles = {**ALL_DECODE, **{x.instance_id: "prefill" for x in grown}}
    for t in range(66, 126, 2):  # watched a minute, goodput held: kept
        assert c.cycle(t, kv_fleet(roles, 0.3), good) == []
    assert c.log[-1].kind == "keep"
    # decode KV jumps to 70%: the urgent rule takes the grown pool back, and holds growth 100 s
    back = c.cycle(126, kv_fleet(roles, 0.7), good)
    assert back == [RoleCommand("set_role", x.instance_id, "decode") for x in grown]
    assert "take-back 1: no prefill growth for 100 s" in c.log[-1].reason
    for t in range(128, 188, 2):  # its watch: goodput held, the move is kept
        assert c.cycle(t, kv_fleet(ALL_DECODE, 0.2), good) == []
    # TTFT pressure again, decode KV 20% (the growth rule's level): held until 226 s
    for t in range(188, 226, 2):
        assert c.cycle(t, kv_fleet(ALL_DECODE, 0.2), good) == []
    # and after it while the decode KV projected ahead has not cleared the mark less the band:
    # 20% -> 35% at 226 s is under 40% (the growth rule's level) but 80% ahead
    for t in range(226, 236, 2):
        assert c.cycle(t, kv_fleet(ALL_DECODE, 0.35), good) == []
    again = c.cycle(236, kv_fleet(ALL_DECODE, 0.35), good)  # flat for 10 s: 35% ahead, cleared
    assert len(again) == 4 and all(x.role == "prefill" for x in again)
    # a second take-back doubles the hold, up to regrow_holdoff_max_s
    roles = {**ALL_DECODE, **{x.instance_id: "prefill" for x in again}}
    for t in range(238, 298, 2):
        c.cycle(t, kv_fleet(roles, 0.3), good)
    assert c.cycle(298, kv_fleet(roles, 0.7), good)
    assert "take-back 2: no prefill growth for 150 s" in c.log[-1].reason
    # without the back-off the same run regrows at the first cycle the pressure rules allow
    c = PDRoleController(replace(cfg, regrow_holdoff_s=0.0))
    c.cycle(0, kv_fleet(HALVES, 0.0), NONE)
    for t in range(2, 62, 2):
        c.cycle(t, kv_fleet(ALL_DECODE, 0.2), CALM)
    c.cycle(62, kv_fleet(ALL_DECODE, 0.2), good)
    c.cycle(64, kv_fleet(ALL_DECODE, 0.2), good)
    for t in range(66, 126, 2):
        c.cycle(t, kv_fleet(roles, 0.3), good)
    assert c.cycle(126, kv_fleet(roles, 0.7), good)
    regrew = [t for t in range(128, 226, 2) if c.cycle(t, kv_fleet(ALL_DECODE, 0.2), good)]
    assert regrew and regrew[0] < 226


def test_a_prefill_growth_the_decode_kv_would_take_back_within_its_watch_is_cut_or_not_made() -> None:
    from dataclasses import replace

    cfg = replace(START, regrow_holdoff_s=0.0)  # watch_s 60, mark 50%, band 10%: the limit 40%
    good = SLOWindow(ended=100, met=60, ttft_missed=35, tpot_missed=5)

    def grow(kv_then: float, kv_now: float, guard: bool = True) -> list[RoleCommand]:
        c = PDRoleController(replace(cfg, grow_kv_guard=guard))
        c.cycle(0, kv_fleet(HALVES, 0.0), NONE)
        for t in range(2, 60, 2):  # calm, at kv_then until 52 s and kv_now from 54 s
            c.cycle(t, kv_fleet(ALL_DECODE, kv_then if t <= 52 else kv_now), CALM)
        assert c.cycle(60, kv_fleet(ALL_DECODE, kv_now), good) == []  # one cycle is not a streak
        return c.cycle(62, kv_fleet(ALL_DECODE, kv_now), good)  # rate over 52-62 s

    # flat at 20%: 32 -> 28 decode instances leave the mean at 20% (all alike): max_step, 4
    assert len(grow(0.2, 0.2)) == 4
    # 20% -> 30% at 54 s (+1%/s over the readings kv_rate_s old): 30% + 60% ahead
    # is far past 40% for any step: none, although the level alone allows it
    assert grow(0.2, 0.3) == []
    assert len(grow(0.2, 0.3, guard=False)) == 4
    # +0.05%/s at 30%: 30% + 32/(32 - k) * 3% < 40% for k <= 4
    assert len(grow(0.295, 0.3)) == 4
