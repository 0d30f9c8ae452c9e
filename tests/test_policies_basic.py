"""The first routing and site-choice policies: pure functions of (profile, snapshots)."""

from __future__ import annotations

from fleetcore.types import FleetView, InstanceSnapshot, RequestProfile, SiteSnapshot
from fleetmind.site_choice import NearestReadySite
from tokenpilot.baselines import LeastLoaded, RoundRobin
from tokenpilot.registry import make_router


def inst(iid: str, site: str = "a", model: str = "m", **kw: object) -> InstanceSnapshot:
    return InstanceSnapshot(instance_id=iid, site=site, model=model, version="v1", url=f"http://{iid}", **kw)  # type: ignore[arg-type]


def profile(**kw: object) -> RequestProfile:
    return RequestProfile(**{"request_id": "r", "model": "m", "prompt_tokens": 10, **kw})  # type: ignore[arg-type]


def test_round_robin_cycles_in_id_order() -> None:
    rr = RoundRobin()
    pool = [inst("b"), inst("a"), inst("c")]
    assert [rr.route(profile(), pool, 0).instance_id for _ in range(4)] == ["a", "b", "c", "a"]


def test_least_loaded_uses_the_larger_of_gateway_and_engine_counts() -> None:
    pool = [inst("a", inflight=1, num_running=5), inst("b", inflight=3), inst("c", inflight=2, num_waiting=2)]
    d = LeastLoaded().route(profile(), pool, 0)
    assert {c.name: c.score for c in d.candidates} == {"a": 5.0, "b": 3.0, "c": 2.0}
    assert d.instance_id == "c"


def test_least_loaded_picks_minimum_and_breaks_ties_by_name() -> None:
    ll = LeastLoaded()
    pool = [inst("b", inflight=1), inst("a", inflight=1), inst("c", inflight=4)]
    assert ll.route(profile(), pool, 0).instance_id == "a"


def test_empty_pool_says_why() -> None:
    for router in (make_router("round_robin"), make_router("least_loaded")):
        d = router.route(profile(), [], 0)
        assert d.instance_id is None and "no ready instance" in d.reason


def view() -> FleetView:
    return FleetView(sites=(
        SiteSnapshot("east", "us-east", "us", {"us-east": 1, "eu-west": 70},
                     (inst("e1", "east"), inst("e2", "east", ready=False))),
        SiteSnapshot("west", "eu-west", "eu", {"us-east": 70, "eu-west": 1},
                     (inst("w1", "west"), inst("w2", "west", model="other"))),
    ))


def test_nearest_ready_site_follows_client_region() -> None:
    chooser = NearestReadySite()
    assert chooser.choose(profile(client_region="us-east"), view(), 0).site == "east"
    assert chooser.choose(profile(client_region="eu-west"), view(), 0).site == "west"


def test_nearest_ready_site_skips_sites_without_ready_instances() -> None:
    chooser = NearestReadySite()
    d = chooser.choose(profile(client_region="us-east"), view(), 0, exclude_instances={"e1"})
    assert d.site == "west"
    d = chooser.choose(profile(model="other", client_region="us-east"), view(), 0)
    assert d.site == "west"
    d = chooser.choose(profile(model="nope"), view(), 0)
    assert d.site is None and "no site" in d.reason


def test_site_pool_filters_version() -> None:
    s = SiteSnapshot("x", "r", "j", {}, (inst("a"), InstanceSnapshot("b", "x", "m", "v2", "http://b")))
    assert [i.instance_id for i in s.pool("m", "v2")] == ["b"]
    assert len(s.pool("m")) == 2


def test_class_slos() -> None:
    from fleetcore.slo import BATCH, DEFAULT_SLOS, INTERACTIVE, LONG_CONTEXT, class_by_length

    assert class_by_length(8191) == INTERACTIVE and class_by_length(8192) == LONG_CONTEXT
    inter = DEFAULT_SLOS[INTERACTIVE]
    assert inter.met(0.9, 0.04, 5.0)
    assert not inter.met(1.1, 0.04, 5.0)
    assert not inter.met(0.5, 0.06, 5.0)
    assert not inter.met(None, None, None)  # never produced a token
    assert inter.met(0.5, None, 0.5)  # a one-token answer has no TPOT
    assert DEFAULT_SLOS[BATCH].met(300.0, 0.5, 599.0) and not DEFAULT_SLOS[BATCH].met(1.0, 0.01, 601.0)
    assert DEFAULT_SLOS[LONG_CONTEXT].met(7.9, 0.079, 100.0)
