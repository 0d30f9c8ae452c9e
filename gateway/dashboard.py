"""The live goodput dashboard: a bounded time series sampled from the goodput ledger, and the page.

    GET /dashboard              the page (plain HTML + gateway/static/*.js, no CDN, no build step).
                                It holds no data and no secret: it asks for the admin key in a form,
                                keeps it in the tab's sessionStorage and sends it as a bearer header
                                to the endpoint below, so the key never travels in a URL (which
                                access logs and browser history keep).
    GET /dashboard/static/NAME  the page's script and style sheet (a fixed list of files)
    GET /admin/v1/dashboard     admin key only (a tenant key 403, none 401; an open dev fleet is
                                open, as for the goodput report): the samples, the SLO targets,
                                admission outcomes, recent TTFT/TPOT, the planner's report

A sample, every `interval_s` (5 s by default), holds what changed since the previous one:
per tenant x class the ledger's counters (arrived, admitted, queued, rejected and by reason,
completed, met_slo, ended = completed + rejected + cancelled + failed, output and goodput
tokens), per site the attempts that ended there (ok, failed, output tokens) and the admitted
requests whose final attempt was there (ended, met_slo, goodput_tokens: judged by the
admission policy as its ledger judges them, `LedgeredAdmission.judge`). Unlike the
goodput report, which books a request to the window it *arrived* in, a sample books it to
when it was counted, so a chart's last point is never revised later. The series is a ring
buffer of `capacity` samples (an hour at the defaults); recent latencies are another one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from fleetcore.fleet_config import FleetConfig
from fleetcore.policies import Admission
from fleetcore.types import RequestOutcome, RequestProfile
from gateway.background import cancel_and_wait
from gateway.errors import GatewayError
from gateway.goodput_report import ReportAccess
from slomax.ledger import COUNTERS, Cell, GoodputLedger

log = logging.getLogger("tokenfleet.gateway")

DEFAULT_INTERVAL_S = 5.0
DEFAULT_CAPACITY = 720  # samples: one hour at 5 s
LATENCY_KEEP = 2000  # most recent attempts whose TTFT/TPOT the distributions show
PLANNER_ENTRIES = 50

# The page may load only its own files: no inline script, no third-party origin, no framing,
# no form that submits anywhere (the login form is handled in script, never sent as a URL).
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_PAGE_HEADERS = {"Content-Security-Policy": _CSP, "Referrer-Policy": "no-referrer",
                 "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY", "Cache-Control": "no-store"}
_STATIC = {"dashboard.js": "text/javascript", "charts.js": "text/javascript", "dashboard.css": "text/css"}


@dataclass(slots=True)
class _SiteCount:
    ok: int = 0  # attempts that ended there (the relay)
    failed: int = 0
    output_tokens: int = 0
    ended: int = 0  # admitted requests whose final attempt was there (the admission gate)
    met_slo: int = 0  # ... of which met their class SLO, as the ledger judged them
    goodput_tokens: int = 0  # their output tokens


_SITE_FIELDS = ("ok", "failed", "output_tokens", "ended", "met_slo", "goodput_tokens")


class DashboardRecorder:
    """A relay listener (`arrived`, `observe`): per-site attempt counts and recent latencies;
    and an admission-gate listener (`released`): per-site goodput and SLO attainment.

    The ledger knows tenants and classes but not sites; the relay's outcomes know the site, and
    the gate's release has both the admitted class and the final outcome, with the policy's
    verdict on it (`LedgeredAdmission.judge`: the ledger's own judgment, never a second one)."""

    def __init__(self, latency_keep: int = LATENCY_KEEP) -> None:
        self.sites: dict[str, _SiteCount] = {}
        # (site, ttft_s, mean_tpot_s) of the latest attempts that produced a first token
        self.latencies: deque[tuple[str, float, float | None]] = deque(maxlen=latency_keep)

    def arrived(self, profile: RequestProfile) -> None:
        return None  # only outcomes matter here

    def _site(self, site: str) -> _SiteCount:
        c = self.sites.get(site)
        if c is None:
            c = self.sites[site] = _SiteCount()
        return c

    def released(self, profile: RequestProfile, outcome: RequestOutcome, met: bool) -> None:
        """An admitted request ended (AdmissionGate.on_released): booked at the site of its final
        attempt. One that never reached a site (no ready instance) is the ledger's alone."""
        if not outcome.site:
            return
        c = self._site(outcome.site)
        c.ended += 1
        if met:
            c.met_slo += 1
            c.goodput_tokens += outcome.output_tokens

    def observe(self, outcome: RequestOutcome) -> None:
        if not outcome.site:
            return  # never reached an engine: admission's rejections are in the ledger
        c = self._site(outcome.site)
        if outcome.ok:
            c.ok += 1
        elif not outcome.cancelled:
            c.failed += 1
        c.output_tokens += outcome.output_tokens
        # A whole (non-streamed) answer has no separate first token: its TTFT is its e2e time,
        # as the ledger judges it (`slomax.admission.met_slo`).
        ttft = outcome.ttft_s if outcome.ttft_s is not None else (outcome.e2e_s if outcome.ok else None)
        if ttft is not None:
            self.latencies.append((outcome.site, ttft, outcome.mean_tpot_s))


def _ended(c: Cell) -> int:
    return c.completed + c.rejected + c.cancelled + c.failed


@dataclass
class DashboardSeries:
    """The ring buffer of samples. `sample(now)` is synchronous and clock-free (the caller
    passes wall time), so tests drive it directly; `DashboardSampler` calls it on a timer."""

    ledger: GoodputLedger
    recorder: DashboardRecorder
    capacity: int = DEFAULT_CAPACITY
    samples: deque[dict[str, Any]] = field(init=False)
    _last_t: float | None = field(default=None, init=False)
    _last_cells: dict[tuple[str, str], Cell] = field(default_factory=dict, init=False)
    _last_sites: dict[str, _SiteCount] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.samples = deque(maxlen=self.capacity)

    def sample(self, now: float) -> dict[str, Any] | None:
        """Append what changed since the previous call; the first call only sets the baseline
        (counts from before it would all land in one misleading first point)."""
        keys: list[dict[str, Any]] = []
        for (tenant, cls), cell in sorted(self.ledger.totals.items()):
            before = self._last_cells.get((tenant, cls), Cell())
            d = {k: getattr(cell, k) - getattr(before, k) for k in COUNTERS}
            d["ended"] = _ended(cell) - _ended(before)
            d["rejected_by"] = {r: n - before.rejected_by.get(r, 0) for r, n in sorted(cell.rejected_by.items())
                                if n != before.rejected_by.get(r, 0)}
            if any(d[k] for k in COUNTERS):  # unchanged keys are left out: samples stay small
                keys.append({"tenant": tenant, "class": cls, **d})
            snap = Cell()
            snap.add(cell)
            self._last_cells[(tenant, cls)] = snap
        sites: dict[str, dict[str, int]] = {}
        for site, c in sorted(self.recorder.sites.items()):
            b = self._last_sites.get(site, _SiteCount())
            sites[site] = {k: getattr(c, k) - getattr(b, k) for k in _SITE_FIELDS}
            self._last_sites[site] = _SiteCount(*(getattr(c, k) for k in _SITE_FIELDS))
        last, self._last_t = self._last_t, now
        if last is None:
            return None
        s = {"t": round(now, 3), "dt": round(max(now - last, 1e-6), 3), "by_key": keys, "sites": sites}
        self.samples.append(s)
        return s


class DashboardSampler:
    """Samples the series every `interval_s` on the event loop, until `stop`."""

    def __init__(self, series: DashboardSeries, interval_s: float = DEFAULT_INTERVAL_S,
                 wall_clock: Callable[[], float] = time.time) -> None:
        if not interval_s > 0:
            raise ValueError("interval_s must be positive")
        self.series = series
        self.interval_s = interval_s
        self.wall_clock = wall_clock
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self.series.sample(self.wall_clock())  # the baseline
            self._task = asyncio.create_task(self._run(), name="dashboard-sampler")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.series.sample(self.wall_clock())
            except Exception:  # a bug here must not end the sampling (nor the gateway)
                log.exception("dashboard sample failed")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait([task])


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def dashboard_data(config: FleetConfig, sampler: DashboardSampler, policy: Admission,
                   placement: Any) -> dict[str, Any]:
    """The JSON the page draws (see the module doc)."""
    series = sampler.series
    admission: dict[str, Any] = {"admitted": 0, "queued": 0, "rejected": 0, "rejected_by": {}}
    for s in series.samples:
        for k in s["by_key"]:
            for name in ("admitted", "queued", "rejected"):
                admission[name] += k[name]
            for r, n in k["rejected_by"].items():
                admission["rejected_by"][r] = admission["rejected_by"].get(r, 0) + n
    lat = list(series.recorder.latencies)
    return {
        "object": "dashboard",
        "policy": policy.name,
        "generated_at": _iso(time.time()),
        "interval_s": sampler.interval_s,
        "capacity": series.capacity,
        "slos": {name: {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}
                 for name, slo in sorted(config.admission.slos().items())},
        "sites": [s.name for s in config.sites],
        "samples": list(series.samples),
        "admission": admission,  # over the samples kept (the chart's time span)
        "latency": {"site": [x[0] for x in lat], "ttft_s": [round(x[1], 5) for x in lat],
                    "tpot_s": [None if x[2] is None else round(x[2], 6) for x in lat]},
        "planner": (placement.report(PLANNER_ENTRIES) if placement is not None
                    else {"enabled": False, "placement": [], "entries": [], "actions": []}),
    }


def _static(name: str) -> bytes:
    return resources.files("gateway").joinpath("static", name).read_bytes()


def install_dashboard_routes(app: FastAPI, config: FleetConfig, sampler: DashboardSampler, policy: Any,
                             placement: Any = None) -> None:
    access = ReportAccess(config)
    page = _static("dashboard.html")  # read once: a missing file fails at start, not on a request
    files = {name: (_static(name), media) for name, media in _STATIC.items()}

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS)

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def dashboard_static(name: str) -> Response:
        if name not in files:
            raise GatewayError(404, f"No dashboard file {name!r}.", code="not_found")
        body, media = files[name]
        return Response(body, media_type=f"{media}; charset=utf-8",
                        headers={"X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"})

    @app.get("/admin/v1/dashboard")
    async def dashboard_json(request: Request) -> JSONResponse:
        _, admin = access.principal(request.headers)
        if not admin:
            raise GatewayError(403, "This endpoint needs an admin key.", type="permission_error", code="forbidden")
        return JSONResponse(dashboard_data(config, sampler, policy, placement), headers={"Cache-Control": "no-store"})


def wire(ledger: GoodputLedger, interval_s: float | None) -> tuple[DashboardRecorder, DashboardSampler]:
    """The recorder (add it to the relay's listeners, and its `released` to the admission gate's
    `on_released`) and the sampler (start/stop in the lifespan)."""
    recorder = DashboardRecorder()
    sampler = DashboardSampler(DashboardSeries(ledger, recorder), interval_s or DEFAULT_INTERVAL_S)
    return recorder, sampler

