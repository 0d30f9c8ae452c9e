"""FleetMind's planner, live: the demand-shift scenario through the real gateway and real
sim-worker processes, planner off vs on, next to the simulator's figures for the same run.

    .venv/bin/python bench/planner_live.py [--time-scale 0.1] [--window 2400] [--json OUT.json]

Fleet: deploy/scenarios/demand-shift.yaml (2 sites x 6 Llama-3.1-70B on H200 TP2, no
spill), its workers run `--time-scale` wall seconds per physical second, and everything
timed in the planner (cycle, window, lead, cooldown, watch, block, replica start-up) and
the class SLOs the gateway judges goodput by are scaled by the same factor, so the run is
the simulated scenario played `1/time-scale` times faster. Workload: demand-shift.jsonl
from deploy/scenarios/make_workloads.py (made if missing). Each run: `tokenfleet up` on
a free port, `tokenfleet bench live` replaying the trace (times reported in physical
seconds), the planner's log from /admin/v1/planner, then the fleet is stopped.
Admission is FCFS, as in the simulated table (deploy/scenarios/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from fleetcore.fleet_config import PlannerSettings
from fleetmind.planner import PlannerConfig

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SCENARIO = REPO / "deploy" / "scenarios" / "demand-shift.yaml"
KEY, ADMIN = "sk-bench", "sk-bench-admin"
# The planner's fields that are durations: scaled with the workers' time (the simulator reads
# the same `planner:` block unscaled, `fleetsim.cli.placement_controllers`).
TIMED = ("cycle_s", "window_s", "lead_s", "cooldown_s", "watch_s", "block_s", "drain_timeout_s", "ready_timeout_s")


def fleet_file(time_scale: float, planner: bool, out: Path) -> Path:
    fleet = yaml.safe_load(SCENARIO.read_text())
    for d in fleet["deployments"]:
        opts = d.setdefault("options", {})
        opts["startup_s"] = float(opts.get("startup_s", 0.0)) * time_scale
        opts["time_scale"] = time_scale
    fleet["tenants"] = [{"name": "bench", "api_keys": [KEY]}]
    fleet["admin_api_keys"] = [ADMIN]
    # Goodput as the gateway judges it (the planner's signal) in wall time: SLOs scaled too.
    fleet["admission"] = {"policy": "fcfs", "classes": {
        "interactive": {"ttft_s": 1.0 * time_scale, "tpot_s": 0.05 * time_scale},
        "long_context": {"ttft_s": 8.0 * time_scale, "tpot_s": 0.08 * time_scale},
        "batch": {"deadline_s": 600.0 * time_scale}}}
    # The scenario's own planner block with the defaults it leaves out, times scaled.
    settings = {**PlannerSettings().model_dump(), **asdict(PlannerConfig()), **fleet.get("planner", {})}
    settings = {k: v for k, v in settings.items() if k in PlannerSettings.model_fields and v is not None}
    fleet["planner"] = {**settings, "enabled": planner,
                        **{k: settings[k] * time_scale for k in TIMED if k in settings}}
    out.write_text(yaml.safe_dump(fleet, sort_keys=False))
    return out


def admin_get(url: str, path: str) -> Any:
    req = urllib.request.Request(url.removesuffix("/v1") + path, headers={"Authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


def rows_of(path: Path) -> list[dict[str, Any]]:
    doc = json.loads(path.read_text())
    return doc["results"] if isinstance(doc, dict) else doc


def requests_before(trace: Path, window_s: float) -> int:
    """How many of the trace's requests arrive in its first `window_s` seconds (it is sorted)."""
    with trace.open() as f:
        rows = (json.loads(line) for line in f if line.strip())
        return sum(1 for r in rows if "timestamp" in r and r["timestamp"] < 1000 * window_s)  # first line: header


def run_one(trace: Path, time_scale: float, planner: bool, n: int, tmp: Path) -> dict[str, Any]:
    fleet = fleet_file(time_scale, planner, tmp / f"fleet-{planner}.yaml")
    up = subprocess.Popen([str(BIN / "tokenfleet"), "up", "--fleet", str(fleet), "--port", "0"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = None
        assert up.stdout is not None
        for line in up.stdout:
            print(f"  {line.rstrip()}", flush=True)
            m = re.search(r"gateway\s+(http://\S+/v1)", line)
            if m:
                url = m.group(1)
            if "stop with Ctrl-C" in line or up.poll() is not None:
                break
        if url is None:
            raise RuntimeError("tokenfleet up did not start")
        # Keep reading what the gateway logs: a pipe nobody reads fills up (64 KiB) and the
        # gateway then blocks on its next log line, stopping the whole run.
        tail: deque[str] = deque(maxlen=200)
        threading.Thread(target=tail.extend, args=(up.stdout,), daemon=True).start()
        out = tmp / f"live-{planner}.json"
        label = "planner" if planner else "static"
        subprocess.run([str(BIN / "tokenfleet"), "bench", "live", "--trace", str(trace), "--target", url,
                        "--key", KEY, "--time-scale", str(time_scale), "--max-requests", str(n),
                        "--label", label, "--json", str(out), "--no-progress"], check=True)
        row = rows_of(out)[0]
        print(f"  {label} row: {json.dumps(row)}", flush=True)  # kept in the log should a later run fail
        row["planner_log"] = admin_get(url, "/admin/v1/planner") if planner else None
        return row
    finally:
        up.terminate()
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()


def simulated(trace: Path, n: int, tmp: Path) -> list[dict[str, Any]]:
    out = tmp / "sim.json"
    subprocess.run([str(BIN / "tokenfleet"), "simulate", "--trace", str(trace), "--fleet", str(SCENARIO),
                    "--policy", "tokenpilot", "--placement", "fleetmind,fleetmind+planner", "--max-requests", str(n),
                    "--json", str(out)], check=True, stdout=subprocess.DEVNULL)
    return rows_of(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--time-scale", type=float, default=0.1)
    ap.add_argument("--window", type=float, default=2400, help="physical seconds of the trace to replay")
    ap.add_argument("--json")
    ap.add_argument("--static-row", metavar="FILE",
                    help="reuse the live static row from an earlier run's live-False.json (the planner plays "
                         "no part in it; a live run takes ~15 minutes on a 2-core machine)")
    args = ap.parse_args()
    trace = Path(tempfile.gettempdir()) / "scenarios" / "demand-shift.jsonl"
    if not trace.exists():
        subprocess.run([sys.executable, str(REPO / "deploy" / "scenarios" / "make_workloads.py"), str(trace.parent)],
                       check=True)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        n = requests_before(trace, args.window)
        sim = simulated(trace, n, tmp)
        static = rows_of(Path(args.static_row))[0] if args.static_row else run_one(trace, args.time_scale, False, n, tmp)
        live = [static, run_one(trace, args.time_scale, True, n, tmp)]
    print(f"\ndemand-shift, first {args.window:g} s ({n} requests), live at time scale {args.time_scale:g} "
          "(physical units)")
    print(f"{'run':<22} {'done':>6} {'TTFT p50':>10} {'TTFT p95':>10} {'goodput':>9} {'SLO':>7}  moves")
    for name, row in [("sim static", sim[0]), ("sim planner", sim[1]), ("live static", live[0]),
                      ("live planner", live[1])]:
        log = row.get("planner_log")
        entries = log["entries"] if isinstance(log, dict) else (log or [])
        moves = [f"{e['kind']} {e['move']}" for e in entries if e["kind"] in ("apply", "rollback")]
        print(f"{name:<22} {row['completed']:>6} {row['ttft_ms']['p50']:>8.0f}ms {row['ttft_ms']['p95']:>8.0f}ms "
              f"{row['goodput_tok_s']:>9.0f} {100 * row['slo_attainment']:>6.1f}%  {'; '.join(moves)}")
    for name, pair in (("sim", sim), ("live", live)):
        print(f"{name}: planner/static goodput {pair[1]['goodput_tok_s'] / max(pair[0]['goodput_tok_s'], 1e-9):.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"sim": sim, "live": live}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
