"""The goodput ledger: what happened to every request, per tenant x class x time window.

Every event is booked to the window of the request's *arrival* (a cohort), so a
window's attainment is "of the requests that arrived then, the fraction that
finished within their SLO" — rejected, abandoned (cancelled) and failed requests
count against it, so refusing work cannot look like success.

Counters per cell: arrived, admitted, queued, rejected (and by reason), completed,
met_slo, cancelled, failed, retried (attempts repeated on another instance: duplicate
work), output_tokens (everything streamed, late or cancelled ones included),
goodput_tokens (output of requests that met their SLO). Cumulative totals per
tenant x class, which old windows never leave, feed the Prometheus counters.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from fleetcore.policies import Admission
from fleetcore.types import RequestOutcome, RequestProfile

COUNTERS = ("arrived", "admitted", "queued", "rejected", "completed", "met_slo", "cancelled", "failed",
            "retried", "output_tokens", "goodput_tokens")
REJECT_REASONS = ("budget_tokens", "budget_requests", "budget_concurrency", "slo_unattainable",
                  "queue_timeout", "queue_full", "other")


@dataclass(slots=True)
class Cell:
    arrived: int = 0
    admitted: int = 0
    queued: int = 0
    rejected: int = 0
    completed: int = 0
    met_slo: int = 0
    cancelled: int = 0
    failed: int = 0
    retried: int = 0
    output_tokens: int = 0
    goodput_tokens: int = 0
    rejected_by: dict[str, int] = field(default_factory=dict)

    def add(self, other: Cell) -> None:
        for k in COUNTERS:
            setattr(self, k, getattr(self, k) + getattr(other, k))
        for r, n in other.rejected_by.items():
            self.rejected_by[r] = self.rejected_by.get(r, 0) + n

    @property
    def attainment(self) -> float | None:
        """met / arrived: every request that arrived and did not get its SLO is a miss."""
        return self.met_slo / self.arrived if self.arrived else None


Key = tuple[str, str]  # tenant, class


class GoodputLedger:
    def __init__(self, window_s: float = 60.0, keep_windows: int = 1440) -> None:
        if not window_s > 0:
            raise ValueError("window_s must be positive")
        self.window_s = float(window_s)
        self.keep_windows = keep_windows
        self._cells: dict[int, dict[Key, Cell]] = {}
        self.totals: dict[Key, Cell] = {}
        # `_cells_for`'s last answer: window, tenant, class -> (window cell, total cell)
        self._memo_w: int | None = None
        self._memo_tenant = self._memo_class = ""
        self._memo: tuple[Cell, Cell] = (Cell(), Cell())

    # -- booking ---------------------------------------------------------------------

    def _index(self, t: float) -> int:
        return math.floor(t / self.window_s)

    def _cells_for(self, tenant: str, request_class: str, arrival: float) -> tuple[Cell, Cell]:
        w = self._index(arrival)
        # The last pair again when it is the same window and key (a request's events book to
        # its arrival's window: arrived, admitted and its end mostly follow one another).
        if w == self._memo_w and tenant == self._memo_tenant and request_class == self._memo_class:
            return self._memo
        win = self._cells.get(w)
        if win is None:
            win = self._cells[w] = {}
            self._trim(w)
        key = (tenant, request_class)
        cell = win.get(key)
        if cell is None:
            cell = win[key] = Cell()
        total = self.totals.get(key)
        if total is None:
            total = self.totals[key] = Cell()
        self._memo_w, self._memo_tenant, self._memo_class = w, tenant, request_class
        self._memo = (cell, total)
        return self._memo

    def _trim(self, newest: int) -> None:
        if len(self._cells) > self.keep_windows:
            for w in sorted(self._cells)[: len(self._cells) - self.keep_windows]:
                if w != newest:
                    del self._cells[w]  # (only ever from `_cells_for`, which then keeps the newest pair)

    # One method per event, each adding to the request's cell and to the running total: no
    # keyword dict and no setattr by name on every request.

    def arrived(self, tenant: str, request_class: str, arrival: float) -> None:
        cell, total = self._cells_for(tenant, request_class, arrival)
        cell.arrived += 1
        total.arrived += 1

    def admitted(self, tenant: str, request_class: str, arrival: float) -> None:
        cell, total = self._cells_for(tenant, request_class, arrival)
        cell.admitted += 1
        total.admitted += 1

    def queued(self, tenant: str, request_class: str, arrival: float) -> None:
        cell, total = self._cells_for(tenant, request_class, arrival)
        cell.queued += 1
        total.queued += 1

    def rejected(self, tenant: str, request_class: str, arrival: float, reason: str) -> None:
        reason = reason if reason in REJECT_REASONS else "other"
        for c in self._cells_for(tenant, request_class, arrival):
            c.rejected += 1
            c.rejected_by[reason] = c.rejected_by.get(reason, 0) + 1

    def completed(self, tenant: str, request_class: str, arrival: float, output_tokens: int, met: bool) -> None:
        m, good = int(met), (output_tokens if met else 0)
        for c in self._cells_for(tenant, request_class, arrival):
            c.completed += 1
            c.met_slo += m
            c.output_tokens += output_tokens
            c.goodput_tokens += good

    def cancelled(self, tenant: str, request_class: str, arrival: float, output_tokens: int = 0) -> None:
        for c in self._cells_for(tenant, request_class, arrival):
            c.cancelled += 1
            c.output_tokens += output_tokens

    def failed(self, tenant: str, request_class: str, arrival: float, output_tokens: int = 0) -> None:
        for c in self._cells_for(tenant, request_class, arrival):
            c.failed += 1
            c.output_tokens += output_tokens

    def retried(self, tenant: str, request_class: str, arrival: float) -> None:
        cell, total = self._cells_for(tenant, request_class, arrival)
        cell.retried += 1
        total.retried += 1

    # -- reading ---------------------------------------------------------------------

    def windows(self) -> list[int]:
        return sorted(self._cells)

    def window_cells(self, window: int) -> dict[Key, Cell]:
        """The cells of one window (read only: what a gateway replica shares with the others)."""
        return self._cells.get(window, {})

    def merge_cell(self, window: int, tenant: str, request_class: str, cell: Cell) -> None:
        """Add `cell` to a window (a ledger built from the replicas' shared figures)."""
        win = self._cells.setdefault(window, {})
        win.setdefault((tenant, request_class), Cell()).add(cell)
        self.totals.setdefault((tenant, request_class), Cell()).add(cell)

    def report(self, *, tenants: Collection[str] | None = None, request_class: str | None = None,
               since: float | None = None, until: float | None = None,
               per_window: bool = False) -> list[dict[str, Any]]:
        """Rows per tenant x class (summed over the selected windows), or per window too.

        A window is selected when it overlaps [since, until). Rows carry the window
        bounds in the ledger's own clock; `goodput_tok_s` divides by the covered time.
        """
        lo = self._index(since) if since is not None else None
        hi = self._index(until - 1e-9) if until is not None else None
        groups: dict[tuple[Any, ...], tuple[Cell, int, int]] = {}
        for w in sorted(self._cells):
            if (lo is not None and w < lo) or (hi is not None and w > hi):
                continue
            for (tenant, cls), cell in self._cells[w].items():
                if tenants is not None and tenant not in tenants:
                    continue
                if request_class is not None and cls != request_class:
                    continue
                key: tuple[Any, ...] = (tenant, cls, w) if per_window else (tenant, cls)
                acc = groups.get(key)
                if acc is None:
                    acc = groups[key] = (Cell(), w, w)
                acc[0].add(cell)
                groups[key] = (acc[0], min(acc[1], w), max(acc[2], w))
        rows = []
        for key, (cell, w0, w1) in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[1][1])):
            start, end = w0 * self.window_s, (w1 + 1) * self.window_s
            rows.append(row(key[0], key[1], cell, start, end))
        return rows


def row(tenant: str, request_class: str, cell: Cell, start: float, end: float) -> dict[str, Any]:
    span = end - start
    out: dict[str, Any] = {"tenant": tenant, "class": request_class, "window_start": start, "window_end": end}
    for k in COUNTERS:
        out[k] = getattr(cell, k)
    out["rejected_by_reason"] = dict(sorted(cell.rejected_by.items()))
    out["goodput_tok_s"] = cell.goodput_tokens / span if span > 0 else 0.0
    out["attainment"] = cell.attainment
    return out


def totals_rows(ledger: GoodputLedger) -> Iterable[tuple[str, str, Cell]]:
    for (tenant, cls), cell in sorted(ledger.totals.items()):
        yield tenant, cls, cell


class LedgeredAdmission(Admission):
    """An admission policy (`fleetcore.policies.Admission`) that books every request it sees in
    a goodput ledger — what the gateway's goodput report, metrics and placement planner read.
    SLOMax and FCFS are both, so either serves the gateway and the reports read alike."""

    ledger: GoodputLedger

    def judge(self, profile: RequestProfile, outcome: RequestOutcome) -> bool:
        """Would the ledger book this ended request (its class the admitted one) as met_slo?
        What views the ledger has no key for (the gateway's per-site goodput) ask, so a request
        is judged one way everywhere (SLOMax and FCFS: `slomax.admission.judge`). A policy that
        cannot tell books nothing as met."""
        return False
