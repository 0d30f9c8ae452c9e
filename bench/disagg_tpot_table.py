"""Markdown tables of TPOT by role (issue 17) from `bench/disagg_probe.py --tpot-by-role --json F` files.

    .venv/bin/python bench/disagg_tpot_table.py off=agent_off1024.json static=agent_static.json \
        elastic=agent_elastic.json

One table per file set: per mode, per group of requests (all of them, and those at or above the
run's TPOT p95; split or local, and the role their decode steps ran on): requests, TPOT p50 / p95
/ mean, the mean decode step, prefill tokens beside the request per decode step, the share of its
decode steps that carried a prefill chunk, the mean step with and without a chunk, batch and KV
use, the mean TPOT less the mean step (time between its tokens outside its steps: a
preemption's recompute, a wait to be scheduled), the share preempted and the wait from its
first token to its first decode step; then each role's decode-carrying steps. `tpot_report` in `bench/disagg_probe.py` says what
each column is.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _f(x: Any) -> str:
    return "-" if x is None else (f"{x:.3f}".rstrip("0").rstrip(".") if isinstance(x, float) and x < 1 else str(x))


def table(runs: list[tuple[str, dict[str, Any]]]) -> str:
    out = ["| mode | requests | group | n | TPOT p50 / p95 / mean ms | step ms | prefill tok per step "
           "| steps with a chunk | step ms with / without chunk | batch | KV | TPOT less step ms | preempted | first token to first decode step ms |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, rep in runs:
        for part, label in (("all", "all"), ("tail", f">= p95 ({rep['tpot_p95_ms']} ms)")):
            for g, s in rep[part].items():
                out.append(f"| {mode} | {label} | {g} | {s['n']} | {s['tpot_p50']} / {s['tpot_p95']} / "
                           f"{s['tpot_mean']} | {s['step_ms']} | {s['pf_per_step']} | {s['chunk_share']:.2f} | "
                           f"{_f(s['chunk_step_ms'])} / {_f(s['plain_step_ms'])} | {s['batch']} | {s['kv']:.2f} | "
                           f"{s['off_step_ms']} | {s['preempted']:.2f} | {s['first_wait_ms']} |")
    out += ["", "| mode | role | decode steps | with a chunk | step ms | prefill tok per step | batch | KV |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for mode, rep in runs:
        for role, s in rep["roles"].items():
            out.append(f"| {mode} | {role} | {s['decode_steps']} | {s['chunk_share']:.2f} | {s['step_ms']} | "
                       f"{s['pf_per_step']} | {s['batch']} | {s['kv']:.2f} |")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    runs = []
    for a in argv:
        mode, _, path = a.partition("=")
        runs.append((mode, json.loads(Path(path).read_text())["row"]["tpot_by_role"]))
    print(table(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
