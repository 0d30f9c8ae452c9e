"""Print bench/DISAGG.md's tables from `tokenfleet simulate --disagg ... --json` reports.

    python bench/disagg_table.py REPORT.json[,OFF_AT.json] [...]

Per report: one row per `--disagg` mode (goodput, SLO attainment, TTFT/TPOT p95, split share,
KV transfer p50/p95, per-role utilisation), then the issue's targets as ratios within that
report: elastic vs colocated (`off`) goodput >= 1.3x, TTFT p95 <= 1x, TPOT p95 <= 0.7x, and
elastic vs the best of static / dynamo_conditional / llm_d_decider goodput >= 1.1x.
`REPORT.json,OFF_AT.json`: OFF_AT.json is a `--disagg off` report of the same trace and load on
the fleet at the P/D modes' token budget (`max_num_batched_tokens` set to the file's
`pd_max_num_batched_tokens`); its row is added as `off at N` (N: that budget, from the fleet
file the report names) and the same three elastic targets are checked against it too (the fair
baseline for what disaggregation adds beyond the budget; bench/DISAGG.md).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def _f(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _budget(report: Mapping[str, Any]) -> str:
    """`off at N`'s N: the token budget of the fleet file the report names ('budget' if unreadable)."""
    try:
        from fleetcore.fleet_config import load_fleet_file
        fleet = load_fleet_file(Path(report["fleet"]["file"]))
        return f"{fleet.models[0].engine.max_num_batched_tokens:,}"
    except Exception:  # (the table is still worth printing)
        return "budget"


def table(report: Mapping[str, Any], off_at: Mapping[str, Any] | None = None) -> list[str]:
    rows = {r.get("disagg", "off"): r for r in report["results"]}
    base = None
    if off_at is not None:
        base = next(r for r in off_at["results"] if r.get("disagg", "off") == "off")
        rows = {**{k: v for k, v in rows.items() if k == "off"}, f"off at {_budget(off_at)}": base,
                **{k: v for k, v in rows.items() if k != "off"}}
    w = report["workload"]
    out = [f"{w['name']} x{w['rate_scale']:g} ({w['requests']} requests)", "",
           "| disagg | goodput tok/s | SLO % | TTFT p95 ms | TPOT p95 ms | split | KV xfer p50/p95 ms | util P/D |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, r in rows.items():
        x = r.get("kv_transfer_ms") or {}
        u = r.get("role_utilisation") or {}
        out.append(f"| {mode} | {r['goodput_tok_s']:.0f} | {100 * (r['slo_attainment'] or 0):.1f} | "
                   f"{_f(r['ttft_ms']['p95'], '.0f')} | {_f(r['tpot_ms']['p95'], '.1f')} | "
                   f"{_f(r.get('split_share'), '.2f')} | {_f(x.get('p50'), '.0f')}/{_f(x.get('p95'), '.0f')} | "
                   f"{_f(u.get('prefill'), '.2f')}/{_f(u.get('decode'), '.2f')} |")
    e, off = rows.get("elastic"), rows.get("off")
    if e is not None and off is not None:
        out += ["", "| target | measured | met |", "|---|---:|:---:|"]

        def ratio(a: float | None, b: float | None) -> float | None:
            return a / b if a is not None and b else None

        checks = [("goodput elastic / colocated >= 1.3x", ratio(e["goodput_tok_s"], off["goodput_tok_s"]), 1.3, True),
                  ("TTFT p95 elastic / colocated <= 1x", ratio(e["ttft_ms"]["p95"], off["ttft_ms"]["p95"]), 1.0, False),
                  ("TPOT p95 elastic / colocated <= 0.7x", ratio(e["tpot_ms"]["p95"], off["tpot_ms"]["p95"]), 0.7, False)]
        others = [rows[m] for m in ("static", "dynamo_conditional", "llm_d_decider") if m in rows]
        if others:
            best = max(others, key=lambda r: r["goodput_tok_s"])
            checks.append((f"goodput elastic / best other ({best['disagg']}) >= 1.1x",
                           ratio(e["goodput_tok_s"], best["goodput_tok_s"]), 1.1, True))
        if base is not None:
            at = next(k for k, v in rows.items() if v is base)
            checks += [(f"goodput elastic / {at} >= 1.3x", ratio(e["goodput_tok_s"], base["goodput_tok_s"]), 1.3, True),
                       (f"TTFT p95 elastic / {at} <= 1x", ratio(e["ttft_ms"]["p95"], base["ttft_ms"]["p95"]), 1.0, False),
                       (f"TPOT p95 elastic / {at} <= 0.7x", ratio(e["tpot_ms"]["p95"], base["tpot_ms"]["p95"]), 0.7,
                        False)]
        for name, v, bound, higher in checks:
            met = v is not None and (v >= bound if higher else v <= bound)
            out.append(f"| {name} | {_f(v, '.2f')}x | {'yes' if met else 'no'} |")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", help="REPORT.json, or REPORT.json,OFF_AT.json")
    a = p.parse_args(argv)
    for arg in a.reports:
        paths = [Path(x) for x in arg.split(",")]
        reports = [json.loads(x.read_text(encoding="utf-8")) for x in paths]
        print("\n".join(table(reports[0], reports[1] if len(reports) > 1 else None)))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
