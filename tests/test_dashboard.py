"""The live goodput dashboard: its bounded series, its auth, and the page rendered in real
headless Chromium over a live gateway with simulated workers and FleetMind's planner on."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from fleetcore.fleet_config import load_fleet_file
from fleetcore.slo import ClassSLO
from fleetcore.types import RequestOutcome, RequestProfile
from gateway.admission import AdmissionGate
from gateway.dashboard import DashboardRecorder, DashboardSampler, DashboardSeries
from gateway.requests import ParsedRequest
from slomax import FCFS, SLOMax
from slomax.config import SLOMaxConfig, TenantPolicy
from slomax.ledger import GoodputLedger
from tests.chromium import headless_page
from gateway.embedded import serve_fleet

FLEET_FILE = Path(__file__).with_name("fleet_planner.yaml")
ADMIN_KEY = "sk-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
ACME = {"Authorization": "Bearer sk-acme"}
MODEL = "llama-3.1-8b"
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
SAMPLE_S = 0.25


# --- the series, without a gateway --------------------------------------------------------

def test_series_books_deltas_per_key_and_site_and_stays_bounded() -> None:
    ledger = GoodputLedger(60)
    rec = DashboardRecorder(latency_keep=3)
    series = DashboardSeries(ledger, rec, capacity=4)
    ledger.arrived("acme", "interactive", 0.0)
    assert series.sample(100.0) is None  # the baseline: what came before is not one huge point
    ledger.arrived("acme", "interactive", 1.0)
    ledger.admitted("acme", "interactive", 1.0)
    ledger.completed("acme", "interactive", 1.0, output_tokens=50, met=True)
    ledger.rejected("bob", "batch", 1.0, "queue_full")
    for i in range(5):
        rec.observe(RequestOutcome(f"r{i}", "i1", "east", ok=i != 4, output_tokens=10, ttft_s=0.1 * (i + 1),
                                   mean_tpot_s=0.02))
    s = series.sample(102.0)
    assert s is not None and s["dt"] == 2.0
    keys = {(k["tenant"], k["class"]): k for k in s["by_key"]}
    assert keys["acme", "interactive"]["arrived"] == 1 and keys["acme", "interactive"]["goodput_tokens"] == 50
    assert keys["acme", "interactive"]["ended"] == 1 and keys["acme", "interactive"]["met_slo"] == 1
    assert keys["bob", "batch"]["rejected_by"] == {"queue_full": 1} and keys["bob", "batch"]["ended"] == 1
    assert s["sites"] == {"east": {"ok": 4, "failed": 1, "output_tokens": 50,
                                   "ended": 0, "met_slo": 0, "goodput_tokens": 0}}
    assert [round(x[1], 1) for x in rec.latencies] == [0.3, 0.4, 0.5]  # the ring keeps the latest 3
    s = series.sample(103.0)
    assert s is not None and s["by_key"] == [] and set(s["sites"]["east"].values()) == {0}
    for t in range(104, 110):
        series.sample(float(t))
    assert len(series.samples) == 4 and series.samples[-1]["t"] == 109.0


class _NoFleet:
    def view(self) -> None:
        return None


@pytest.mark.parametrize("policy_type", [FCFS, SLOMax])
async def test_per_site_goodput_is_judged_as_the_ledger_judges_at_the_serving_site(policy_type: type) -> None:
    """Admitted requests end at two sites, meeting or missing their class SLO (a tenant's own
    SLO, a class deadline, the request's own deadline; failed and cancelled never meet it;
    one never dispatched has no site): exact per-site counts, summing to the ledger's."""
    cfg = SLOMaxConfig(tenants={"slow": TenantPolicy("slow", slos={"interactive": ClassSLO(ttft_s=5.0)})})
    policy = policy_type(cfg)
    gate = AdmissionGate(policy, _NoFleet(), lambda: 0.0)  # type: ignore[arg-type]
    rec = DashboardRecorder()
    gate.on_released.append(rec.released)
    series = DashboardSeries(policy.ledger, rec)
    series.sample(0.0)

    async def run(rid: str, site: str | None, tenant: str = "acme", cls: str | None = None,
                  deadline: float | None = None, **outcome: Any) -> None:
        profile = RequestProfile(rid, MODEL, 100, tenant=tenant, request_class=cls, arrival=0.0,
                                 deadline=deadline, stream=True)
        parsed, _ = await gate.enter(ParsedRequest("chat", {}, profile, None, False),  # type: ignore[arg-type]
                                     lambda aw: aw)
        assert parsed.profile.request_class == (cls or "interactive")
        if site is not None:
            gate.attempt_ended(RequestOutcome(rid, f"{site}-0", site, **{"ok": True, **outcome}))
        gate.release(rid)

    # interactive: TTFT <= 1 s, TPOT <= 50 ms; batch: within 600 s
    await run("e1", "east", ttft_s=0.5, mean_tpot_s=0.02, e2e_s=0.7, output_tokens=10)  # met
    await run("e2", "east", ttft_s=2.0, mean_tpot_s=0.02, e2e_s=2.2, output_tokens=10)  # TTFT missed
    await run("e3", "east", cls="batch", ttft_s=1.0, e2e_s=700.0, output_tokens=30)  # class deadline missed
    await run("e4", "east", deadline=1.0, ttft_s=0.3, mean_tpot_s=0.02, e2e_s=1.5, output_tokens=9)  # own deadline
    await run("w1", "west", ttft_s=0.2, mean_tpot_s=0.01, e2e_s=0.4, output_tokens=7)  # met
    await run("w2", "west", tenant="slow", ttft_s=2.0, mean_tpot_s=0.3, e2e_s=3.0, output_tokens=4)  # met: its SLO
    await run("w3", "west", ok=False, ttft_s=0.1, output_tokens=3, error="engine died")  # failed
    await run("w4", "west", ok=False, cancelled=True, ttft_s=0.1, output_tokens=2)  # cancelled
    await run("w5", "west", cls="batch", ttft_s=5.0, e2e_s=50.0, output_tokens=20)  # met
    await run("n1", None)  # never reached an engine: no site to book it at

    want = {"east": (4, 1, 10), "west": (5, 3, 31)}
    assert {site: (c.ended, c.met_slo, c.goodput_tokens) for site, c in rec.sites.items()} == want
    s = series.sample(10.0)
    assert s is not None
    assert {site: (d["ended"], d["met_slo"], d["goodput_tokens"]) for site, d in s["sites"].items()} == want
    # The same verdicts the ledger booked: the sites add up to its totals.
    cells = policy.ledger.totals.values()
    assert sum(c.met_slo for c in cells) == 4 and sum(c.goodput_tokens for c in cells) == 41
    s = series.sample(15.0)
    assert s is not None and all(d["ended"] == d["met_slo"] == d["goodput_tokens"] == 0 for d in s["sites"].values())


async def test_sampler_samples_on_its_timer_and_stops() -> None:
    series = DashboardSeries(GoodputLedger(60), DashboardRecorder())
    sampler = DashboardSampler(series, interval_s=0.02)
    sampler.start()
    deadline = time.monotonic() + 5
    while len(series.samples) < 3:
        assert time.monotonic() < deadline, "the sampler did not sample"
        await asyncio.sleep(0.01)
    task = sampler._task
    await asyncio.wait_for(sampler.stop(), 5)
    assert task is not None and task.done() and sampler._task is None
    n = len(series.samples)
    await asyncio.sleep(0.1)
    assert len(series.samples) == n  # stopped means stopped


# --- a live gateway -----------------------------------------------------------------------

@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gateway() -> AsyncIterator[str]:
    async with serve_fleet(load_fleet_file(FLEET_FILE), poll_interval_s=0.1, dashboard_sample_s=SAMPLE_S) as f:
        yield f.url


async def traffic(c: httpx.AsyncClient, url: str, n: int) -> list[int]:
    """Requests from site a's region (the planner sees demand there); every fifth one in the
    `tight` class, which always misses its SLO (attainment below 100%)."""
    async def one(i: int) -> int:
        headers = {**ACME, **({"x-tokenfleet-class": "tight"} if i % 5 == 0 else {})}
        r = await c.post(f"{url}/v1/chat/completions", headers=headers,
                         json={"model": MODEL, "max_tokens": 8, "stream": i % 2 == 0,
                               "messages": [{"role": "user", "content": f"question {i} " + "w " * 200}]})
        await r.aread()
        return r.status_code

    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(one(i)))
        await asyncio.sleep(0.08)
    return await asyncio.gather(*tasks)


pytestmark_live = pytest.mark.asyncio(loop_scope="module")


@pytestmark_live
async def test_dashboard_data_is_admin_only_and_the_page_is_locked_down(gateway: str) -> None:
    async with httpx.AsyncClient(timeout=30) as c:
        assert (await c.get(f"{gateway}/admin/v1/dashboard")).status_code == 401
        assert (await c.get(f"{gateway}/admin/v1/dashboard", headers=ACME)).status_code == 403
        r = await c.get(f"{gateway}/admin/v1/dashboard", headers=ADMIN)
        assert r.status_code == 200 and r.json()["object"] == "dashboard" and r.headers["cache-control"] == "no-store"
        page = await c.get(f"{gateway}/dashboard")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "form-action 'none'" in csp and "frame-ancestors 'none'" in csp
        assert ADMIN_KEY not in page.text
        for name in ("charts.js", "dashboard.js", "dashboard.css"):
            assert (await c.get(f"{gateway}/dashboard/static/{name}")).status_code == 200, name
        assert (await c.get(f"{gateway}/dashboard/static/..%2Fdashboard.py")).status_code == 404
        assert (await c.get(f"{gateway}/dashboard/static/dashboard.html")).status_code == 404


@pytest.mark.slow
@pytestmark_live
async def test_dashboard_renders_charts_with_data_in_headless_chromium(gateway: str, tmp_path: Path) -> None:
    async with httpx.AsyncClient(timeout=60) as c:
        statuses = await traffic(c, gateway, 40)
        assert statuses.count(200) >= 30, statuses
        deadline = time.monotonic() + 30  # the planner sees the demand in a's region within a few cycles
        while not (await c.get(f"{gateway}/admin/v1/planner", headers=ADMIN)).json()["entries"]:
            assert time.monotonic() < deadline, "the planner logged nothing"
            await asyncio.sleep(0.2)
        await asyncio.sleep(3 * SAMPLE_S)  # the last outcomes reach a sample
        data = (await c.get(f"{gateway}/admin/v1/dashboard", headers=ADMIN)).json()
    assert len(data["samples"]) >= 3 and data["latency"]["ttft_s"] and data["admission"]["admitted"] >= 30

    async with headless_page(tmp_path) as page:
        await page.call("Page.navigate", url=f"{gateway}/dashboard")
        # Without a key the page asks for one and shows no data.
        await page.wait_for("document.body && document.body.dataset.state === 'login'", 20, "the login form showed")
        assert await page.evaluate("document.getElementById('dash').hidden") is True
        await page.evaluate(f"document.getElementById('key').value = {ADMIN_KEY!r};"
                            "document.getElementById('login-submit').click(); true")
        await page.wait_for("document.body.dataset.state === 'ready'", 20, "the dashboard rendered")
        # Charts need a few samples' worth of points; each chart reports what it drew.
        counts: dict[str, Any] = await page.wait_for(
            "(() => { const c = {}; document.querySelectorAll('figure.chart').forEach("
            "f => c[f.id] = [+(f.dataset.points || 0), +(f.dataset.series || 0)]);"
            "return Object.values(c).every(v => v[0] > 0) ? c : null })()",
            20, "every chart drew data points")
        planner_rows = await page.evaluate("+document.getElementById('planner').dataset.entries")
        href = await page.evaluate("location.href")
        stored = await page.evaluate("sessionStorage.getItem('tokenfleet-admin-key')")
        ARTIFACTS.mkdir(exist_ok=True)
        shot = await page.screenshot(ARTIFACTS / "dashboard.png")
    print(f"\ndashboard screenshot: {shot}")
    assert set(counts) == {"goodput-class", "attainment-class", "goodput-tenant", "attainment-tenant",
                           "output-site", "goodput-site", "attainment-site", "admission", "ttft-cdf",
                           "tpot-cdf"}, counts
    assert counts["goodput-class"][1] >= 2  # the default class and `tight`
    assert counts["attainment-class"][0] >= 2 and counts["output-site"][1] == 2  # sites a and b
    assert counts["goodput-site"][1] == 2 and counts["attainment-site"][0] >= 1
    # Per site, the requests that met their SLO are the ledger's: the samples add up to its totals.
    site_met = sum(d["met_slo"] for s in data["samples"] for d in s["sites"].values())
    key_met = sum(k["met_slo"] for s in data["samples"] for k in s["by_key"])
    site_good = sum(d["goodput_tokens"] for s in data["samples"] for d in s["sites"].values())
    key_good = sum(k["goodput_tokens"] for s in data["samples"] for k in s["by_key"])
    assert site_met == key_met > 0 and site_good == key_good > 0
    assert counts["ttft-cdf"][0] >= 30 and counts["admission"][0] >= 2  # admitted and queued bars at least
    assert planner_rows >= 1
    assert ADMIN_KEY not in href and stored == ADMIN_KEY  # in the tab's storage, never in the URL
    assert shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
