"""Where an elastic P/D run's requests went, by the role each instance *started* with (issue 17).

Runs one `tokenfleet simulate` configuration (TokenPilot, `--disagg` mode, fleet file's roles)
and prints, every `--every` seconds, per group of instances (those that started as prefill,
those that started as decode; their current roles): running and waiting requests, mean KV;
then, per `--window` seconds of decision time, the P/D decisions (split / local, prompt
tokens, cached tokens on the instance that prefills, prefill instances in the pool); then per
group and per arrival phase (before / after `--early-s`): requests, prefix-cache hit rate,
SLO attainment, mean TPOT and TTFT. The question it answers: do the instances that joined the
decode pool get the agents' cache hits, and which requests miss their SLO.

    .venv/bin/python bench/disagg_groups.py --trace /tmp/pd/agent.jsonl --rate-scale 14 --disagg elastic
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without installing

from bench.disagg_probe import load_inputs  # noqa: E402
from fleetcore.fleet_config import load_fleet_file  # noqa: E402
from fleetmind.pd_roles import PDRolesConfig  # noqa: E402
from fleetsim.cli import make_placement, make_policy  # noqa: E402
from fleetsim.disagg import PDRuntime, make_disagg_policy, pd_controllers  # noqa: E402
from fleetsim.metrics import slo_met, summarize_all  # noqa: E402
from fleetsim.simulator import FleetSimulator  # noqa: E402
from slomax import from_fleet as slomax_config  # noqa: E402
from slomax import make_admission  # noqa: E402
from tokenpilot.disagg import DisaggConfig  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True)
    p.add_argument("--fleet", default="deploy/sim/pd32.yaml")
    p.add_argument("--disagg", default="elastic")
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--rate-scale", type=float, default=1.0)
    p.add_argument("--every", type=float, default=5.0)
    p.add_argument("--window", type=float, default=2.5)
    p.add_argument("--early-s", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split-overhead-s", type=float, default=DisaggConfig().split_overhead_s,
                   help="DisaggConfig.split_overhead_s of the P/D decision")
    p.add_argument("--flip-all-at", type=float, default=None,
                   help="at this second, turn every prefill instance to decode (with --disagg static: "
                        "how much the time spent at the fleet file's split costs)")
    a = p.parse_args()
    fleet = load_fleet_file(Path(a.fleet))
    _, inputs = load_inputs(a.trace, fleet, a.max_requests, a.rate_scale)
    random.seed(a.seed)
    router = make_policy("tokenpilot", a.seed, fleet)
    policy = make_disagg_policy(a.disagg, router, DisaggConfig(slos=dict(fleet.admission.slos()),
                                                                         split_overhead_s=a.split_overhead_s))
    decisions: dict[float, dict[str, int]] = {}
    if policy is not None:
        decide = policy.decide

        def traced(profile: Any, pool: Any, transfers: Any, now: float) -> Any:
            d = decide(profile, pool, transfers, now)
            st = decisions.setdefault(int(now // a.window) * a.window,
                                      {"split": 0, "local": 0, "prompt": 0, "cached": 0, "prefill_pool": 0})
            st["split" if d.split else "local"] += 1
            st["prompt"] += profile.prompt_tokens
            st["cached"] += d.cached_tokens
            st["prefill_pool"] = sum(c.role == "prefill" for c in pool)
            return d

        policy.decide = traced  # type: ignore[method-assign]
    start: dict[str, str] = {}

    def sample(sim: FleetSimulator, now: float) -> None:
        groups: dict[str, dict[str, Any]] = {}
        for i in sim.instances():
            g = groups.setdefault("started " + start[i.iid], {"n": 0, "run": 0, "wait": 0, "kv": 0.0, "roles": {}})
            g["n"] += 1
            g["run"] += i.engine.num_running
            g["wait"] += i.engine.num_waiting
            g["kv"] += i.engine.kv.usage()
            g["roles"][i.role] = g["roles"].get(i.role, 0) + 1
        for g in groups.values():
            g["kv"] = round(g["kv"] / g["n"], 2)
        print(json.dumps({"t": round(now, 1), **groups}))

    flipped: list[float] = []

    def flip_all(sim: FleetSimulator, now: float) -> None:
        if flipped or not isinstance(sim.pd, PDRuntime):
            return
        flipped.append(now)
        for i in sim.instances():
            if i.role == "prefill":
                sim.pd.set_role(i.iid, "decode", now)

    extra = [(a.flip_all_at, flip_all)] if a.flip_all_at is not None else []
    sim = FleetSimulator(fleet, router, site_chooser=make_placement("fleetmind", fleet, router),
                         admission=make_admission("fcfs", slomax_config(fleet)), progress=None,
                         controllers=[*pd_controllers(a.disagg, fleet, PDRolesConfig()), (a.every, sample), *extra],
                         pd=(lambda s: PDRuntime(s, policy)) if policy is not None else None)
    start.update({i.iid: i.role for i in sim.instances()})  # before any flip
    res = sim.run(inputs)
    slos = fleet.admission.slos()
    summary = summarize_all(res.records, slos)
    print(json.dumps({k: summary[k] for k in ("goodput_tok_s", "slo_attainment", "ttft_ms", "tpot_ms", "span_s")}))
    for w, st in sorted(decisions.items()):
        print("decisions", w, json.dumps(st))
    agg: dict[tuple[str, str], dict[str, float]] = {}
    for r in res.records:
        g = "started " + start.get(r.instance or "", "?")
        for phase in ("all", f"arrived <{a.early_s:g}s" if r.arrival_s < a.early_s else f"arrived >={a.early_s:g}s"):
            x = agg.setdefault((g, phase), {"n": 0, "prompt": 0, "cached": 0, "met": 0, "tpot": 0.0, "ttft": 0.0})
            x["n"] += 1
            x["prompt"] += r.prompt_tokens
            x["cached"] += r.cached_tokens
            x["met"] += slo_met(r, slos)
            x["tpot"] += r.tpot_s or 0.0
            x["ttft"] += r.ttft_s or 0.0
    for (g, phase), x in sorted(agg.items()):
        print(f"{g:16s} {phase:14s} n {x['n']:5.0f}  hit {x['cached'] / max(1, x['prompt']):.3f}  "
              f"SLO {x['met'] / x['n']:.3f}  TPOT {x['tpot'] / x['n'] * 1e3:.0f} ms  TTFT {x['ttft'] / x['n']:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
