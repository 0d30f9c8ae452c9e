"""The gateway's P/D pieces without processes: the decision in a router's shape (retries stay
local), the gateway's link prediction (the fleet file's interconnect, the model's KV bytes), and
when the flow is on at all."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from fleetcore.fleet_config import parse_fleet
from fleetcore.hardware import model
from fleetcore.interconnect import kv_bytes, link_between
from fleetcore.types import InstanceSnapshot, RequestProfile
from fleetcore.prefix import block_hashes
from gateway.pd_flow import LiveLinks, PDFlow, _DecideAsRoute
from tokenpilot.disagg import TokenPilotDisagg
from tokenpilot.priors import prior_from_physics
from tokenpilot.router import TokenPilot

BS = 16
FLEET = parse_fleet({
    "sites": [{"name": "a", "region": "r1", "jurisdiction": "j", "rtt_ms": {"r2": 40},
               "interconnect": {"bandwidth_gb_s": 25, "latency_ms": 0.2}},
              {"name": "b", "region": "r2", "jurisdiction": "j", "rtt_ms": {"r1": 40}}],
    "models": [{"name": "m", "engine": {"spec": "llama-3.1-70b", "max_model_len": 32768, "block_size": BS}}],
    "deployments": [{"site": "a", "model": "m", "adapter": "sim", "instances": 4, "gpu": "H200", "tp": 2,
                     "roles": {"prefill": 2, "decode": 2}},
                    {"site": "b", "model": "m", "adapter": "sim", "instances": 1, "gpu": "H200", "tp": 2}],
    "wan": {"bandwidth_gb_s": 1.0},
})


def snap(iid: str, role: str, running: int = 0) -> InstanceSnapshot:
    return InstanceSnapshot(iid, "a", "m", "v1", f"sim://{iid}", role=role, num_running=running)  # type: ignore[arg-type]


POOL = [snap("p0", "prefill"), snap("p1", "prefill"), snap("d0", "decode", 8), snap("d1", "decode", 8)]


def pilot() -> TokenPilot:
    prior = prior_from_physics("llama-3.1-70b", "H200", 2)
    return TokenPilot(priors={i.instance_id: prior for i in POOL}, seed=0)


def long_profile(rid: str) -> RequestProfile:
    ids = list(range(16000))
    return RequestProfile(rid, "m", len(ids), tuple(block_hashes(ids, BS)), BS, max_tokens=200)


class _States:
    def __init__(self, where: dict[str, tuple[str, str | None]]) -> None:
        self._s = {iid: SimpleNamespace(instance=SimpleNamespace(site=site, engine_spec=spec))
                   for iid, (site, spec) in where.items()}

    def get(self, iid: str) -> Any:
        return self._s.get(iid)


class _Zero:
    def predict_s(self, src: str, dst: str, tokens: int, now: float) -> float:
        return 0.0


def test_the_decision_as_a_route_names_both_legs() -> None:
    r = _DecideAsRoute(TokenPilotDisagg(pilot()), _Zero(), local_only=False)  # type: ignore[arg-type]
    route = r.route(long_profile("x"), POOL, 0.0)
    assert r.last is not None and r.last.split
    assert route.instance_id == r.last.decode and route.instance_id in ("d0", "d1")
    assert f"prefill {r.last.prefill} -> decode {r.last.decode}" in route.reason
    assert [c.name for c in route.candidates] == [r.last.prefill, r.last.decode]


def test_a_retry_stays_local_and_never_on_a_prefill_instance() -> None:
    r = _DecideAsRoute(TokenPilotDisagg(pilot()), _Zero(), local_only=True)  # type: ignore[arg-type]
    route = r.route(long_profile("y"), POOL, 0.0)
    assert r.last is not None and not r.last.split
    assert route.instance_id in ("d0", "d1") and route.reason.startswith("local")


def test_live_links_use_the_fleet_files_links_and_the_models_kv() -> None:
    links = LiveLinks(FLEET, _States({"p0": ("a", "llama-3.1-70b"), "d0": ("a", "llama-3.1-70b"),
                                      "b0": ("b", "llama-3.1-70b"), "x": ("a", None)}))  # type: ignore[arg-type]
    kv = kv_bytes(model("llama-3.1-70b"), 8000)
    assert links.predict_s("p0", "d0", 8000, 0.0) == pytest.approx(0.0002 + kv / 25e9)
    assert links.predict_s("p0", "b0", 8000, 0.0) == pytest.approx(link_between(FLEET, "a", "b").transfer_s(kv))
    assert links.predict_s("p0", "b0", 8000, 0.0) == pytest.approx(0.020 + kv / 1e9)
    assert links.predict_s("p0", "x", 8000, 0.0) == 0.0  # no engine spec: nothing to size the KV by


def test_flow_only_for_pd_fleets_under_tokenpilot() -> None:
    relay = SimpleNamespace(config=FLEET, router=pilot(), state=None, metrics=SimpleNamespace(registry=None))
    assert PDFlow.for_relay(relay) is not None  # type: ignore[arg-type]
    assert PDFlow.for_relay(SimpleNamespace(config=FLEET, router=object())) is None  # type: ignore[arg-type]
    raw = FLEET.model_dump()
    raw["deployments"][0]["roles"] = None
    plain = parse_fleet(raw)
    assert PDFlow.for_relay(SimpleNamespace(config=plain, router=pilot())) is None  # type: ignore[arg-type]
