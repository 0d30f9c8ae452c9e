"""Markdown tables for bench/SLOMAX.md from `tokenfleet simulate --admission fcfs,slomax --json` reports.

    .venv/bin/python bench/slomax_table.py OUT.json [OUT2.json ...]

Per report: one row per (policy, admission) with goodput, raw output throughput, their
ratios to the FCFS row of the same policy, overall and per-class SLO attainment,
interactive TTFT p95, rejected requests and the simulated span; then per tenant
(attainment, interactive-class p95 TTFT is not split by tenant in the report, so the
tenant rows show each tenant's own p95 TTFT).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def table(report: dict[str, Any]) -> str:
    w = report["workload"]
    rows = report["results"]
    base = {r["policy"]: r for r in rows if r.get("admission", "fcfs") == "fcfs"}
    out = [f"`{w['name']}` x{w['rate_scale']:g}: {w['requests']} requests over {w['duration_s']:.0f} s, "
           f"fleet `{report['fleet']['file'].split('/')[-1]}`", "",
           "| policy | admission | goodput tok/s | vs FCFS | output tok/s | vs FCFS | SLO | interactive SLO "
           "| long_context SLO | batch SLO | interactive TTFT p95 ms | rejected | span s |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        b = base.get(r["policy"])
        cls = r["by_class"]

        def att(c: str) -> str:
            return _pct(cls[c]["slo_attainment"]) if c in cls else "-"

        good_x = f"{r['goodput_tok_s'] / b['goodput_tok_s']:.2f}x" if b and b["goodput_tok_s"] else "-"
        tput_x = f"{r['throughput_tok_s'] / b['throughput_tok_s']:.2f}x" if b and b["throughput_tok_s"] else "-"
        p95 = cls.get("interactive", {}).get("ttft_ms", {}).get("p95")
        out.append(f"| {r['policy']} | {r.get('admission', 'fcfs')} | {r['goodput_tok_s']:,.0f} | {good_x} "
                   f"| {r['throughput_tok_s']:,.0f} | {tput_x} | {_pct(r['slo_attainment'])} | {att('interactive')} "
                   f"| {att('long_context')} | {att('batch')} | {_ms(p95)} | {r['rejected']} "
                   f"| {r.get('sim', {}).get('span_s', 0):.0f} |")
    out += ["", "| policy | admission | tenant | requests | rejected | SLO | TTFT p95 ms | goodput tok/s |",
            "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        for t, g in r["by_tenant"].items():
            out.append(f"| {r['policy']} | {r.get('admission', 'fcfs')} | {t} | {g['requests']} | {g['rejected']} "
                       f"| {_pct(g['slo_attainment'])} | {_ms(g['ttft_ms']['p95'])} | {g['goodput_tok_s']:,.0f} |")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    for path in (argv if argv is not None else sys.argv[1:]):
        with open(path, encoding="utf-8") as f:
            print(table(json.load(f)))
            print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
