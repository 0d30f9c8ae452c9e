"""The benchmark report: the `--json` document and the stdout table (figures: `fleetsim.plots`).

JSON shape (a contract `simulate` and `bench live` share)::

    {"workload": {...Workload.describe(), "rate_scale", ...},
     "fleet": {"file", "sites", "instances", "deployments": [...], "capacity": {...}},
     "results": [{"policy", "requests", "completed", "rejected", "cancelled",
                  "ttft_ms": {"p50","p90","p95","p99","mean"}, "tpot_ms": {"p50","p95"},
                  "e2e_ms": {...}, "queue_ms": {...}, "throughput_tok_s", "goodput_tok_s",
                  "slo_attainment", "cache_hit_rate", "wall_s",
                  "by_class": {CLASS: {same fields}}, "by_tenant": {TENANT: {same fields}},
                  "sim": {"steps", "preemptions", "span_s"}}]}

Times in ms, rates in tokens/s, fractions in [0, 1]; a statistic of an empty set is null.
Metric definitions: `fleetsim.metrics`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

RESULT_KEYS = ("policy", "requests", "completed", "rejected", "cancelled", "ttft_ms", "tpot_ms", "e2e_ms",
               "queue_ms", "throughput_tok_s", "goodput_tok_s", "slo_attainment", "cache_hit_rate", "wall_s",
               "by_class", "by_tenant")
GROUP_KEYS = ("requests", "completed", "rejected", "cancelled", "ttft_ms", "tpot_ms", "e2e_ms", "queue_ms",
              "throughput_tok_s", "goodput_tok_s", "slo_attainment", "cache_hit_rate")


def result_row(policy: str, summary: Mapping[str, Any], wall_s: float,
               sim: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One entry of `results` from `metrics.summarize_all` output, in the documented key order."""
    row: dict[str, Any] = {"policy": policy}
    for k in GROUP_KEYS:
        row[k] = summary[k]
    row["wall_s"] = round(wall_s, 3)
    row["by_class"] = {c: {k: v[k] for k in GROUP_KEYS} for c, v in summary["by_class"].items()}
    row["by_tenant"] = {t: {k: v[k] for k in GROUP_KEYS} for t, v in summary["by_tenant"].items()}
    if sim:
        row["sim"] = dict(sim)
    return row


def row_label(r: Mapping[str, Any]) -> str:
    """The row's name in tables: the policy, plus the placement, admission and P/D mode when
    they are not the defaults."""
    placement = r.get("placement")
    label = r["policy"] if placement in (None, "fleetmind") else f"{r['policy']}/{placement}"
    admission = r.get("admission")
    label = label if admission in (None, "fcfs") else f"{label}+{admission}"
    disagg = r.get("disagg")
    return label if disagg in (None, "off") else f"{label} pd={disagg}"


def build_report(workload: Mapping[str, Any], fleet: Mapping[str, Any],
                 results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return {"workload": dict(workload), "fleet": dict(fleet), "results": [dict(r) for r in results]}


def write_json(report: Mapping[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2, default=_jsonable) + "\n", encoding="utf-8")


def _jsonable(o: object) -> object:
    if isinstance(o, np.generic):
        return o.item()
    return str(o)


# --- table ------------------------------------------------------------------------


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _ratio(v: float | None, base: float | None) -> str:
    if v is None or base is None or base == 0:
        return "-"
    return f"{v / base:.2f}x"


def format_table(results: Sequence[Mapping[str, Any]]) -> str:
    """Fixed-width table, one row per policy, ratios against the first policy.

    `good/1st` is goodput over the first policy's; `p95/1st` is TTFT p95 over the
    first policy's (lower is better). Followed by a per-class table: for each class, `CLASS n`
    (its requests), `SLO%`, `good/s` (goodput tok/s) and `ttft95` (ms).
    """
    if not results:
        return "(no results)"
    cols = [("policy", 30, "<"), ("done", 6, ">"), ("rej", 5, ">"), ("canc", 5, ">"),
            ("ttft50", 8, ">"), ("ttft95", 8, ">"), ("ttft99", 8, ">"), ("tpot50", 7, ">"), ("tpot95", 7, ">"),
            ("tok/s", 8, ">"), ("good/s", 8, ">"), ("SLO%", 6, ">"), ("hit%", 6, ">"), ("wall", 6, ">"),
            ("good/1st", 8, ">"), ("p95/1st", 8, ">")]
    base = results[0]
    lines = ["  ".join(f"{name:{al}{w}}" for name, w, al in cols),
             "  ".join("-" * w for _, w, _ in cols)]
    for r in results:
        t, p = r["ttft_ms"], r["tpot_ms"]
        cells = [row_label(r)[:30], str(r["completed"]), str(r["rejected"]), str(r.get("cancelled", 0)),
                 _num(t["p50"], ".0f"), _num(t["p95"], ".0f"), _num(t["p99"], ".0f"),
                 _num(p["p50"], ".1f"), _num(p["p95"], ".1f"),
                 _num(r["throughput_tok_s"], ".0f"), _num(r["goodput_tok_s"], ".0f"),
                 _num(None if r["slo_attainment"] is None else 100 * r["slo_attainment"], ".1f"),
                 _num(None if r["cache_hit_rate"] is None else 100 * r["cache_hit_rate"], ".1f"),
                 _num(r.get("wall_s"), ".1f"),
                 _ratio(r["goodput_tok_s"], base["goodput_tok_s"]),
                 _ratio(t["p95"], base["ttft_ms"]["p95"])]
        lines.append("  ".join(f"{c:{al}{w}}" for c, (_, w, al) in zip(cells, cols)))
    classes = sorted({c for r in results for c in r.get("by_class", {})})
    if classes:
        lines.append("")
        # Each class's first column counts its requests: the header says so (`CLASS n`).
        head = f"{'per class':<30}" + "".join(f"  {(c[:12] + ' n'):>14} {'SLO%':>5}  good/s  ttft95" for c in classes)
        lines.append(head)
        for r in results:
            cells = []
            for c in classes:
                g = r.get("by_class", {}).get(c)
                if g is None:
                    cells.append(f"  {'-':>14} {'-':>5}  {'-':>6}  {'-':>6}")
                    continue
                slo = None if g["slo_attainment"] is None else 100 * g["slo_attainment"]
                cells.append(f"  {g['requests']:>14} {_num(slo, '.1f'):>5}  {_num(g['goodput_tok_s'], '.0f'):>6}"
                             f"  {_num(g['ttft_ms']['p95'], '.0f'):>6}")
            lines.append(f"{row_label(r)[:30]:<30}" + "".join(cells))
    return "\n".join(lines)
