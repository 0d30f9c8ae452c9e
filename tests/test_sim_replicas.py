"""Several gateway replicas in the simulator (`--gateways N --sync-ms M`, fleetsim.replicas)."""

from __future__ import annotations

import json

import pytest

from fleetcore.policies import InstanceRouter
from fleetcore.types import RouteDecision
from fleetsim.cli import main, make_policy
from fleetsim.replicas import ReplicatedRouter
from fleetsim.simulator import FleetSimulator, prepare
from tests.paths import TRACES
from tests.test_fleetsim import req, small_fleet

TRACE = TRACES / "conversation_trace.jsonl.gz"


def _strip_wall(x):
    if isinstance(x, dict):
        return {k: _strip_wall(v) for k, v in x.items() if k not in ("wall_s", "wall")}
    if isinstance(x, list):
        return [_strip_wall(v) for v in x]
    return x


def test_one_gateway_is_todays_run_bit_for_bit(tmp_path) -> None:
    base = ["simulate", "--trace", str(TRACE), "--max-requests", "150", "--rate-scale", "3.46",
            "--policy", "tokenpilot,dynamo_kv", "--no-progress"]
    assert main([*base, "--json", str(tmp_path / "a.json")]) == 0
    assert main([*base, "--gateways", "1", "--sync-ms", "0", "--json", str(tmp_path / "b.json")]) == 0
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert _strip_wall(a) == _strip_wall(b)


def test_a_wrapped_single_router_routes_exactly_as_the_bare_one() -> None:
    fleet = small_fleet(instances=4)
    reqs = [req(i * 40.0, 1500, 8, [i % 5, 100 + i]) for i in range(60)]
    inputs = prepare(reqs, fleet)
    bare = FleetSimulator(fleet, make_policy("tokenpilot", 0, fleet)).run(inputs).records
    one = FleetSimulator(fleet, ReplicatedRouter([make_policy("tokenpilot", 0, fleet)])).run(inputs).records
    assert [(r.instance, r.ttft_s, r.cached_tokens) for r in bare] == \
           [(r.instance, r.ttft_s, r.cached_tokens) for r in one]


def _prefix_heavy():
    # 23 conversations (coprime to the 4 replicas: each conversation visits every replica), each re-sending its 4-block (2,048-token) prefix with a new tail.
    return [req(i * 150.0, 2300, 4, [1000 * (i % 23) + b for b in range(4)] + [10 ** 6 + i]) for i in range(240)]


def _hit(name: str, gateways: int, sync_ms: float, spread: bool = False) -> tuple[float, ReplicatedRouter]:
    fleet = small_fleet(instances=4)
    router = ReplicatedRouter([make_policy(name, s, fleet) for s in range(gateways)], sync_s=sync_ms / 1000,
                              spread=spread)
    res = FleetSimulator(fleet, router).run(prepare(_prefix_heavy(), fleet))
    return sum(r.cached_tokens for r in res.records) / sum(r.prompt_tokens for r in res.records), router


def test_with_a_large_lag_replicas_see_fewer_of_each_others_dispatches() -> None:
    fresh, r0 = _hit("sglang_cache_aware", 4, 0)
    stale, r1 = _hit("sglang_cache_aware", 4, 10 ** 6)  # never within the run
    assert r0.remote_dispatches == r1.remote_dispatches == 240  # all heard, the stale ones after the run
    # Each replica's prefix tree holds only its own dispatches: it sends a conversation
    # where another replica never sent it, so the engines' caches are hit less.
    assert stale < fresh - 0.1, (fresh, stale)


class _Seen(InstanceRouter):
    """Records the in-flight counts it is shown; routes to the first candidate."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def route(self, profile, candidates, now):
        self.seen.append(candidates[0].inflight)
        return RouteDecision(candidates[0].instance_id, "first")


def test_other_replicas_dispatches_count_in_flight_only_after_the_lag() -> None:
    fleet = small_fleet(instances=1)
    a, b = _Seen(), _Seen()
    router = ReplicatedRouter([a, b], sync_s=0.5)
    # Long outputs: all four stay in flight. Replica a routes 0 and 2, b routes 1 and 3.
    reqs = [req(0, 100, 4000), req(10, 100, 4000), req(20, 100, 4000), req(1000, 100, 4000)]
    FleetSimulator(fleet, router).run(prepare(reqs, fleet))
    own = [x for x in a.seen]  # a's own routes: request 0 (nothing in flight), request 2 (its own 0; 1 unheard)
    assert own[0] == 0 and own[1] == 1
    # b at request 3 (t = 1 s): its own 1, and 0 and 2 heard by then (0.5 s lag)
    assert b.seen[-1] == 3


class _Heard(InstanceRouter):
    """Routes to the first candidate; records what it hears of the other replicas' dispatches."""

    def __init__(self) -> None:
        self.routed: list[str] = []
        self.heard: list[tuple[str, str, float]] = []

    def route(self, profile, candidates, now):
        self.routed.append(profile.request_id)
        return RouteDecision(candidates[0].instance_id, "first")

    def note_dispatch(self, profile, instance, now):
        self.heard.append(("dispatch", profile.request_id, now))

    def on_first_token(self, request_id, now):
        self.heard.append(("first", request_id, now))

    def note_release(self, request_id, now):
        self.heard.append(("release", request_id, now))


def test_the_others_hear_a_dispatch_its_first_token_and_its_end_through_the_hooks_one_lag_late() -> None:
    fleet = small_fleet(instances=2)
    a, b = _Heard(), _Heard()
    router = ReplicatedRouter([a, b], sync_s=0.5, spread=False)
    sim = FleetSimulator(fleet, router)
    res = sim.run(prepare([req(0, 500, 20), req(3000, 500, 20)], fleet))
    first, second = sorted(res.records, key=lambda r: r.arrival_s)
    assert a.routed == [first.request_id] and b.routed == [second.request_id]  # never routed twice
    of_first = [(k, t) for k, rid, t in b.heard if rid == first.request_id]  # (b hears its own first token too)
    assert [k for k, _ in of_first] == ["dispatch", "first", "release"]
    t_dispatch, t_first, t_end = (t for _, t in of_first)
    assert t_dispatch == pytest.approx(first.arrival_s + 0.5)
    (own_first,) = [t for k, rid, t in a.heard if k == "first" and rid == first.request_id]  # the owner's, at once
    assert t_first == pytest.approx(own_first + 0.5)
    assert t_end == pytest.approx(first.arrival_s + first.e2e_s + 0.5)
    assert [k for k, rid, _ in a.heard if rid == second.request_id] == ["dispatch", "first", "release"]
