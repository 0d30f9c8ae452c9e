"""The round trip to a site, in the TTFT the gateway reports and out of what TokenPilot learns (i19-rtt).

A request's TTFT, as the gateway measures it (and the simulator models it), holds the round trip
to the site it ran in: the request's way there and the first token's way back. TokenPilot predicts
one instance's engine time and learns engine speeds from the TTFT less that round trip
(`RequestOutcome.network_s`); `fleetmind.place` adds the chosen site's round trip to what the
decision reports (the header, the first-byte deadline), once. Live, the round trip is what the
gateway's health probes measure to the site (`gateway.fleet_state`); in the simulator, the fleet
file's figure from the client's region.
"""

from __future__ import annotations

import asyncio
import copy
import time

import aiohttp
import pytest

from fleetcore.fleet_config import parse_fleet
from fleetcore.first_byte import first_byte_deadline_s
from fleetcore.types import FleetView, InstanceSnapshot, RequestOutcome, RequestProfile, SiteSnapshot
from fleetmind.place import place
from fleetmind.site_choice import FleetMind
from fleetcore.slo import ClassSLO
from tokenpilot.priors import prior_from_physics
from tokenpilot.router import TokenPilot

MODEL = "llama-3.1-8b"


# --- the reported TTFT: the router's plus the chosen site's round trip, once -------------------

def _sites(probe_far_ms: float | None = None) -> FleetView:
    def inst(iid: str, site: str, waiting: int = 0) -> InstanceSnapshot:
        return InstanceSnapshot(iid, site, MODEL, "v1", f"http://{iid}", num_waiting=waiting)
    return FleetView((
        SiteSnapshot("near", "us-east", "us", {"us-east": 2, "eu-west": 150}, (inst("n0", "near"),)),
        SiteSnapshot("far", "eu-west", "eu", {"us-east": 150, "eu-west": 75}, (inst("f0", "far"), inst("f1", "far")),
                     **({} if probe_far_ms is None else {"probe_rtt_ms": probe_far_ms})),
    ))


def _router() -> TokenPilot:
    prior = prior_from_physics(MODEL, "H100", 1)
    return TokenPilot({i: prior for i in ("n0", "f0", "f1")})


def _chooser(router: TokenPilot) -> FleetMind:
    return FleetMind(predictor=router, slos={"interactive": ClassSLO(ttft_s=1.0, tpot_s=0.1)})


@pytest.mark.parametrize("probe_far_ms", [None, 140.0])
def test_the_reported_ttft_holds_the_chosen_sites_round_trip_once(probe_far_ms: float | None) -> None:
    """Clients of eu-west are served at "far", their nearest site: the decision reports the router's
    TTFT there plus the round trip to it (the fleet file's 75 ms from eu-west, or what the gateway
    measured, 140 ms),
    once; the router's own number (what it learns against) stays the engine's time; the first-byte
    deadline built from the report holds the round trip once, as the wait it bounds does."""
    from fleetmind.place import network_rtt_s

    view = _sites(probe_far_ms)
    rtt = 0.075 if probe_far_ms is None else 0.140
    assert network_rtt_s(view.site("far"), "eu-west") == rtt
    router = _router()
    for i, prompt in enumerate((40, 800, 3000)):
        profile = RequestProfile(f"r{i}", MODEL, prompt, stream=True, client_region="eu-west")
        engine = copy.deepcopy(router).route(profile, view.site("far").pool(MODEL), float(i)).predicted_ttft_s
        choice = place(profile, view, float(i), _chooser(router), router)
        assert choice.site.site == "far" and choice.route is not None
        assert engine is not None and engine > 0
        # exactly once: the router's engine time plus the round trip, and it says how much it added
        assert choice.route.predicted_ttft_s == pytest.approx(engine + rtt, rel=1e-12)
        assert choice.route.network_s == rtt
        # the site chooser weighed the same two numbers for this site: its score counts the round
        # trip the report adds (the measured one where the gateway measured one)
        row = next(c for c in choice.site.candidates if c.name == "far")
        assert row.detail["predicted_ttft_s"] == pytest.approx(engine, rel=1e-12)
        assert row.detail["rtt_s"] == rtt
        assert choice.route.predicted_ttft_s == pytest.approx(row.detail["predicted_ttft_s"] + row.detail["rtt_s"],
                                                              rel=1e-12)
        # the first-byte deadline runs from dispatch, so it holds one round trip too
        assert first_byte_deadline_s(0.0, 3.0, choice.route.predicted_ttft_s) == pytest.approx(3.0 * (engine + rtt))


def test_no_round_trip_leaves_the_decision_as_the_router_made_it() -> None:
    """A site in the client's own region with no figure for it (and nothing measured): 0 added,
    the router's decision itself (a single-site fleet of the fleet file's 0 ms likewise)."""
    view = FleetView((SiteSnapshot("only", "us-east", "us", {}, (InstanceSnapshot("n0", "only", MODEL, "v1", "u"),)),))
    router = _router()
    profile = RequestProfile("r", MODEL, 500, stream=True, client_region="us-east")
    engine = copy.deepcopy(router).route(profile, view.site("only").pool(MODEL), 0.0)
    choice = place(profile, view, 0.0, _chooser(router), router)
    assert choice.route is not None and choice.route.network_s == 0.0
    assert (choice.route.instance_id, choice.route.predicted_ttft_s) == (engine.instance_id, engine.predicted_ttft_s)


def test_the_simulator_reports_the_same_composed_ttft() -> None:
    """The simulator takes the decision's TTFT from `fleetmind.place` (no copy of its own): a
    request of eu-west served at a site 75 ms away keeps the router's TTFT + 75 ms for its
    first-byte deadline, and its outcome says the 75 ms round trip is in its TTFT."""
    from fleetsim.simulator import FleetSimulator, SimInput, fleet_instances, spec_prior

    fleet = parse_fleet({
        "regions": ["us-east", "eu-west"], "default_region": "us-east",
        "sites": [{"name": "far", "region": "us-east", "jurisdiction": "us",
                   "rtt_ms": {"us-east": 2, "eu-west": 75}}],
        "models": [{"name": MODEL, "versions": ["v1"],
                    "engine": {"spec": MODEL, "max_model_len": 8192, "block_size": 16}}],
        "deployments": [{"site": "far", "model": MODEL, "instances": 1, "gpu": "H100", "adapter": "sim"}],
        "admission": {"policy": "fcfs"},
    })
    router = TokenPilot()
    for spec in fleet_instances(fleet):
        router.register_instance(spec.instance_id, spec_prior(spec))
    engine: dict[str, float] = {}
    reported: dict[str, float] = {}
    outcomes: dict[str, RequestOutcome] = {}
    route, observe = router.route, router.observe

    def routed(profile, pool, now):  # type: ignore[no-untyped-def]
        d = route(profile, pool, now)
        engine[profile.request_id] = d.predicted_ttft_s
        return d

    def observed(o: RequestOutcome) -> None:
        outcomes[o.request_id] = o
        observe(o)
    router.route, router.observe = routed, observed  # type: ignore[method-assign]

    class Sim(FleetSimulator):
        def _place(self, r, *a, **kw):  # type: ignore[no-untyped-def]
            out = super()._place(r, *a, **kw)
            reported[r.inp.request_id] = r.predicted_ttft
            return out

    inputs = [SimInput(request_id=f"r{i}", arrival_s=0.5 * i, model=MODEL, prompt_tokens=320 + 96 * i,
                       output_tokens=4, block_hashes=tuple(range(1000 * i, 1000 * i + (320 + 96 * i) // 16)),
                       block_size=16, tenant="anonymous", request_class="interactive", region="eu-west")
              for i in range(4)]
    Sim(fleet, router).run(inputs)
    assert set(reported) == set(engine) == set(outcomes) == {f"r{i}" for i in range(4)}
    for rid in reported:
        assert reported[rid] == pytest.approx(engine[rid] + 0.075, rel=1e-12)
        assert outcomes[rid].network_s == pytest.approx(0.075)
        assert outcomes[rid].ttft_s is not None and outcomes[rid].ttft_s > 0.075


def test_a_sites_measured_round_trip_is_its_instances_lowest_probe() -> None:
    """The gateway's figure for a site: the lowest recent probe over its instances (an engine's own
    work only adds to a probe), carried by the view's site snapshot; none before any probe."""
    from collections import deque

    from gateway.fleet_state import FleetState, InstanceState
    from tests.conftest import FakeAdapter, make_config, make_instance

    insts = [make_instance("e0", "http://e0", site="euw1"), make_instance("e1", "http://e1", site="euw1"),
             make_instance("u0", "http://u0", site="use1")]
    state = FleetState(make_config(), [FakeAdapter(insts)], poll_interval_s=60)
    state.sync_instances()
    assert state.network_rtt_s("euw1") == 0.0 and state.view().site("euw1").probe_rtt_ms is None
    before = state.view()
    for iid, probes in (("e0", (0.090, 0.081, 0.095)), ("e1", (0.084, 0.120))):
        st = state.get(iid)
        assert st is not None
        st.probe_s = deque(probes, maxlen=8)
        state._measure_site("euw1")  # (what each probe's end does)
    assert state.network_rtt_s("euw1") == pytest.approx(0.081)
    assert state.network_rtt_s("use1") == 0.0  # nothing measured there: nothing claimed
    view = state.view()
    assert view is not before  # a new figure is a new view
    assert view.site("euw1").probe_rtt_ms == pytest.approx(81.0) and view.site("use1").probe_rtt_ms is None
    assert state.view() is view  # and nothing new, the same one


# --- live: the gateway measures the round trip, the router learns without it --------------------

KEY = "sk-rtt"
FAR_RTT_MS = 150.0


def _live_fleet() -> object:
    # Two sites of one real-time simulated worker each; "far"'s worker answers every request one
    # emulated 150 ms round trip late (the network between the gateway and that site). The fleet
    # file's figures are the clients' regions' (each region's own site nearby): what the gateway
    # reports and teaches is what its probes measure.
    worker = {"model": MODEL, "instances": 1, "gpu": "H100", "adapter": "sim"}
    return parse_fleet({
        "regions": ["us-east", "eu-west"], "default_region": "us-east",
        "sites": [{"name": "near", "region": "us-east", "jurisdiction": "us", "rtt_ms": {"us-east": 1, "eu-west": 75}},
                  {"name": "far", "region": "eu-west", "jurisdiction": "eu", "rtt_ms": {"us-east": 75, "eu-west": 1}}],
        "models": [{"name": MODEL, "versions": ["v1"],
                    "engine": {"spec": MODEL, "max_model_len": 8192, "block_size": 16}}],
        "deployments": [{**worker, "site": "near", "options": {"time_scale": 1.0}},
                        {**worker, "site": "far", "options": {"time_scale": 1.0, "network_rtt_ms": FAR_RTT_MS}}],
        "tenants": [{"name": "t", "api_keys": [KEY]}],
        "admission": {"policy": "fcfs"},
    })


class _Outcomes:
    """A relay listener: each attempt's outcome, as the router hears it, and an event per request."""

    def __init__(self) -> None:
        self.by_id: dict[str, RequestOutcome] = {}
        self.events: dict[str, asyncio.Event] = {}

    def event(self, rid: str) -> asyncio.Event:
        return self.events.setdefault(rid, asyncio.Event())

    def arrived(self, profile: RequestProfile) -> None:
        pass

    def first_token(self, request_id: str) -> None:
        pass

    def observe(self, outcome: RequestOutcome) -> None:
        self.by_id[outcome.request_id] = outcome
        self.event(outcome.request_id).set()


async def _ask(s: aiohttp.ClientSession, url: str, i: int, region: str) -> tuple[str, str, float]:
    """One streamed completion of fresh text from `region`; (request id, site, predicted TTFT s)."""
    from workloads.prompts import prompt_text

    body = {"model": MODEL, "prompt": prompt_text(range(10**7 + 10 * i, 10**7 + 10 * i + 2), 1000),
            "max_tokens": 2, "stream": True, "ignore_eos": True}
    async with s.post(f"{url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}", "x-tokenfleet-region": region}) as r:
        assert r.status == 200, await r.text()
        await r.read()
        return (r.headers["x-request-id"], r.headers["x-tokenfleet-site"],
                float(r.headers["x-tokenfleet-predicted-ttft-ms"]) / 1000)


@pytest.mark.asyncio(loop_scope="function")
async def test_live_gateway_reports_and_unlearns_a_remote_sites_round_trip() -> None:
    """The live gateway over two sites, one 150 ms away: each outcome from there tells the router
    the probes' measured round trip (`network_s`), the header's TTFT holds it once, and TokenPilot
    learns that site's engine as fast as the near one's (prefill factor, step fit, its TTFT), where
    with the round trip taken for engine time (`network_s` 0, as before i19-rtt) every outcome
    pushed the far instance's prefill factor up by its step limit and the step fit took 150 ms."""
    from gateway.embedded import serve_fleet

    async with serve_fleet(_live_fleet(), poll_interval_s=0.2) as f:
        relay = f.app.state.tokenfleet.relay
        router: TokenPilot = relay.router
        near = next(st.instance.instance_id for st in relay.state.states() if st.instance.site == "near")
        far = next(st.instance.instance_id for st in relay.state.states() if st.instance.site == "far")
        for iid in (near, far):  # a step fit in after a few outcomes (the shipped 32 would take longer)
            router._learned[router._slot(iid)].step.min_samples = 6
        outcomes = _Outcomes()
        relay.listeners.append(outcomes)
        # (the gateway's first poll at start measured every instance)
        probed = relay.state.probe_rtt_ms()
        assert FAR_RTT_MS <= probed["far"] < FAR_RTT_MS + 100 and probed["near"] < 50, probed
        headers: dict[str, tuple[str, float]] = {}
        deadline = time.monotonic() + 60
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            # one at a time, alternating: idle engines, so what is learned is speed, not queueing
            for i in range(20):
                rid, site, predicted = await _ask(s, f.url, i, "eu-west" if i % 2 else "us-east")
                await asyncio.wait_for(outcomes.event(rid).wait(), timeout=10)  # reported after the stream
                headers[rid] = (site, predicted)
                assert time.monotonic() < deadline
        by_site = {site: [(outcomes.by_id[rid], p) for rid, (s_, p) in headers.items() if s_ == site]
                   for site in ("near", "far")}
        assert len(by_site["far"]) == len(by_site["near"]) == 10  # each region at its own site
        for o, predicted in by_site["far"]:
            assert o.ok and o.ttft_s is not None
            # the router heard the measured round trip, inside the TTFT it came with
            assert FAR_RTT_MS / 1000 <= o.network_s < FAR_RTT_MS / 1000 + 0.1, o
            assert o.ttft_s > o.network_s
            # the header's TTFT holds it (the engine's time alone is a few tens of ms here)
            assert o.network_s <= predicted < o.network_s + 0.15, (predicted, o)
        for o, predicted in by_site["near"]:
            assert o.network_s < 0.05 and predicted < 0.15, (predicted, o)
        # What was learned of the far engine is the near one's: it is the same engine.
        pf_near = router.explain(near)["prefill_speed_factor"]
        pf_far = router.explain(far)["prefill_speed_factor"]
        assert pf_far < 1.2 * pf_near, (pf_far, pf_near)
        assert router.forward_factors(far)[1] is not None  # (a step fit is in on both)
        assert router.forward_factors(near)[1] is not None
        probe = RequestProfile("probe", MODEL, 1000, stream=True)
        now = relay.clock()
        ttft_far = router.predict(probe, [relay.state.snapshot(far)], now)
        ttft_near = router.predict(probe, [relay.state.snapshot(near)], now)
        assert ttft_far is not None and ttft_near is not None
        assert abs(ttft_far[0] - ttft_near[0]) < 0.3 * FAR_RTT_MS / 1000, (ttft_far, ttft_near)


def test_spill_ranks_sites_by_the_round_trip_the_gateway_measured() -> None:
    """Home overloaded, two idle sites to spill to: the fleet file says "b" is the nearer, the
    gateway's probes say "c" is (b's path is slow today). The spill goes where the request pays
    less, by the measured round trip, the one its reported TTFT will carry; with nothing measured,
    by the fleet file's."""
    def inst(iid: str, site: str, waiting: int = 0) -> InstanceSnapshot:
        return InstanceSnapshot(iid, site, MODEL, "v1", f"http://{iid}", num_waiting=waiting, inflight=waiting)

    def view(probes: dict[str, float]) -> FleetView:
        rtts = {"h": 1.0, "b": 20.0, "c": 60.0}
        return FleetView(tuple(
            SiteSnapshot(name, "us-east", "us", {"us-east": rtts[name]},
                         (inst(f"{name}0", name, waiting=400 if name == "h" else 0),),
                         **({"probe_rtt_ms": probes[name]} if name in probes else {}))
            for name in ("h", "b", "c")))

    prior = prior_from_physics(MODEL, "H100", 1)
    profile = RequestProfile("r", MODEL, 2000, stream=True, client_region="us-east")
    for probes, expected in (({}, "b"), ({"h": 1.0, "b": 180.0, "c": 15.0}, "c")):
        router = TokenPilot({i: prior for i in ("h0", "b0", "c0")})
        choice = place(profile, view(probes), 0.0, _chooser(router), router)
        assert choice.site.site == expected, choice.site.reason
        assert choice.route is not None and choice.route.network_s == pytest.approx(
            probes.get(expected, {"b": 20.0, "c": 60.0}[expected]) / 1000)
