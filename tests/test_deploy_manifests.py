"""deploy/k8s and deploy/compose cannot run here: every Kubernetes manifest is validated offline
against the Kubernetes schemas (kubernetes-validate's bundled ones, strict: unknown fields fail),
and both are checked to be in step with the CLI (every `tokenfleet up` and sim worker command
line parses with the real argparse), the fleet file (it loads with fleetcore's loader and its
URLs name the worker pods/services that exist), the gateway's shutdown grace and its metrics."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import kubernetes_validate
import pytest
import yaml

from engine_adapters.sim.worker import build_arg_parser
from fleetcore.fleet_config import FleetConfig, load_fleet_file
from gateway.haproxy_config import render
from tokenfleet.cli import build_parser
from tests.replicas import REPO

K8S = REPO / "deploy" / "k8s"
COMPOSE = REPO / "deploy" / "compose"
K8S_VERSION = "1.30.0"


def k8s_docs() -> list[tuple[str, dict[str, Any]]]:
    return [(f.name, d) for f in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]


def kind(name: str) -> list[dict[str, Any]]:
    return [d for _, d in k8s_docs() if d["kind"] == name]


def containers() -> list[dict[str, Any]]:
    return [c for d in k8s_docs() if d[1]["kind"] in ("Deployment", "StatefulSet")
            for c in d[1]["spec"]["template"]["spec"]["containers"]]


def parse_up(argv: list[str]) -> Any:
    assert argv[0] == "up", argv
    try:
        return build_parser("up").parse_args(argv)
    except SystemExit:
        pytest.fail(f"`tokenfleet {' '.join(argv)}`: a flag or value the CLI does not take")


def parse_worker(argv: list[str]) -> Any:
    try:
        return build_arg_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"`python -m engine_adapters.sim.worker {' '.join(argv)}`: not the worker's flags")


def configmap_fleet(tmp_path: Path) -> FleetConfig:
    (cm,) = [d for d in kind("ConfigMap") if d["metadata"]["name"] == "tokenfleet-fleet"]
    path = tmp_path / "fleet.yaml"
    path.write_text(cm["data"]["fleet.yaml"])
    return load_fleet_file(path)


def test_every_manifest_is_valid_kubernetes() -> None:
    docs = k8s_docs()
    assert {d["kind"] for _, d in docs} >= {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget",
                                            "HorizontalPodAutoscaler", "StatefulSet"}
    for name, d in docs:
        try:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{name}: {d['kind']} {d['metadata']['name']}: {e}")


def test_the_validator_rejects_a_bad_manifest() -> None:
    # offline and strict, really: a misspelt field fails
    (dep, *_) = [d for d in kind("Deployment") if d["metadata"]["name"] == "tokenfleet-gateway"]
    bad = copy.deepcopy(dep)
    bad["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_commands_match_the_cli_and_the_fleet_file(tmp_path: Path) -> None:
    config = configmap_fleet(tmp_path)
    services = {d["metadata"]["name"] for d in kind("Service")}
    gateways = [c for c in containers() if c.get("command") == ["tokenfleet"]]
    workers = [c for c in containers() if c.get("command", [""])[-1] == "engine_adapters.sim.worker"]
    assert gateways and workers
    for c in gateways:
        args = parse_up(c["args"])
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert str(Path(args.fleet).parent) in mounts
        assert urlparse(args.redis_url).hostname in services
        assert args.ops_port == config.gateway.ops_port  # the probes' and Prometheus' port
    for c in workers:
        w = parse_worker(c["args"])
        assert w.served_model_name in {m.name for m in config.models}
    # every sim URL is a worker pod that exists: {statefulset}-{i}.{serviceName}
    pods = {f"{s['metadata']['name']}-{i}.{s['spec']['serviceName']}"
            for s in kind("StatefulSet") for i in range(s["spec"]["replicas"])}
    urls = [u for d in config.deployments for u in d.options.get("urls", [])]
    assert {urlparse(u).hostname for u in urls} == pods
    assert sum(d.instance_count for d in config.deployments) == len(urls)


def test_gateway_shutdown_probes_and_disruption(tmp_path: Path) -> None:
    config = configmap_fleet(tmp_path)
    (dep,) = [d for d in kind("Deployment") if d["metadata"]["name"] == "tokenfleet-gateway"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] >= float(pre_stop[1]) + config.gateway.shutdown_grace_s + 10
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    ready, live = c["readinessProbe"]["httpGet"], c["livenessProbe"]["httpGet"]
    assert ready["path"] == "/health"  # 503 when shutting down takes it out of the Service
    assert live["path"] != "/health"  # a draining (503) gateway must not be killed
    assert ports[ready["port"]] == ports[live["port"]] == config.gateway.ops_port
    # liveness outlasts a drain (the gateway stops accepting while streams finish)
    assert c["livenessProbe"]["periodSeconds"] * c["livenessProbe"]["failureThreshold"] > config.gateway.shutdown_grace_s
    assert dep["spec"]["replicas"] >= 2
    (pdb,) = kind("PodDisruptionBudget")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (svc,) = [s for s in kind("Service") if s["metadata"]["name"] == "tokenfleet-gateway"]
    assert svc["spec"]["selector"].items() <= labels.items()


def test_hpa_scales_on_a_metric_the_gateway_exports() -> None:
    from gateway.metrics import GatewayMetrics
    exported = {m.name for m in GatewayMetrics().registry.collect()}
    (hpa,) = kind("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "tokenfleet-gateway"
    names = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    assert names and set(names) <= exported, (names, sorted(exported))
    rules = yaml.safe_load(next(d for d in kind("ConfigMap") if d["metadata"]["name"] == "adapter-config")
                           ["data"]["config.yaml"])["rules"]
    assert {r["name"]["as"] for r in rules} >= set(names)
    assert all(r["seriesQuery"].split("{")[0] in exported for r in rules)


def test_compose_in_step_with_cli_fleet_and_haproxy() -> None:
    compose = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
    services = compose["services"]
    config = load_fleet_file(COMPOSE / "fleet.yaml")
    gateways = {n: s for n, s in services.items() if n.startswith("gateway-")}
    assert len(gateways) >= 2
    for s in gateways.values():
        args = parse_up(s["command"])
        assert urlparse(args.redis_url).hostname in services
        mount = next(v for v in s["volumes"] if v.endswith(f":{args.fleet}:ro"))
        assert (COMPOSE / mount.split(":")[0]).resolve() == (COMPOSE / "fleet.yaml").resolve()
        assert float(s["stop_grace_period"].rstrip("s")) >= config.gateway.shutdown_grace_s + 10
    workers = {n: s for n, s in services.items() if s.get("entrypoint", [""])[-1] == "engine_adapters.sim.worker"}
    for s in workers.values():
        parse_worker(s["command"])
    urls = [u for d in config.deployments for u in d.options.get("urls", [])]
    assert {urlparse(u).hostname for u in urls} == set(workers)
    assert (COMPOSE / "haproxy.cfg").read_text() == render([(n, 8080) for n in sorted(gateways)], "*:8000")
