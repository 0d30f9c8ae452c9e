"""Where SLOMax's rejections come from, per site and class, with and without the planner: the
figures behind deploy/scenarios/README.md's "The planner under SLOMax".

    .venv/bin/python bench/planner_admission.py /tmp/scenarios/flash-crowd.jsonl \\
        [--fleet deploy/scenarios/demand-shift.yaml] [--placement fleetmind,fleetmind+planner]

For each placement (SLOMax admission, TokenPilot routing, the same objects `tokenfleet
simulate` builds): requests completed per site, rejections per class and code (the code is
the reason's leading word: `slo_unattainable`, `queue_timeout`, ...), the prompt sizes of the
long-context requests rejected and completed, and SLOMax's valve at the end of the run (its
measured prefill speed per instance and the controller's `engine_wait_s` target).
"""

from __future__ import annotations

import argparse
import random
from collections import Counter
from pathlib import Path

from fleetcore.fleet_config import load_fleet_file
from fleetcore.slo import LONG_CONTEXT
from fleetsim.cli import make_placement, make_policy, placement_controllers
from fleetsim.simulator import FleetSimulator, prepare
from slomax import SLOMax, from_fleet, make_admission
from workloads import load_trace

REPO = Path(__file__).resolve().parent.parent


def quantiles(values: list[int]) -> str:
    v = sorted(values)
    if not v:
        return "-"
    return " / ".join(f"{v[min(len(v) - 1, int(len(v) * q))]:,}" for q in (0.1, 0.5, 0.9))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--fleet", default=str(REPO / "deploy" / "scenarios" / "demand-shift.yaml"))
    ap.add_argument("--placement", default="fleetmind,fleetmind+planner")
    args = ap.parse_args()
    fleet = load_fleet_file(Path(args.fleet))
    inputs = prepare(load_trace(args.trace).requests, fleet)
    for placement in args.placement.split(","):
        random.seed(0)  # as `tokenfleet simulate` (its default --seed)
        router = make_policy("tokenpilot", 0, fleet)
        admission = make_admission("slomax", from_fleet(fleet))
        sim = FleetSimulator(fleet, router, site_chooser=make_placement(placement, fleet, router),
                             admission=admission, controllers=placement_controllers(placement, fleet))
        records = sim.run(inputs).records
        done = Counter(r.site for r in records if r.status == "completed")
        rejected = Counter((r.klass, (r.reason or "").split(":")[0]) for r in records if r.status == "rejected")
        print(f"== {placement}: completed per site {dict(sorted(done.items()))}")
        for (cls, code), n in sorted(rejected.items()):
            print(f"   rejected {cls:<13} {code:<18} {n:>6,}")
        for status in ("rejected", "completed"):
            sizes = [r.prompt_tokens for r in records if r.klass == LONG_CONTEXT and r.status == status]
            print(f"   long-context {status:<9} {len(sizes):>6,}  prompt tokens p10/p50/p90 {quantiles(sizes)}")
        if isinstance(admission, SLOMax):
            for model, pool in admission._pools.items():
                speed = pool.valve.pool_speed.value or 0.0
                print(f"   valve {model}: {speed:,.0f} prompt tokens/s per instance, engine_wait_s target "
                      f"{pool.controller.engine_wait.value:.3f} s at the end")


if __name__ == "__main__":
    main()
