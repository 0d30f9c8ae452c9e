"""Curve off against curve on (bench/DISAGG.md "Small-chunk kernel efficiency"): one table row a mode.

    python bench/kernel_eff_table.py --base off512,off1024 off512=A_off.json,A_on.json ...

Each ROW=OFF.json,ON.json: the same run with the roofline's constant compute efficiency (OFF) and
with the fleet file's `compute_efficiency_curve` (ON); either a `tokenfleet simulate --json`
report (its first result) or a `bench/disagg_probe.py --json` file (its `row`). `--base`: the
colocated rows; each row's goodput and TPOT p95 are also given against the best of them (by
goodput) under the same curve setting, the issue's targets being goodput >= 1.3x and TPOT p95
<= 0.7x against colocated.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def row_of(path: Path) -> Mapping[str, Any]:
    """The result row of a simulate report or a disagg_probe file."""
    doc = json.loads(path.read_text())
    return doc["row"] if "row" in doc else doc["results"][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", nargs="+", help="LABEL=OFF.json,ON.json")
    ap.add_argument("--base", default="", help="comma-separated labels of the colocated rows")
    a = ap.parse_args()
    runs: dict[str, tuple[Mapping[str, Any], Mapping[str, Any]]] = {}
    for spec in a.rows:
        label, paths = spec.split("=", 1)
        off, on = paths.split(",")
        runs[label] = (row_of(Path(off)), row_of(Path(on)))
    bases = [b for b in a.base.split(",") if b]
    best = [max(bases, key=lambda b, i=i: runs[b][i]["goodput_tok_s"]) if bases else None for i in (0, 1)]
    print(f"best colocated: curve off {best[0]}, curve on {best[1]}")
    print("| mode | goodput off | goodput on | on / off | vs best colocated off / on | SLO % off / on | "
          "TTFT p95 s off / on | TPOT p50 ms off / on | TPOT p95 ms off / on | TPOT p95 vs best colocated off / on |"
          " split off / on |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, (off, on) in runs.items():
        g0, g1 = off["goodput_tok_s"], on["goodput_tok_s"]
        vs = [r["goodput_tok_s"] / runs[b][i]["goodput_tok_s"] if b else float("nan")
              for i, (r, b) in enumerate(((off, best[0]), (on, best[1])))]
        tp = [r["tpot_ms"]["p95"] / runs[b][i]["tpot_ms"]["p95"] if b else float("nan")
              for i, (r, b) in enumerate(((off, best[0]), (on, best[1])))]
        split = " / ".join("-" if r.get("split_share") is None else f"{r['split_share']:.2f}" for r in (off, on))
        print(f"| {label} | {g0:.0f} | {g1:.0f} | {g1 / g0:.2f}x | {vs[0]:.2f}x / {vs[1]:.2f}x | "
              f"{off['slo_attainment'] * 100:.1f} / {on['slo_attainment'] * 100:.1f} | "
              f"{off['ttft_ms']['p95'] / 1e3:.1f} / {on['ttft_ms']['p95'] / 1e3:.1f} | "
              f"{off['tpot_ms']['p50']:.1f} / {on['tpot_ms']['p50']:.1f} | "
              f"{off['tpot_ms']['p95']:.1f} / {on['tpot_ms']['p95']:.1f} | {tp[0]:.2f}x / {tp[1]:.2f}x | {split} |")


if __name__ == "__main__":
    main()
