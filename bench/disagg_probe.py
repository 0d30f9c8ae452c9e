"""Where P/D loses (issue 17): sample a `--disagg` run's per-role state over time.

Runs one `tokenfleet simulate` configuration with a sampler on the simulator's controller
tick (virtual time: the samples do not disturb the run) and prints, every `--every` seconds,
per role: instances, queued (engine waiting) requests, running requests, mean KV usage,
requests holding KV for a transfer; and for the split requests: how many are prefilling,
waiting for decode KV room, in transfer; and the busy links. Then the run's summary and,
for `elastic`, the role flips.

    .venv/bin/python bench/disagg_probe.py --trace traces/conversation_trace.jsonl.gz \
        --fleet deploy/sim/pd32.yaml --disagg static --max-requests 2000 --rate-scale 5.5
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from fleetcore.fleet_config import load_fleet_file
from fleetsim.cli import make_placement, make_policy
from fleetsim.disagg import PDRuntime, make_disagg_policy, pd_controllers, pd_row
from fleetsim.metrics import summarize_all
from fleetsim.simulator import FleetSimulator, HashCache, prepare
from slomax import make_admission
from slomax import from_fleet as slomax_config
from workloads import head, load_trace, scale_rate


class Sampler:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def __call__(self, sim: FleetSimulator, now: float) -> None:
        pd = sim.pd
        row: dict[str, Any] = {"t": round(now, 1)}
        for role in ("prefill", "decode", "mixed"):
            insts = [i for i in sim.instances() if i.role == role]
            if not insts:
                continue
            row[role] = {
                "n": len(insts),
                "draining": sum(i.draining for i in insts),
                "wait": sum(i.engine.num_waiting for i in insts),
                "run": sum(i.engine.num_running for i in insts),
                "kv": round(sum(i.engine.kv.usage() for i in insts) / len(insts), 3),
                "held": sum(i.engine.num_held for i in insts),
            }
        if isinstance(pd, PDRuntime):
            stages: dict[str, int] = {}
            for leg in pd.legs.values():
                stages[leg.stage] = stages.get(leg.stage, 0) + 1
            row["legs"] = stages
            row["links_busy"] = sum(q.wait_s(now) > 0 for q in pd.links._queues.values())
        row["active"] = len(sim._active)
        self.rows.append(row)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True)
    p.add_argument("--fleet", default="deploy/sim/pd32.yaml")
    p.add_argument("--disagg", default="static")
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--rate-scale", type=float, default=1.0)
    p.add_argument("--every", type=float, default=15.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the samples and the row here")
    a = p.parse_args()
    fleet = load_fleet_file(Path(a.fleet))
    wl = load_trace(a.trace, "auto")
    if a.max_requests is not None:
        wl = head(wl, a.max_requests)
    if a.rate_scale != 1.0:
        wl = scale_rate(wl, a.rate_scale)
    inputs = prepare(wl.requests, fleet, hash_cache=HashCache())
    random.seed(a.seed)
    router = make_policy("tokenpilot", a.seed, fleet)
    policy = make_disagg_policy(a.disagg, router)
    ctl = pd_controllers(a.disagg, fleet)
    sampler = Sampler()
    sim = FleetSimulator(fleet, router, site_chooser=make_placement("fleetmind", fleet, router),
                         admission=make_admission("fcfs", slomax_config(fleet)), progress=None,
                         controllers=[*ctl, (a.every, sampler)],
                         pd=(lambda s: PDRuntime(s, policy)) if policy is not None else None)
    res = sim.run(inputs)
    summary = summarize_all(res.records, fleet.admission.slos())
    last_end = max((r.end_s for r in res.records if r.end_s is not None), default=res.sim_end_s)
    row = {k: summary[k] for k in ("goodput_tok_s", "slo_attainment", "ttft_ms", "tpot_ms", "span_s")}
    row["preemptions"] = res.preemptions
    row.update(pd_row(sim.pd if isinstance(sim.pd, PDRuntime) else None, ctl, last_end))
    for s in sampler.rows:
        print(json.dumps(s))
    flips = row.pop("role_flips", [])
    print(json.dumps(row, default=str))
    for f in flips:
        print("flip", json.dumps(f))
    if a.json:
        Path(a.json).write_text(json.dumps({"samples": sampler.rows, "row": row, "flips": flips}, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
