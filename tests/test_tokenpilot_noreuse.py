"""With nothing cached, TokenPilot is at least as good as least-loaded balancing.

Hand-made fleets (the router directly): identical requests, none sharing a prefix, piled
on each instance in different numbers; the next request must go where least_loaded would
send it. And a small simulated fleet on the Azure conversation trace (no prefix sharing):
TokenPilot's goodput must not fall below least_loaded's.
"""

from __future__ import annotations

import random

from fleetcore.fleet_config import FleetConfig, parse_fleet
from fleetcore.types import InstanceSnapshot, RequestProfile
from fleetsim.cli import make_policy
from fleetsim.metrics import summarize_all
from fleetsim.simulator import FleetSimulator, estimate_capacity, prepare
from tokenpilot.baselines import LeastLoaded
from tokenpilot.priors import prior_from_physics
from tokenpilot.router import TokenPilot, TokenPilotConfig
from workloads import head, load_trace, scale_rate

from tests.paths import TRACES

PRIOR = prior_from_physics("llama-3.1-8b", "H100")


def inst(iid: str, n: int) -> InstanceSnapshot:
    return InstanceSnapshot(instance_id=iid, site="s", model="m", version="v", url=f"http://{iid}",
                            inflight=n, num_running=n)


def fresh(rid: str, tokens: int, serial: int) -> RequestProfile:
    first = serial * 10_000
    return RequestProfile(request_id=rid, model="m", prompt_tokens=tokens, stream=True,
                          block_hashes=tuple(range(first, first + tokens // 16)))


def test_nothing_cached_identical_requests_go_where_least_loaded_sends_them() -> None:
    rng = random.Random(19)
    serial = 0
    for case in range(60):
        ids = [f"i{k}" for k in range(4)]
        tp = TokenPilot({i: PRIOR for i in ids}, config=TokenPilotConfig(explore=0.0))
        tokens = rng.choice([200, 1000, 4000])
        loads = {i: rng.randint(0, 8) for i in ids}
        for i, n in loads.items():
            for j in range(n):
                serial += 1
                tp.route(fresh(f"{case}-{i}-{j}", tokens, serial), [inst(i, j)], 0.0)
        serial += 1
        pool = [inst(i, n) for i, n in loads.items()]
        ours = tp.route(fresh(f"{case}-next", tokens, serial), pool, 0.0).instance_id
        theirs = LeastLoaded().route(fresh(f"{case}-next", tokens, serial), pool, 0.0).instance_id
        assert ours is not None and theirs is not None
        assert loads[ours] == loads[theirs] == min(loads.values()), (case, loads, ours)


def four_instances() -> FleetConfig:
    """fleet32's instance shape (70B on 2 x H200), four of them: TPOT is tight there."""
    model = "llama-3.1-70b"
    return parse_fleet({
        "regions": ["us-east"], "default_region": "us-east",
        "sites": [{"name": "s1", "region": "us-east", "jurisdiction": "us", "rtt_ms": {"us-east": 2}}],
        "models": [{"name": model, "engine": {"spec": model, "max_model_len": 32768}}],
        "deployments": [{"site": "s1", "model": model, "instances": 4, "gpu": "H200", "tp": 2}],
    })


def test_no_reuse_trace_goodput_at_least_least_loaded() -> None:
    fleet = four_instances()
    wl = head(load_trace(TRACES / "AzureLLMInferenceTrace_conv.csv"), 1500)
    x = estimate_capacity(fleet, wl.requests)["no_cache"]["rate_scale_for"]["80%"]
    inputs = prepare(scale_rate(wl, x).requests, fleet)
    slos = fleet.admission.slos()
    goodput = {}
    for name, router in (("tokenpilot", make_policy("tokenpilot", 0, fleet)), ("least_loaded", LeastLoaded())):
        res = FleetSimulator(fleet, router).run(inputs)
        goodput[name] = summarize_all(res.records, slos)["goodput_tok_s"]
    assert goodput["tokenpilot"] >= goodput["least_loaded"], goodput
