"""Elastic P/D against colocated at the neighbouring loads of the three workloads (issue 17).

Runs `bench/disagg_probe.py` once per (workload, rate-scale, column), two at a time, and prints
a markdown table of goodput (tok/s) per column with each column's ratio to `off` of the same
run. Columns: `off` and `elastic` with this checkout's code, and, with `--before DIR`, `elastic`
with the code of another checkout (`git worktree add DIR COMMIT`; its modules first on
`PYTHONPATH`, this checkout's probe script), so that "before" and "now" come from one run.
The simulator runs in virtual time: figures do not depend on machine load.

    .venv/bin/python bench/disagg_loads.py --agent /tmp/pd/agent.jsonl --longdoc /tmp/pd/longdoc.jsonl \
        --before /tmp/pd/main
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MOONCAKE = "traces/conversation_trace.jsonl.gz"
# (workload, rate-scales): the table of bench/DISAGG.md "Agent loops x14" and "Elastic from colocated".
LOADS: tuple[tuple[str, tuple[float, ...]], ...] = (
    ("agent", (12, 13, 14, 15, 16)),
    ("mooncake", (5, 5.5, 6)),
    ("longdoc", (6.5, 7, 7.5)),
)


def probe(trace: str, scale: float, disagg: str, extra: list[str], code: Path | None,
          max_requests: int | None) -> dict:  # (extra: the probe's flags, e.g. --fleet)
    """One probe run's summary row (the line with `goodput_tok_s`)."""
    cmd = [sys.executable, str(ROOT / "bench/disagg_probe.py"), "--trace", trace, "--disagg", disagg,
           "--rate-scale", f"{scale:g}", "--every", "600", *extra]
    if max_requests is not None:
        cmd += ["--max-requests", str(max_requests)]
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = str(code)
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800, check=True).stdout
    row = None
    flips = []
    for line in out.splitlines():
        if line.startswith("{") and "goodput_tok_s" in line:
            row = json.loads(line)
        elif line.startswith("flip "):
            flips.append(json.loads(line[5:]))
    if row is not None:
        return {**row, "flips": flips}
    raise RuntimeError(f"no summary row from {' '.join(cmd)}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agent", required=True, help="bench/make_agent_trace.py's output")
    p.add_argument("--longdoc", required=True, help="bench/make_longdoc_trace.py's output")
    p.add_argument("--before", type=Path, default=None, help="a checkout whose elastic is the 'before' column")
    p.add_argument("--only", default=None, help="comma-separated workloads (agent, mooncake, longdoc)")
    p.add_argument("--no-off", action="store_true", help="skip the off column (no ratios)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--json", default=None, help="write every row here")
    p.add_argument("--start-from-file", action="store_true",
                   help="the 'elastic now' runs start from the fleet file's roles (the probe's flag)")
    p.add_argument("--now-flags", default="",
                   help="more probe flags for the 'elastic now' runs, e.g. '--grow-kv-rate pair' (one string)")
    p.add_argument("--fleet", default=None, help="the fleet file of every run (the probe's default: deploy/sim/pd32.yaml)")
    p.add_argument("--off-at", default=None, metavar="FLEET",
                   help="one more column: `off` on this fleet file (e.g. pd32.yaml with max_num_batched_tokens set "
                        "to its pd_max_num_batched_tokens: colocated at the P/D fleet's token budget)")
    a = p.parse_args()
    fleet = ["--fleet", a.fleet] if a.fleet else []
    extra = (["--start-from-file"] if a.start_from_file else []) + fleet + a.now_flags.split()
    traces = {"agent": (a.agent, None), "mooncake": (MOONCAKE, 4000), "longdoc": (a.longdoc, None)}
    only = set(a.only.split(",")) if a.only else {w for w, _ in LOADS}
    cols: list[tuple[str, str, list[str], Path | None]] = []
    if not a.no_off:
        cols.append(("off", "off", fleet, None))
    if a.off_at is not None:
        cols.append(("off at budget", "off", ["--fleet", a.off_at], None))
    if a.before is not None:
        cols.append(("elastic before", "elastic", fleet, a.before.resolve()))
    cols.append(("elastic now", "elastic", extra, None))
    jobs = [(w, s, c) for w, scales in LOADS if w in only for s in scales for c in cols]
    with ThreadPoolExecutor(a.jobs) as pool:
        rows = list(pool.map(lambda j: probe(traces[j[0]][0], j[1], j[2][1], j[2][2], j[2][3], traces[j[0]][1]),
                             jobs))
    got = {(w, s, c[0]): r for (w, s, c), r in zip(jobs, rows)}
    names = [c[0] for c in cols]
    print("| workload, load | " + " | ".join(names) + (" | now / off |" if "off" in names else " |"))
    print("|---|" + "---:|" * (len(names) + ("off" in names)))
    for w, scales in LOADS:
        for s in scales:
            if w not in only:
                continue
            g = [got[(w, s, n)]["goodput_tok_s"] for n in names]
            cells = [f"{x:.0f}" for x in g]
            if "off" in names:
                off = g[names.index("off")]
                cells = [cells[0]] + [f"{x:.0f} ({x / off:.2f}x)" for x in g[1:]]
                cells.append(f"{g[-1] / off:.2f}x")
            print(f"| {w} x{s:g} | " + " | ".join(cells) + " |")
    if "off" in names:  # the targets' other ratios, 'elastic now' against 'off'
        print()
        print("| workload, load | goodput | TTFT p95 | TPOT p95 | split % | flips |")
        print("|---|---:|---:|---:|---:|---:|")
        for w, scales in LOADS:
            for s in scales:
                if w not in only:
                    continue
                off, now = got[(w, s, "off")], got[(w, s, names[-1])]
                r = [now["goodput_tok_s"] / off["goodput_tok_s"], now["ttft_ms"]["p95"] / off["ttft_ms"]["p95"],
                     now["tpot_ms"]["p95"] / off["tpot_ms"]["p95"]]
                flips = sum(1 for f in now.get("flips", []) if f["kind"] == "flip")
                print(f"| {w} x{s:g} | " + " | ".join(f"{x:.2f}x" for x in r)
                      + f" | {100 * now.get('split_share', 0.0):.1f} | {flips} |")
    if a.json:
        Path(a.json).write_text(json.dumps([{"workload": w, "rate_scale": s, "column": n, **r}
                                            for (w, s, n), r in got.items()], default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
