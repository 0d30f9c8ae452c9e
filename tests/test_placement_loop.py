"""How the placement loop carries out moves, on adapters whose engines are stand-ins: the order
of steps (make-before-break), removing only, and what happens when a replica cannot start
or never becomes ready (the source keeps its replica)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine_adapters.base import AdapterError, Instance
from fleetcore.fleet_config import load_fleet_file
from fleetmind.demand import DemandModel
from fleetmind.placement_cycle import CycleSettings, PlacementCycle
from fleetmind.planner import Move, Planner
from gateway.fleet_state import FleetState
from gateway.placement import PlacementLoop
from slomax.ledger import GoodputLedger
from tests.conftest import FakeAdapter, make_instance
from tokenpilot.registry import make_router

CONFIG = load_fleet_file(Path(__file__).with_name("fleet_planner.yaml"))
MODEL = "llama-3.1-8b"


class StandInAdapter(FakeAdapter):
    """conftest's FakeAdapter for one site, able to add and remove instances."""

    def __init__(self, site: str, count: int, *, fail_add: bool = False, never_ready: bool = False) -> None:
        super().__init__([self._make(site, i) for i in range(count)])
        self.site, self.model = site, MODEL
        self.fail_add, self.never_ready = fail_add, never_ready
        self._next = count
        self.removed: list[str] = []

    @staticmethod
    def _make(site: str, i: int) -> Instance:
        return make_instance(f"{site}/{MODEL}/{i}", f"http://stand-in/{site}/{i}", site=site, model=MODEL)

    @property
    def scalable(self) -> bool:
        return True

    async def add_instance(self) -> Instance:
        if self.fail_add:
            raise AdapterError("no free GPUs")
        inst = self._make(self.site, self._next)
        self._next += 1
        self._instances.append(inst)
        self.ready[inst.instance_id] = not self.never_ready
        return inst

    async def remove_instance(self, instance: Instance) -> None:
        self.removed.append(instance.instance_id)
        self._instances = [i for i in self._instances if i.instance_id != instance.instance_id]


@pytest.fixture
async def fleet(request: pytest.FixtureRequest) -> AsyncIterator[tuple[PlacementLoop, StandInAdapter, StandInAdapter]]:
    opts = getattr(request, "param", {})
    a, b = StandInAdapter("a", 1, **opts), StandInAdapter("b", 2)
    state = FleetState(CONFIG, [a, b], poll_interval_s=0.02)
    await state.start()
    core = PlacementCycle(Planner(), DemandModel(CONFIG), CycleSettings(ready_timeout_s=0.3, drain_timeout_s=5))
    loop = PlacementLoop(core, state, make_router("round_robin"), GoodputLedger(), time.monotonic, poll_s=0.01)
    try:
        yield loop, a, b
    finally:
        await loop.stop()
        await state.stop()


def steps(loop: PlacementLoop) -> list[tuple[str, str | None]]:
    return [(x.kind, x.site) for x in loop.actions]


async def test_a_move_starts_first_and_drains_the_least_busy_replica_once_the_new_one_is_ready(fleet) -> None:
    loop, a, b = fleet
    loop.state.begin(f"b/{MODEL}/0")  # b/0 is busy, b/1 idle
    assert await loop.carry_out(Move(MODEL, "b", "a"))
    await loop.settle()
    assert steps(loop) == [("start", "a"), ("ready", "a"), ("drain", "b"), ("stop", "b")]
    assert b.removed == [f"b/{MODEL}/1"] and loop.state.placement() == {("a", MODEL): 2, ("b", MODEL): 1}


async def test_a_drain_waits_for_requests_in_flight(fleet) -> None:
    loop, a, b = fleet
    for i in (0, 1):
        loop.state.begin(f"b/{MODEL}/{i}")
    looks = 0  # how often the drain asked whether its replica is idle yet
    idle = loop.state.idle

    def counted_idle(instance_id: str) -> bool:
        nonlocal looks
        looks += 1
        return idle(instance_id)

    loop.state.idle = counted_idle  # type: ignore[method-assign]
    assert await loop.carry_out(Move(MODEL, "b", None))  # remove only
    # not a sleep hoping the drain had its chance: the executor's steps look at the replica
    # (the cycle judges the drain from what they see) and it still waits
    for _ in range(5):
        await loop.advance()
    assert looks >= 5
    assert b.removed == [] and steps(loop) == [("drain", "b")]
    assert "1 in flight" in loop.actions[0].detail
    victim = loop.actions[0].instance
    assert victim is not None and loop.state.get(victim).draining
    loop.state.end(victim)
    await loop.settle()
    assert b.removed == [victim] and steps(loop)[-1] == ("stop", "b")


@pytest.mark.parametrize("fleet", [{"fail_add": True}], indirect=True)
async def test_a_replica_that_cannot_start_leaves_the_source_alone(fleet) -> None:
    loop, a, b = fleet
    assert not await loop.carry_out(Move(MODEL, "b", "a"))
    assert steps(loop) == [("failed", "a")] and "no free GPUs" in loop.actions[0].detail
    assert not any(st.draining for st in loop.state.states())


@pytest.mark.parametrize("fleet", [{"never_ready": True}], indirect=True)
async def test_a_replica_that_never_gets_ready_is_stopped_and_the_source_keeps_its_own(fleet) -> None:
    loop, a, b = fleet
    assert await loop.carry_out(Move(MODEL, "b", "a"))
    await loop.settle()
    assert steps(loop) == [("start", "a"), ("failed", "a"), ("stop", "a")]
    assert a.removed == [f"a/{MODEL}/1"] and b.removed == []
    assert loop.state.placement() == {("a", MODEL): 1, ("b", MODEL): 2}


async def test_a_site_without_a_scalable_deployment_is_skipped(fleet) -> None:
    loop, a, b = fleet
    assert not await loop.carry_out(Move(MODEL, "b", "elsewhere"))
    assert steps(loop) == [("skipped", "elsewhere")]


async def test_released_requests_book_the_ledgers_verdict_at_their_site(fleet) -> None:
    """The gateway's admission gate tells the loop each admitted request's end and verdict
    (`AdmissionGate.on_released`): booked at the site it ran in, at the loop's clock; one that
    never reached a site books nothing."""
    from fleetcore.types import RequestOutcome, RequestProfile
    loop, _, _ = fleet
    prof = RequestProfile(request_id="q", model=MODEL, prompt_tokens=10)
    now = loop.clock()
    loop.released(prof, RequestOutcome(request_id="q", instance_id="a/x/0", site="a", ok=True), True)
    loop.released(prof, RequestOutcome(request_id="q", instance_id="a/x/0", site="a", ok=True), False)
    loop.released(prof, RequestOutcome(request_id="q", instance_id="", site="", ok=False), False)
    assert loop.core.planner.met_share(("a", MODEL), loop.clock()) == 0.5
    assert set(loop.core.planner._verdicts) == {("a", MODEL)}
    assert all(t >= now for t, _ in loop.core.planner._verdicts[("a", MODEL)])
