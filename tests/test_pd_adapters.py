"""P/D roles in the engine adapters: the engine arguments each role gets (vLLM NixlConnector,
SGLang disaggregation mode and bootstrap port, the sim worker's role and link), and what the
gateway learns from the `Instance` (role, protocol, bootstrap port)."""

from __future__ import annotations

import json
from typing import Any

from engine_adapters.registry import build_adapters
from engine_adapters.sglang import SGLangAdapter
from engine_adapters.sim.launcher import SimAdapter
from engine_adapters.vllm import VLLMAdapter
from fleetcore.fleet_config import parse_fleet


PD_ROLES = {"prefill": 1, "decode": 2}


def pd_fleet(adapter: str, options: dict[str, Any] | None = None, engine: dict[str, Any] | None = None,
             roles: dict[str, int] | None = PD_ROLES) -> Any:
    return parse_fleet({
        "sites": [{"name": "s1", "region": "r", "jurisdiction": "j",
                   "interconnect": {"bandwidth_gb_s": 25, "latency_ms": 0.5}}],
        "models": [{"name": "tiny", "engine": {"spec": "llama-3.1-8b", "max_model_len": 1024, "block_size": 32,
                                               **(engine or {})}}],
        "deployments": [{"site": "s1", "model": "tiny", "adapter": adapter, "instances": 3, "gpu": "H100",
                         "roles": roles,
                         "options": options if options is not None else {"model": "/models/tiny"}}],
    })


def flags(argv: list[str]) -> dict[str, str]:
    return dict(zip(argv, argv[1:], strict=False))


def test_vllm_roles_get_nixl_kv_transfer_config_and_own_side_channel():
    (a,) = build_adapters(pd_fleet("vllm"))
    assert isinstance(a, VLLMAdapter)
    assert [a.role_of(i) for i in range(3)] == ["prefill", "decode", "decode"]
    pre, dec = flags(a.engine_argv(8001, None, 0)), flags(a.engine_argv(8002, None, 1))
    assert json.loads(pre["--kv-transfer-config"]) == {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    assert json.loads(dec["--kv-transfer-config"]) == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    assert a.instance_env(0)["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert a.instance_env(2)["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5602"
    inst = a._instance(0, "http://127.0.0.1:8001")
    assert (inst.role, inst.pd_protocol) == ("prefill", "vllm")


def test_vllm_without_roles_is_unchanged():
    fleet = pd_fleet("vllm")
    raw = fleet.model_dump()
    raw["deployments"][0]["roles"] = None
    (a,) = build_adapters(parse_fleet(raw))
    argv = a.engine_argv(8001, None, 0)
    assert "--kv-transfer-config" not in argv and a.instance_env(0) == {}
    inst = a._instance(0, "http://127.0.0.1:8001")
    assert (inst.role, inst.pd_protocol, inst.bootstrap_port) == ("mixed", None, None)


def test_sglang_roles_get_disaggregation_mode_and_bootstrap_port():
    (a,) = build_adapters(pd_fleet("sglang", {"model": "/models/tiny", "bootstrap_port_base": 9100,
                                              "transfer_backend": "nixl"}))
    assert isinstance(a, SGLangAdapter)
    pre, dec = flags(a.engine_argv(9000, None, 0)), flags(a.engine_argv(9001, None, 1))
    assert pre["--disaggregation-mode"] == "prefill" and pre["--disaggregation-bootstrap-port"] == "9100"
    assert pre["--disaggregation-transfer-backend"] == "nixl"
    assert dec["--disaggregation-mode"] == "decode" and "--disaggregation-bootstrap-port" not in dec
    inst = a._instance(0, "http://127.0.0.1:9000")
    assert (inst.role, inst.pd_protocol, inst.bootstrap_port) == ("prefill", "sglang", 9100)
    assert a._instance(1, "http://127.0.0.1:9001").bootstrap_port is None


def test_sim_workers_get_their_role_and_the_sites_link():
    (a,) = build_adapters(pd_fleet("sim", {"pd_protocol": "vllm"}))
    assert isinstance(a, SimAdapter)
    f = flags(a._args)
    assert f["--kv-link-gb-s"] == "25.0" and f["--kv-link-latency-ms"] == "0.5"
    assert [a.role_of(f"s1/tiny/{i}") for i in range(4)] == ["prefill", "decode", "decode", "mixed"]
    inst = a._instance("s1/tiny/0", "http://127.0.0.1:7001")
    assert (inst.role, inst.pd_protocol, inst.bootstrap_port) == ("prefill", "vllm", 7001)


def test_vllm_pd_roles_launch_at_the_pd_step_budget():
    budget = {"max_num_batched_tokens": 8192, "pd_max_num_batched_tokens": 1024}
    (a,) = build_adapters(pd_fleet("vllm", engine=budget))
    assert [flags(a.engine_argv(8001 + i, None, i))["--max-num-batched-tokens"] for i in range(3)] == ["1024"] * 3
    assert a._instance(1, "http://127.0.0.1:8002").max_batched_tokens == 1024  # the router's prior agrees
    # a mixed instance beside P/D roles serves local prefills among its streams: the same budget
    (m,) = build_adapters(pd_fleet("vllm", engine=budget, roles={"prefill": 1, "decode": 1, "mixed": 1}))
    (k,) = [i for i in range(3) if m.role_of(i) == "mixed"]
    assert flags(m.engine_argv(8001 + k, None, k))["--max-num-batched-tokens"] == "1024"


def test_vllm_keeps_the_files_budget_without_roles_or_without_a_pd_budget():
    colocated = pd_fleet("vllm", engine={"max_num_batched_tokens": 4096, "pd_max_num_batched_tokens": 1024},
                         roles=None)
    (a,) = build_adapters(colocated)
    assert flags(a.engine_argv(8001, None, 0))["--max-num-batched-tokens"] == "4096"
    assert a._instance(0, "http://127.0.0.1:8001").max_batched_tokens == 4096
    (b,) = build_adapters(pd_fleet("vllm", engine={"max_num_batched_tokens": 4096}))
    assert flags(b.engine_argv(8001, None, 0))["--max-num-batched-tokens"] == "4096"


def test_sglang_pd_roles_launch_at_the_pd_chunked_prefill_size():
    budget = {"max_num_batched_tokens": 8192, "pd_max_num_batched_tokens": 2048}
    (a,) = build_adapters(pd_fleet("sglang", engine=budget))
    pre, dec = flags(a.engine_argv(9000, None, 0)), flags(a.engine_argv(9001, None, 1))
    assert pre["--chunked-prefill-size"] == dec["--chunked-prefill-size"] == "2048"
    assert (pre["--disaggregation-mode"], dec["--disaggregation-mode"]) == ("prefill", "decode")
    (c,) = build_adapters(pd_fleet("sglang", engine=budget, roles=None))
    assert flags(c.engine_argv(9000, None, 0))["--chunked-prefill-size"] == "8192"
    assert "--disaggregation-mode" not in c.engine_argv(9000, None, 0)


def test_sim_workers_launch_at_the_pd_step_budget():
    budget = {"max_num_batched_tokens": 8192, "pd_max_num_batched_tokens": 1024}
    (a,) = build_adapters(pd_fleet("sim", {"pd_protocol": "vllm"}, engine=budget))
    assert isinstance(a, SimAdapter)
    assert flags(a._args)["--max-num-batched-tokens"] == "1024"  # every worker's command line
    assert a._instance("s1/tiny/1", "http://127.0.0.1:7002").max_batched_tokens == 1024  # the router's prior agrees
    # the same deployment without roles, or without a P/D budget, keeps the file's budget
    (c,) = build_adapters(pd_fleet("sim", {}, engine=budget, roles=None))
    assert flags(c._args)["--max-num-batched-tokens"] == "8192"
    assert c._instance("s1/tiny/0", "http://127.0.0.1:7001").max_batched_tokens == 8192
    (n,) = build_adapters(pd_fleet("sim", {}, engine={"max_num_batched_tokens": 4096}))
    assert flags(n._args)["--max-num-batched-tokens"] == "4096"
