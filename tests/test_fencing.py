"""Fencing tokens where the planner's moves are carried out, over a real redis-server: a deposed
leader whose own clock still trusts its hold (paused: its renewals held up) has its late moves
refused by the script that checks the token and records the move; the new leader's are accepted;
the audit stream says who moved what under which token. Redis down: every move refused."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fleetcore.fleet_config import GatewaySettings
from fleetmind.demand import DemandModel
from fleetmind.placement_cycle import CycleSettings, PlacementCycle
from fleetmind.planner import Move, Planner
from gateway.fleet_state import FleetState
from gateway.lease import FENCE_MARGIN, LeaderLease
from gateway.placement import REFUSED, PlacementLoop
from gateway.replica_state import PlannerAdmin
from gateway.shared_state import SharedRedis
from slomax.ledger import GoodputLedger
from tests.redis_control import RedisProc
from tests.test_placement_loop import CONFIG, MODEL, StandInAdapter
from tests.waits import wait_until
from tokenpilot.registry import make_router

TTL, RENEW = 0.6, 0.2


class FrozenClock:
    """A's lease clock, stopped: the paused leader keeps trusting its hold however long it lasts."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


@dataclass
class Replica:
    shared: SharedRedis
    lease: LeaderLease
    loop: PlacementLoop
    a: StandInAdapter  # site a (one replica), the destination of the test's moves
    b: StandInAdapter  # site b (two replicas), their source


@pytest.fixture
async def redis_proc(tmp_path: Path) -> AsyncIterator[RedisProc]:
    proc = RedisProc(tmp_path)
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
async def two(redis_proc: RedisProc) -> AsyncIterator[tuple[Replica, Replica]]:
    settings = GatewaySettings(redis_prefix=f"t-{uuid.uuid4().hex[:8]}", lease_ttl_s=TTL, lease_renew_s=RENEW,
                               store_timeout_s=0.2)
    made: list[tuple[Replica, FleetState]] = []
    for name, clock in (("A", FrozenClock()), ("B", time.monotonic)):
        shared = SharedRedis(redis_proc.url, settings, replica_id=name)
        lease = LeaderLease(shared, clock=clock)
        a, b = StandInAdapter("a", 1), StandInAdapter("b", 2)
        state = FleetState(CONFIG, [a, b], poll_interval_s=0.02)
        await state.start()
        core = PlacementCycle(Planner(), DemandModel(CONFIG), CycleSettings(ready_timeout_s=0.3, drain_timeout_s=5))
        loop = PlacementLoop(core, state, make_router("round_robin"), GoodputLedger(), time.monotonic, poll_s=0.01)
        loop.may_act = lambda lease=lease: lease.leader
        loop.fence = lease.fenced  # as gateway.replica_state wires it
        made.append((Replica(shared, lease, loop, a, b), state))
    try:
        yield made[0][0], made[1][0]
    finally:
        for r, state in made:
            await r.loop.stop()
            await state.stop()
            await r.lease.stop(release=False)
            await r.shared.redis.aclose()


async def take_over(a: Replica, b: Replica) -> None:
    """A holds the lease, then pauses (no renewals; its frozen clock still trusts the hold);
    B takes over once the hold has run out in Redis."""
    assert await a.lease.tick() and a.lease.fence == 1
    await wait_until(b.lease.tick, 5 * TTL, "B to take the lease over after A's hold ran out in Redis")
    assert b.lease.fence == 2
    assert a.lease.leader  # A's own view: still the leader (this is what the fence is for)


def kinds(loop: PlacementLoop) -> list[tuple[str, str]]:
    return [(x.kind, x.detail) for x in loop.actions]


async def test_a_deposed_leaders_late_start_is_refused_and_the_new_leaders_applied(
        two: tuple[Replica, Replica], caplog: pytest.LogCaptureFixture) -> None:
    a, b = two
    await take_over(a, b)
    with caplog.at_level(logging.WARNING, logger="tokenfleet.gateway"):
        assert not await a.loop.carry_out(Move(MODEL, "b", "a"))  # A's late move
    assert kinds(a.loop) == [("failed", REFUSED)]
    assert [i.instance_id for i in a.a.instances] == [f"a/{MODEL}/0"]  # nothing started
    assert a.b.removed == [] and not any(s.draining for s in a.loop.state.states())
    assert a.lease.refused == 1
    assert any("refused by the fence: start a/" in r.getMessage() and "token 1" in r.getMessage()
               for r in caplog.records)

    assert await b.loop.carry_out(Move(MODEL, "b", "a"))  # B's, under the current token
    await b.loop.settle()
    assert [k for k, _ in kinds(b.loop)] == ["start", "ready", "drain", "stop"]
    assert b.b.removed == [f"b/{MODEL}/0"] or b.b.removed == [f"b/{MODEL}/1"]

    log = list(reversed(await b.lease.moves()))  # oldest first
    assert [(m["holder"], m["fence"], m["kind"], m["outcome"]) for m in log] == [
        ("A", "1", "start", "refused"),
        ("B", "2", "start", "accepted"),
        ("B", "2", "drain", "accepted"),
        ("B", "2", "stop", "accepted"),
    ]
    assert log[0]["target"] == f"a/{MODEL}" and log[0]["current"] == "B:2" and log[0]["newest"] == "2"
    assert log[2]["target"] == log[3]["target"] == b.b.removed[0]

    # `GET /admin/v1/planner` on either replica shows the same audit, newest first
    for r in (a, b):
        await r.lease.refresh_moves()
        shown = PlannerAdmin(r.loop, None, r.lease).report()["fenced_moves"]
        assert [(m["holder"], m["kind"], m["outcome"]) for m in shown] == [
            (m["holder"], m["kind"], m["outcome"]) for m in reversed(log)]


async def test_a_deposed_leaders_late_drain_is_refused_and_the_replica_keeps_serving(
        two: tuple[Replica, Replica]) -> None:
    a, b = two
    await take_over(a, b)
    assert not await a.loop.carry_out(Move(MODEL, "b", None))  # remove only: a drain first
    assert not any(s.draining for s in a.loop.state.states())
    assert a.b.removed == []
    assert kinds(a.loop)[1:] == [("failed", f"could not stop: {REFUSED}")]  # the drain the cycle asked for
    log = await b.lease.moves()
    assert [(m["holder"], m["fence"], m["kind"], m["outcome"]) for m in log] == [("A", "1", "drain", "refused")]


async def test_a_stop_that_comes_due_after_a_takeover_is_refused_and_the_replica_serves_again(
        two: tuple[Replica, Replica]) -> None:
    a, b = two
    assert await a.lease.tick()
    for i in (0, 1):
        a.loop.state.begin(f"b/{MODEL}/{i}")  # both busy: the drain waits before its stop
    assert await a.loop.carry_out(Move(MODEL, "b", None))  # drained while A led
    victim = a.loop.actions[0].instance
    assert victim is not None and a.loop.state.get(victim).draining
    await wait_until(b.lease.tick, 5 * TTL, "B to take the lease over")
    a.loop.state.end(victim)  # idle now: the stop comes due, under A's stale token
    await a.loop.settle()
    assert a.b.removed == []
    assert not a.loop.state.get(victim).draining  # back in routing on A
    assert [k for k, _ in kinds(a.loop)] == ["drain", "failed"]
    log = list(reversed(await b.lease.moves()))
    assert [(m["holder"], m["kind"], m["target"], m["outcome"]) for m in log] == [
        ("A", "drain", victim, "accepted"), ("A", "stop", victim, "refused")]


async def test_a_hold_about_to_expire_in_redis_is_refused(two: tuple[Replica, Replica],
                                                           redis_proc: RedisProc) -> None:
    a, b = two
    assert await b.lease.tick()
    margin_ms = TTL * 1000 * FENCE_MARGIN
    assert await b.lease.fenced("start", "a/x")  # just renewed: the whole TTL left
    client = redis_proc.client()
    await wait_until(lambda: client.pttl(b.lease.key) < margin_ms, 2 * TTL, "the hold to near its end in Redis",
                     every_s=0.005)
    assert not await b.lease.fenced("start", "a/y")  # no renewal since: too little left to act on
    last = (await b.lease.moves(1))[0]
    assert (last["holder"], last["target"], last["outcome"]) == ("B", "a/y", "refused")


async def test_the_holder_itself_is_refused_once_redis_is_down(two: tuple[Replica, Replica],
                                                                redis_proc: RedisProc) -> None:
    a, b = two
    assert await b.lease.tick()
    assert await b.lease.fenced("start", "a/x")  # while Redis answers
    redis_proc.stop()
    assert b.lease.leader  # its hold is still trusted locally...
    assert not await b.loop.carry_out(Move(MODEL, "b", "a"))  # ...but the move fails closed
    assert kinds(b.loop) == [("failed", REFUSED)]
    assert [i.instance_id for i in b.a.instances] == [f"a/{MODEL}/0"]
