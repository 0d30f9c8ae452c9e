"""The P/D decision's pricing of a local prefill's TPOT harm, the split demand it counts, the
elastic controller's growth from it, and the P/D fleet's token budget (issue 17, i17-tpot)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fleetcore.fleet_config import parse_fleet
from fleetcore.hardware import model
from fleetcore.interconnect import Link, kv_bytes
from fleetcore.types import InstanceSnapshot, RequestProfile
from fleetmind.pd_roles import PDRoleController, PDRolesConfig, RoleCommand, RoleInstance, SLOWindow
from fleetsim.disagg import pd_fleet
from fleetsim.simulator import fleet_instances
from tokenpilot.disagg import DisaggConfig, TokenPilotDisagg
from tokenpilot.priors import prior_from_physics
from tokenpilot.router import TokenPilot

BS = 16


class Links:
    """50 GB/s links, idle."""

    def __init__(self) -> None:
        self.link = Link(50e9, 1e-5)

    def predict_s(self, src: str, dst: str, tokens: int, now: float) -> float:
        return self.link.transfer_s(kv_bytes(model("llama-3.1-70b"), tokens))


def snap(iid: str, role: str, running: int = 0) -> InstanceSnapshot:
    return InstanceSnapshot(iid, "s", "m", "v1", f"sim://{iid}", role=role,  # type: ignore[arg-type]
                            num_running=running)


def pilot() -> TokenPilot:
    prior = prior_from_physics("llama-3.1-70b", "H200", 2)
    return TokenPilot(priors={i: prior for i in ("p0", "d0", "d1")}, seed=0)


def profile(rid: str, prompt: int, tag: str | None = None, out: int = 200) -> RequestProfile:
    return RequestProfile(rid, "m", prompt, tuple(hash((tag or rid, i)) for i in range(prompt // BS)), BS,
                          max_tokens=out)


# Llama-3.1-70B on 2 x H200: 40 streams of a 16k-token context each make a ~60 ms decode step,
# past the 50 ms TPOT budget, so a local prefill's compute stalls every one of them unabsorbed.
BUSY = 40


# --- the per-request pricing ----------------------------------------------------------------

def test_a_long_uncached_prompt_with_many_streams_near_the_tpot_budget_goes_to_a_prefill_instance() -> None:
    pool = [snap("p0", "prefill"), snap("d0", "decode", BUSY), snap("d1", "decode", BUSY)]
    d = TokenPilotDisagg(pilot()).decide(profile("a", 16000), pool, Links(), 0.0)
    assert d.split and d.prefill == "p0" and d.decode in ("d0", "d1")


def test_the_same_prompt_with_no_streams_running_stays_local_when_its_own_decode_is_priced_as_a_splits() -> None:
    pool = [snap("p0", "prefill"), snap("d0", "decode"), snap("d1", "decode")]
    d = TokenPilotDisagg(pilot(), DisaggConfig(local_decode_as_split=True)).decide(profile("a", 16000), pool,
                                                                                  Links(), 0.0)
    assert not d.split and d.decode in ("d0", "d1") and d.reason.startswith("local: predicted cost")
    # The default prices the local option's own decode with the duty of its own prefill, which a
    # split's decode does not carry: with nobody to stall, the prompt splits all the same.
    d = TokenPilotDisagg(pilot()).decide(profile("a", 16000), pool, Links(), 0.0)
    assert d.split
    # with many streams near the budget it splits either way
    busy = [snap("p0", "prefill"), snap("d0", "decode", BUSY), snap("d1", "decode", BUSY)]
    assert TokenPilotDisagg(pilot(), DisaggConfig(local_decode_as_split=True)).decide(
        profile("b", 16000), busy, Links(), 0.0).split


# --- split demand ------------------------------------------------------------------------------

def test_a_request_that_would_split_but_finds_no_prefill_instance_is_counted_as_unserved_demand() -> None:
    pd = TokenPilotDisagg(pilot())
    d = pd.decide(profile("a", 16000), [snap("d0", "decode", BUSY), snap("d1", "decode", BUSY)], Links(), 0.0)
    assert not d.split and d.reason == "local: no prefill instance"
    dm = pd.take_demand()
    assert (dm.placed, dm.starved) == (1, 1)
    # what a prefill instance would have run: the prompt's bare compute (16k tokens: ~1.8 s)
    assert dm.starved_prefill_s == pytest.approx(pd.router.prefill_compute_s("d0", 16000, 0), rel=1e-9)
    assert 1.0 < dm.starved_prefill_s < 3.0
    assert pd.take_demand().placed == 0  # read once


def test_no_demand_without_streams_to_stall_or_for_a_short_prompt() -> None:
    pd = TokenPilotDisagg(pilot())
    pd.decide(profile("a", 16000), [snap("d0", "decode"), snap("d1", "decode")], Links(), 0.0)
    pd.decide(profile("b", 64), [snap("d0", "decode", BUSY), snap("d1", "decode", BUSY)], Links(), 0.0)
    dm = pd.take_demand()
    assert (dm.placed, dm.starved, dm.starved_prefill_s) == (2, 0, 0.0)


def test_a_split_that_would_recompute_a_prefix_cached_where_it_decodes_is_no_demand() -> None:
    """An agent's next step: its long history is cached on the decode instance and on no prefill
    instance (there is none), so a split would recompute all of it to spare a short local prefill."""
    pd = TokenPilotDisagg(pilot())
    busy = [snap("d0", "decode", BUSY), snap("d1", "decode", BUSY)]
    pd.decide(profile("step1", 16000, tag="agent"), busy, Links(), 0.0)
    pd.take_demand()
    d = pd.decide(profile("step2", 16800, tag="agent"), busy, Links(), 1.0)
    assert not d.split and d.cached_tokens >= 15000
    assert pd.take_demand().starved == 0
    # counted where the recompute is allowed to be that large
    pd2 = TokenPilotDisagg(pilot(), replace(pd.config, demand_recompute=1e9))
    pd2.decide(profile("step1", 16000, tag="agent"), busy, Links(), 0.0)
    pd2.take_demand()
    pd2.decide(profile("step2", 16800, tag="agent"), busy, Links(), 1.0)
    assert pd2.take_demand().starved == 1


def test_a_split_counts_its_prefill_seconds_as_served_demand() -> None:
    pd = TokenPilotDisagg(pilot())
    pool = [snap("p0", "prefill"), snap("d0", "decode", BUSY), snap("d1", "decode", BUSY)]
    assert pd.decide(profile("a", 16000), pool, Links(), 0.0).split
    dm = pd.take_demand()
    assert dm.starved == 0 and dm.split_prefill_s == pytest.approx(pd.router.prefill_compute_s("p0", 16000, 0))


# --- the elastic controller's growth from split demand -----------------------------------------

CFG = PDRolesConfig(start_colocated=False, cycle_s=2.0, split_demand=True)
DECODE4 = [RoleInstance(f"d{i}", "decode", False, False, 5, 0.2) for i in range(4)]


def hungry(starved_s: float) -> SLOWindow:
    """2 s of placements, no request ended yet: 40 placed, 10 of them unserved split demand."""
    return SLOWindow(ended=0, met=0, ttft_missed=0, tpot_missed=0, placed=40, split_starved=10,
                     starved_prefill_s=starved_s)


def test_unserved_split_demand_grows_an_empty_prefill_pool_by_the_instances_it_lacks() -> None:
    c = PDRoleController(CFG)
    assert c.cycle(0.0, DECODE4, hungry(0.0)) == []
    assert c.cycle(2.0, DECODE4, hungry(3.0)) == []  # 1.5 instances' worth, once: the streak
    cmds = c.cycle(4.0, DECODE4, hungry(3.0))
    assert len(cmds) == 2 and all(x.kind == "set_role" and x.role == "prefill" for x in cmds)
    assert "split demand" in c.log[-1].reason
    # the same windows without the rule: nothing (no request ended, so no SLO pressure either)
    c = PDRoleController(replace(CFG, split_demand=False))
    assert [c.cycle(t, DECODE4, hungry(3.0)) for t in (0.0, 2.0, 4.0, 6.0)] == [[], [], [], []]


def test_split_demand_grows_nothing_while_the_decode_pool_has_no_kv_to_spare() -> None:
    full = [replace(i, kv_usage=0.45) for i in DECODE4]  # above decode_kv_high - kv_band
    c = PDRoleController(replace(CFG, urgent_kv=False))
    assert [c.cycle(t, full, hungry(3.0)) for t in (0.0, 2.0, 4.0, 6.0)] == [[], [], [], []]


def test_tpot_pressure_takes_no_instance_from_a_prefill_pool_its_splits_keep_busy() -> None:
    insts = [RoleInstance("p0", "prefill", False, False, 3, 0.1), RoleInstance("p1", "prefill", False, False, 3, 0.1),
             *DECODE4]
    cfg = replace(CFG, urgent_kv=False)

    def tpot(split_s: float) -> SLOWindow:
        return SLOWindow(ended=100, met=50, ttft_missed=5, tpot_missed=40, placed=40, split_prefill_s=split_s)

    c = PDRoleController(cfg)  # the splits ran 1.5 instances' worth of prefill: one instance is not enough
    assert [c.cycle(t, insts, tpot(3.0)) for t in (0.0, 2.0, 4.0, 6.0)] == [[], [], [], []]
    c = PDRoleController(cfg)  # an idle pool gives one up to TPOT pressure (after the streak)
    cmds = [c.cycle(t, insts, tpot(0.0)) for t in (0.0, 2.0, 4.0, 6.0)]
    assert [x for x in cmds if x] == [[RoleCommand("set_role", "p0", "decode")]] and "TPOT" in c.log[-1].reason


# --- the P/D fleet's token budget --------------------------------------------------------------

def test_p_d_modes_run_the_engines_at_the_fleet_files_p_d_token_budget_and_off_ignores_it() -> None:
    fleet = parse_fleet({
        "sites": [{"name": "s1", "region": "us-east", "jurisdiction": "us", "rtt_ms": {"us-east": 2}}],
        "models": [{"name": "m", "engine": {"spec": "llama-3.1-8b", "max_num_batched_tokens": 8192,
                                            "pd_max_num_batched_tokens": 2048}}],
        "deployments": [{"site": "s1", "model": "m", "instances": 2, "gpu": "H100",
                         "roles": {"prefill": 1, "decode": 1}}],
    })
    assert pd_fleet(fleet, "off") is fleet
    assert {i.engine.max_num_batched_tokens for i in fleet_instances(pd_fleet(fleet, "off"))} == {8192}
    for mode in ("static", "elastic", "dynamo_conditional", "llm_d_decider"):
        assert {i.engine.max_num_batched_tokens for i in fleet_instances(pd_fleet(fleet, mode))} == {2048}
    # unset: every mode runs the fleet as it is
    plain = parse_fleet({**fleet.model_dump(mode="json"), "models": [
        {"name": "m", "engine": {"spec": "llama-3.1-8b", "max_num_batched_tokens": 8192}}]})
    assert pd_fleet(plain, "elastic") is plain
