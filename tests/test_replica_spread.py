"""Replicas routing one pool pick apart (fleetcore.replica_spread), in the simulator and alone."""

from __future__ import annotations

import pytest

from fleetcore.replica_spread import ALONE, LANE_EVERY, ReplicaSlot, SpreadRouter, lanes, share, spread
from fleetcore.types import InstanceSnapshot, RequestProfile
from fleetsim.cli import make_policy
from fleetsim.replicas import ReplicatedRouter
from fleetsim.simulator import FleetSimulator, prepare
from tests.test_fleetsim import req, small_fleet


def _snaps(n: int, **kw) -> list[InstanceSnapshot]:
    return [InstanceSnapshot(instance_id=f"i{j}", site="s1", model="m", version="v", url=f"http://i{j}", **kw)
            for j in range(n)]


def _profile(rid: str, blocks: tuple[int, ...] = (), prompt: int = 2048) -> RequestProfile:
    return RequestProfile(request_id=rid, model="m", prompt_tokens=prompt, block_hashes=blocks, max_tokens=16)


def test_shares_split_the_serving_pool_between_the_replicas() -> None:
    pool = _snaps(10)
    pool[3] = InstanceSnapshot(instance_id="i3", site="s1", model="m", version="v", url="u", draining=True)
    parts = [{c.instance_id for c in share(ReplicaSlot(4, k), pool)} for k in range(4)]
    assert set().union(*parts) == {c.instance_id for c in pool} - {"i3"}  # every serving one, once
    assert sum(len(p) for p in parts) == 9
    assert {len(p) for p in parts} == {2, 3}
    with pytest.raises(ValueError):
        ReplicaSlot(2, 2)


def test_one_replica_routes_among_exactly_the_candidates_it_was_given() -> None:
    router = make_policy("tokenpilot", 0, small_fleet(instances=4))
    pool = _snaps(4)
    assert spread(router, ALONE, _profile("a"), pool, 0.0) is pool


def test_replicas_deciding_at_the_same_instant_pick_different_instances() -> None:
    # Seven requests at one instant, no shared prefix, four replicas that never hear of each other.
    # (Seven instances: a pool of LANE_EVERY or more has an interactive lane, where short prompts
    # are meant to meet: test_each_replica_keeps_an_interactive_lane_that_other_classes_stay_off.)
    fleet = small_fleet(instances=LANE_EVERY - 1)
    burst = [req(0.0, 3000, 32, [500 + i]) for i in range(LANE_EVERY - 1)]

    def instances(name: str, spread_on: bool) -> set[str]:
        routers = [make_policy(name, s, fleet) for s in range(4)]
        records = FleetSimulator(fleet, ReplicatedRouter(routers, sync_s=1000.0, spread=spread_on)) \
            .run(prepare(burst, fleet)).records
        return {r.instance for r in records}

    for name in ("tokenpilot", "dynamo_kv"):  # with a cost model and without
        herd, apart = instances(name, False), instances(name, True)
        assert len(apart) == LANE_EVERY - 1, (name, apart)
        assert len(herd) < LANE_EVERY - 1, (name, herd)


@pytest.mark.parametrize("name", ["tokenpilot", "sglang_cache_aware"])  # a cost model; a prefix index only
def test_the_share_gives_way_to_a_prefix_cached_outside_it(name: str) -> None:
    fleet = small_fleet(instances=4)
    router = SpreadRouter(make_policy(name, 0, fleet))
    pool = _snaps(4)
    prefix = tuple(range(1, 121))  # 1,920 tokens of shared prefix
    first = router.route(_profile("warm", prefix, 2000), pool, 0.0).instance_id
    assert first is not None
    outside = next(k for k in range(4) if first not in {c.instance_id for c in share(ReplicaSlot(4, k), pool)})
    router.slot = ReplicaSlot(4, outside)
    mine = {c.instance_id for c in share(router.slot, pool)}
    widened = spread(router.inner, router.slot, _profile("again", prefix, 2000), pool, 0.1)
    assert {c.instance_id for c in widened} == mine | {first}  # the share plus the holder, no other
    again = router.route(_profile("again", prefix, 2000), pool, 0.1)
    assert again.instance_id == first and again.cached_tokens > 0  # the cache wins over the share
    fresh = router.route(_profile("fresh", (9999,), 2000), pool, 0.2)
    assert fresh.instance_id in mine
    assert router.spread_routes == 2


def _ids(cs) -> set[str]:
    return {c.instance_id for c in cs}


def test_each_replica_keeps_an_interactive_lane_that_other_classes_stay_off() -> None:
    # 16 instances, 4 replicas: shares of 4, and 16 / LANE_EVERY = 2 lanes, the first in id order.
    router = make_policy("tokenpilot", 0, small_fleet(instances=16))
    pool = _snaps(16)
    slot = ReplicaSlot(4, 1)
    lane_ids = [c.instance_id for c in lanes(slot, pool)]
    assert lane_ids == ["i0", "i1"]  # (id order is string order)
    assert all(_ids(lanes(ReplicaSlot(4, k), pool)) == set(lane_ids) for k in range(4))  # the same for all
    mine = _ids(share(slot, pool))
    assert [i for i in lane_ids if i in mine] == ["i1"]
    # An interactive prompt: its share plus every replica's lane.
    assert _ids(spread(router, slot, _profile("chat", (1,), 2000), pool, 0.0)) == mine | set(lane_ids)
    # A long-context one (by length, or so classified): its share less the lane in it.
    assert _ids(spread(router, slot, _profile("doc", (2,), 20000), pool, 0.0)) == mine - {"i1"}
    classified = RequestProfile(request_id="b", model="m", prompt_tokens=2000, block_hashes=(3,), max_tokens=16,
                                request_class="batch")
    assert _ids(spread(router, slot, classified, pool, 0.0)) == mine - {"i1"}
    # Too small a pool for a lane: the plain share.
    small = _snaps(LANE_EVERY - 1)
    assert lanes(slot, small) == []
    assert _ids(spread(router, slot, _profile("chat2", (4,), 2000), small, 0.0)) == _ids(share(slot, small))


def test_a_long_prompt_still_follows_its_cache_onto_a_lane() -> None:
    # A conversation that began on a lane and grew long: its cached prefix there outweighs the rule.
    router = SpreadRouter(make_policy("tokenpilot", 0, small_fleet(instances=16)), ReplicaSlot(4, 0))
    pool = _snaps(16)
    prefix = tuple(range(1, 601))  # 9,600 tokens
    router.inner.route(_profile("turn1", prefix, 9700), [pool[1]], 0.0)  # i1: a lane in replica 1's share
    view = _ids(spread(router.inner, router.slot, _profile("turn2", prefix, 12000), pool, 0.1))
    assert view == _ids(share(router.slot, pool)) - {"i0"} | {"i1"}  # its share less its lane i0, plus the holder
    assert router.route(_profile("turn2", prefix, 12000), pool, 0.1).instance_id == "i1"


def test_the_share_never_gives_way_for_load_alone() -> None:
    # The instance outside the share is idle, the share's is deep in prefill work: the replica
    # still keeps to its share (every other replica sees that idle instance at the same instant).
    fleet = small_fleet(instances=2)
    router = SpreadRouter(make_policy("tokenpilot", 0, fleet), ReplicaSlot(2, 0))
    pool = _snaps(2)
    for j in range(6):  # a backlog on i0, the whole share of replica 0
        router.inner.route(_profile(f"long{j}", (7000 + j,), 30000), [pool[0]], 0.0)
    assert router.inner.route(_profile("probe", (9000,), 2000), pool, 0.0).instance_id == "i1"  # alone: i1
    assert router.route(_profile("mine", (9001,), 2000), pool, 0.0).instance_id == "i0"


def test_a_router_with_neither_a_cost_model_nor_a_prefix_index_is_left_alone() -> None:
    router = make_policy("least_request", 0, small_fleet(instances=4))
    pool = _snaps(4)
    assert spread(router, ReplicaSlot(4, 1), _profile("a"), pool, 0.0) is pool


def test_replicas_that_hear_each_other_at_once_route_over_the_whole_pool() -> None:
    # Lag 0: no replica is blind to another's pick, so there is no herd to break up and the
    # share would only cost; the run is the one without spreading, decision for decision.
    fleet = small_fleet(instances=8)
    reqs = [req(i * 0.5, 3000, 16, [i % 7, 200 + i]) for i in range(40)]
    inputs = prepare(reqs, fleet)

    def run(sync_s: float, spread_on: bool) -> list[tuple[str | None, float | None]]:
        routers = [make_policy("tokenpilot", s, fleet) for s in range(4)]
        records = FleetSimulator(fleet, ReplicatedRouter(routers, sync_s=sync_s, spread=spread_on)) \
            .run(inputs).records
        return [(r.instance, r.ttft_s) for r in records]

    assert run(0.0, True) == run(0.0, False)
    assert not any(isinstance(r, SpreadRouter) for r in ReplicatedRouter(
        [make_policy("tokenpilot", s, fleet) for s in range(4)], sync_s=0.0).routers)
    assert all(isinstance(r, SpreadRouter) for r in ReplicatedRouter(
        [make_policy("tokenpilot", s, fleet) for s in range(4)], sync_s=0.05).routers)
