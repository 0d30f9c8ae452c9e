"""deploy/grafana/tokenfleet.json queries only metrics a live gateway exposes on /metrics."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from fleetcore.fleet_config import load_fleet_file
from gateway.embedded import serve_fleet

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "tokenfleet.json"
FLEET_FILE = Path(__file__).with_name("fleet_planner.yaml")  # planner on: its metrics are exposed too
ADMIN = {"Authorization": "Bearer sk-admin"}
ACME = {"Authorization": "Bearer sk-acme"}
_METRIC = re.compile(r"\b(?:tokenfleet|gen_ai)_[A-Za-z0-9_]+")  # ours, and the OTel GenAI names
# What the dashboard must show at least (issue 16): goodput, attainment, requests by status,
# admission outcomes and reasons, replicas, event-loop lag, engine restarts, the planner;
# and TTFT, TPOT and queue wait per class from the per-class histograms.
REQUIRED = {"tokenfleet_goodput_tokens_total", "tokenfleet_goodput_requests_total", "tokenfleet_requests_total",
            "tokenfleet_admission_rejected_total", "tokenfleet_replicas", "tokenfleet_event_loop_lag_recent_max_seconds",
            "tokenfleet_engine_restarts_total", "tokenfleet_planner_decisions_total", "tokenfleet_ttft_seconds_bucket",
            "gen_ai_server_time_to_first_token_seconds_bucket", "gen_ai_server_time_per_output_token_seconds_bucket",
            "tokenfleet_queue_wait_seconds_bucket"}

live = pytest.mark.asyncio(loop_scope="module")


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))  # rows may nest theirs


def expressions(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    out = [(f"panel {p['title']!r}", t["expr"]) for p in _panels(dashboard["panels"]) for t in p.get("targets", [])]
    for v in dashboard.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            out.append((f"variable ${v['name']}", q))
    return out


def referenced(expr: str) -> set[str]:
    return set(_METRIC.findall(expr))


def exposed_names(text: str) -> set[str]:
    """Every series name /metrics can carry, from its families (a family without samples yet
    still has its # TYPE line) and the suffixes its type implies."""
    names: set[str] = set()
    for f in text_string_to_metric_families(text):
        names.add(f.name)
        names.update(s.name for s in f.samples)
        if f.type == "counter":
            names.add(f"{f.name}_total")
        elif f.type == "histogram":
            names.update(f"{f.name}{s}" for s in ("_bucket", "_sum", "_count"))
    return names


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def metrics_text() -> AsyncIterator[str]:
    async with serve_fleet(load_fleet_file(FLEET_FILE), poll_interval_s=0.1) as f:
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(f"{f.url}/v1/completions", headers=ACME,
                             json={"model": "llama-3.1-8b", "prompt": "hello", "max_tokens": 4})
            assert r.status_code == 200, r.text
            m = await c.get(f"{f.url}/metrics", headers=ADMIN)  # admin: per-tenant series included
            assert m.status_code == 200
            yield m.text


def test_dashboard_is_grafana_json_with_queries() -> None:
    d = json.loads(DASHBOARD.read_text())
    assert d["title"] and d["uid"] and d["schemaVersion"] >= 36
    exprs = expressions(d)
    assert len(exprs) >= 20
    for where, e in exprs:
        assert referenced(e), f"{where} queries no tokenfleet metric: {e}"
    ids = [p["id"] for p in _panels(d["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


@live
async def test_every_promql_metric_is_exposed_by_a_live_gateway(metrics_text: str) -> None:
    exposed = exposed_names(metrics_text)
    assert "tokenfleet_requests_total" in exposed and "tokenfleet_ttft_seconds_bucket" in exposed
    assert not referenced("rate(tokenfleet_no_such_metric_total[5m])") <= exposed  # the check can fail
    assert not referenced("rate(gen_ai_no_such_metric_bucket[5m])") <= exposed
    used: set[str] = set()
    missing = []
    for where, e in expressions(json.loads(DASHBOARD.read_text())):
        used |= referenced(e)
        missing += [f"{where}: {name}" for name in sorted(referenced(e) - exposed)]
    assert not missing, "the dashboard queries metrics the gateway does not expose:\n" + "\n".join(missing)
    assert REQUIRED <= used, f"the dashboard leaves out {sorted(REQUIRED - used)}"
