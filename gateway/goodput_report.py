"""Goodput reports and the admission admin view.

    GET /v1/reports/goodput    the goodput ledger: per tenant x class (x window with per_window=true)
        ?tenant=NAME           a tenant key may name only its own tenant (else 403); an admin key any
        &class=NAME            one request class
        &window=15m            the last 15 minutes (seconds, or a number with s/m/h/d); default: all kept
        &per_window=true       one row per ledger window (report_window_s, 60 s by default)
        &format=csv            or `Accept: text/csv`; JSON otherwise
    GET /v1/reports/goodput/misses   why it missed: the latest requests that missed their SLO
        ?window= &class= &tenant=   as above (a tenant key sees only its own); &limit=100 (at most 1000)
                                    (id, class, TTFT, TPOT, queue wait, site, instance, reason; newest
                                    first, from a bounded ring) and latency percentiles per class
    GET /admin/v1/admission    admin key only: the policy's live state (limits, queues, in flight)

Access: no key 401; a tenant key sees only its own tenant; an admin key (fleet file
`admin_api_key_sha256`, or dev `admin_api_keys`) sees every tenant and the admin view;
a tenant key on the admin view gets 403. A fleet with neither tenants nor admin keys is
an open dev fleet: everything is visible, as completions are open there.

Rows (JSON and CSV alike): tenant, class, window_start, window_end (UTC, ISO 8601),
arrived, admitted, queued, rejected (and per reason), completed, met_slo, cancelled,
failed, retried, output_tokens, goodput_tokens, goodput_tok_s, attainment (met_slo /
arrived: rejected, abandoned and failed requests count against it). JSON also carries
`totals`, the same figures over all selected rows. Windows are `report_window_s` long in
the gateway's own (monotonic) clock, shown in wall-clock time.
"""

from __future__ import annotations

import csv
import hashlib
import io
import re
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from fleetcore.fleet_config import FleetConfig
from gateway.admission import AdmissionGate
from gateway.auth import bearer_token
from gateway.errors import GatewayError, bad_request, invalid_api_key
from gateway.policy_store import StoreUnavailable
from gateway.slo_log import SLOLog, as_row
from slomax.ledger import COUNTERS, REJECT_REASONS, Cell, row

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    m = _DURATION.match(text)
    if not m or float(m.group(1)) <= 0:
        raise bad_request(f"`window` must be a positive duration such as 900, 15m, 1h or 2d; got {text!r}.",
                          "window")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def _forbidden(message: str) -> GatewayError:
    return GatewayError(403, message, type="permission_error", code="forbidden")


class ReportAccess:
    """Who is asking: an admin (sees all) or one tenant."""

    def __init__(self, config: FleetConfig) -> None:
        self._admin = set(config.admin_key_hashes())
        self._tenants = {h: t.name for t in config.tenants for h in t.key_hashes()}
        self.open = not self._admin and not self._tenants

    def principal(self, headers: Mapping[str, str]) -> tuple[str | None, bool]:
        """(tenant, is_admin); raises 401 without a key or with an unknown one."""
        if self.open:
            return None, True
        key = bearer_token(headers.get("authorization"))
        if key is None:
            raise invalid_api_key("Missing API key. Send `Authorization: Bearer <key>`.")
        digest = hashlib.sha256(key.encode("utf-8")).hexdigest()
        if digest in self._admin:
            return None, True
        tenant = self._tenants.get(digest)
        if tenant is None:
            raise invalid_api_key("Incorrect API key provided.")
        return tenant, False


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _to_wall(rows: list[dict[str, Any]], offset: float) -> None:
    for r in rows:
        r["window_start"] = _iso(r["window_start"] + offset)
        r["window_end"] = _iso(r["window_end"] + offset)


def _totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    cell = Cell()
    for r in rows:
        for k in COUNTERS:
            setattr(cell, k, getattr(cell, k) + r[k])
        for reason, n in r["rejected_by_reason"].items():
            cell.rejected_by[reason] = cell.rejected_by.get(reason, 0) + n
    out = row("*", "*", cell, 0.0, 0.0)
    for k in ("tenant", "class", "window_start", "window_end", "goodput_tok_s"):
        out.pop(k)
    return out


CSV_COLUMNS = (["tenant", "class", "window_start", "window_end", *COUNTERS[:4]]
               + [f"rejected_{r}" for r in REJECT_REASONS] + [*COUNTERS[4:], "goodput_tok_s", "attainment"])


def to_csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for r in rows:
        flat = {**r, **{f"rejected_{k}": 0 for k in REJECT_REASONS},
                **{f"rejected_{k}": v for k, v in r["rejected_by_reason"].items()}}
        w.writerow(["" if flat.get(c) is None else flat[c] for c in CSV_COLUMNS])  # "": no attainment yet
    return buf.getvalue()


def _truthy(v: str | None) -> bool:
    return (v or "").strip().lower() in ("1", "true", "yes", "on")


def install_report_routes(app: FastAPI, config: FleetConfig, gate: AdmissionGate,
                          clock: Callable[[], float], slo_log: SLOLog | None = None) -> None:
    access = ReportAccess(config)
    classes = config.admission.class_names

    def selection(request: Request) -> tuple[str | None, str | None, float | None]:
        """(tenant, class, window span) the caller may read; 401/403/400 otherwise."""
        tenant, admin = access.principal(request.headers)
        q = request.query_params
        want = q.get("tenant")
        if not admin:
            if want is not None and want != tenant:
                raise _forbidden("A tenant key can read only its own tenant's report.")
            want = tenant
        cls = q.get("class")
        if cls is not None and cls not in classes:
            raise bad_request(f"Unknown class {cls!r}; known: {', '.join(sorted(classes))}.", "class")
        window = q.get("window")
        return want, cls, parse_duration(window) if window else None

    @app.get("/v1/reports/goodput")
    async def goodput_report(request: Request) -> Response:
        want, cls, span = selection(request)
        q = request.query_params
        now = clock()
        ledger = gate.policy.ledger
        tenants = None if want is None else {want}
        rows, source = None, "local"
        if gate.shared_ledger is not None and gate.shared_ledger.shared.up:
            try:  # every replica's figures (gateway.ledger_sync), windows already in unix time
                rows = await gate.shared_ledger.report(tenants=tenants, request_class=cls, per_window=_truthy(
                    q.get("per_window")), since_unix=None if span is None else time.time() - span)
                source = "shared"
                _to_wall(rows, 0.0)
            except StoreUnavailable:
                rows = None  # Redis went away: this replica's own ledger, as for a single gateway
        if rows is None:
            rows = ledger.report(tenants=tenants, request_class=cls,
                                 since=None if span is None else now - span, per_window=_truthy(q.get("per_window")))
            _to_wall(rows, time.time() - now)
        fmt = (q.get("format") or "").lower()
        if fmt not in ("", "json", "csv"):
            raise bad_request(f"`format` must be json or csv; got {fmt!r}.", "format")
        if fmt == "csv" or (not fmt and "text/csv" in request.headers.get("accept", "")):
            return Response(to_csv(rows), media_type="text/csv; charset=utf-8")
        return JSONResponse({"object": "goodput_report", "policy": gate.policy.name, "tenant": want, "class": cls,
                             "window_s": span, "ledger_window_s": ledger.window_s, "source": source, "generated_at": _iso(time.time()),
                             "rows": rows, "totals": _totals(rows)})

    @app.get("/v1/reports/goodput/misses")
    async def slo_misses(request: Request) -> JSONResponse:
        want, cls, span = selection(request)
        try:
            limit = max(0, min(int(request.query_params.get("limit", "100")), 1000))
        except ValueError:
            raise bad_request("`limit` must be an integer.", "limit") from None
        log = slo_log if slo_log is not None else SLOLog(0, 0)
        now = clock()
        since = None if span is None else now - span
        offset = time.time() - now
        misses = log.misses(since=since, tenant=want, request_class=cls, limit=limit)
        return JSONResponse({"object": "slo_misses", "tenant": want, "class": cls, "window_s": span,
                             "kept": log.capacity, "generated_at": _iso(time.time()),
                             "misses": [as_row(f, offset) for f in misses],
                             "latency": log.latency(since=since, tenant=want, request_class=cls)})

    @app.get("/admin/v1/admission")
    async def admission_state(request: Request) -> JSONResponse:
        _, admin = access.principal(request.headers)
        if not admin:
            raise _forbidden("This endpoint needs an admin key.")
        snap = gate.policy.snapshot(clock())
        snap["waiting_clients"] = gate.waiting
        return JSONResponse(snap)
