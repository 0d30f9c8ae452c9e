"""The live latency bench's workload (bench/latency_live.py, sim engines) through fleetsim in virtual time:
when does SLOMax bring its prefill budget in, and does it hold the trace's burst of long prompts?

    .venv/bin/python bench/burst_budget_sim.py [--quiet-first X] [--full-start] [--early S]

latency_live runs bench/fleet_noisy_live.yaml's workers 4x faster than real time (time_scale 0.25)
at 40 requests/s with the SLOs scaled alike. Here the same fleet runs in physical time: 10
requests/s, the SLOs x4 (interactive TTFT 1 s, TPOT 50 ms) and SLOMax's time knobs x4
(control_interval_s, burst_s, engine_wait_s, usage_tau_s); the first 1,200 lengths of the Azure
conversation trace, clipped as latency_live clips them, fresh prompt blocks per request;
TokenPilot. Times printed are wall-equivalent (physical / 4), as latency_live's.

The simulator polls SLOMax after every release, as the gateway's pump does (SLOMax's controller
runs only in `poll`; before `FleetSimulator._after_release` did, this script patched it to).

Diagnostics (each patches the policy in this process only):
  --quiet-first X   the control intervals ending before 6 s (wall) see their TPOT ratios x X:
                    0.95 turns the first interval's p95 1.04 into 0.99, as warm-up noise did live
  --full-start      a budget the controller brings in starts with full buckets (before the fix)
  --early S         with no budget yet, end a control interval as soon as it has `min_samples`
                    TPOT ratios with p95 over the SLO, once S wall seconds of it have passed
bench/SLOMAX.md, "A budget brought in mid-burst", has the figures.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

import slomax.admission as admission_mod  # noqa: E402
import slomax.queues as queues_mod  # noqa: E402
from fleetcore.fleet_config import parse_fleet  # noqa: E402
from fleetsim.cli import make_placement, make_policy  # noqa: E402
from fleetsim.simulator import FleetSimulator, prepare  # noqa: E402
from slomax import SLOMax  # noqa: E402
from slomax import controller as controller_mod  # noqa: E402
from slomax.config import Knobs, from_fleet  # noqa: E402
from workloads import head, load_trace  # noqa: E402
from workloads.trace import TraceRequest  # noqa: E402

S = 4.0  # physical seconds per wall second of latency_live (time_scale 0.25)
TTFT_SLO, TPOT_SLO = 1.0, 0.05


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1200)
    ap.add_argument("--rate", type=float, default=40.0, help="requests per wall second (default 40)")
    ap.add_argument("--quiet-first", type=float, default=None, metavar="X")
    ap.add_argument("--full-start", action="store_true")
    ap.add_argument("--early", type=float, default=None, metavar="S")
    a = ap.parse_args(argv)

    fleet_d = yaml.safe_load((REPO / "bench" / "fleet_noisy_live.yaml").read_text())
    for d in fleet_d["deployments"]:
        d.get("options", {}).pop("time_scale", None)
    fleet_d["admission"]["classes"] = {"interactive": {"ttft_s": TTFT_SLO, "tpot_s": TPOT_SLO},
                                       "long_context": {"ttft_s": 8.0, "tpot_s": 0.08}, "batch": {"deadline_s": 600}}
    fleet = parse_fleet(fleet_d)
    rate = a.rate / S
    trace = []
    for i, r in enumerate(head(load_trace(REPO / "traces" / "AzureLLMInferenceTrace_conv.csv"), a.requests).requests):
        tokens = min(max(r.input_length, 1), 8000)
        trace.append(TraceRequest(timestamp_ms=1000.0 * i / rate, input_length=tokens,
                                  output_length=max(2, min(r.output_length, 64)),
                                  hash_ids=tuple(range(10**6 + 100 * i, 10**6 + 100 * i + max(1, tokens // 512))),
                                  tenant="chat"))
    knobs = Knobs(control_interval_s=5.0 * S, burst_s=2.0 * S, engine_wait_s=0.25 * S, usage_tau_s=10.0 * S)
    adm = SLOMax(from_fleet(fleet, knobs))

    if a.quiet_first is not None:
        update = controller_mod.Controller.update

        def quiet(self, s, now, _update=update):  # type: ignore[no-untyped-def]
            if now < 6.0 * S:
                s.tpot_ratios = [(r * a.quiet_first, n) for r, n in s.tpot_ratios]
            return _update(self, s, now)
        controller_mod.Controller.update = quiet  # type: ignore[method-assign]
    if a.full_start:
        budget_init = queues_mod.PrefillBudget.__init__

        def full(self, *args, full=True, _init=budget_init, **kw):  # type: ignore[no-untyped-def]
            _init(self, *args, full=True, **kw)
        queues_mod.PrefillBudget.__init__ = full  # type: ignore[method-assign]
    if a.early is not None:
        control = admission_mod.SLOMax._control

        def early(self, pool, now, _control=control):  # type: ignore[no-untyped-def]
            c = pool.controller
            if (c.rate is None and pool.next_control is not None and now < pool.next_control
                    and pool.interval_start is not None and now - pool.interval_start >= a.early * S
                    and len(pool.signals.tpot_ratios) >= c.config.min_samples
                    and (pool.signals.p95() or 0.0) > c.config.high):
                pool.next_control = now
            return _control(self, pool, now)
        admission_mod.SLOMax._control = early  # type: ignore[method-assign]

    router = make_policy("tokenpilot", 0, fleet)
    sim = FleetSimulator(fleet, router, site_chooser=make_placement("fleetmind", fleet, router), admission=adm)
    recs = sim.run(prepare(trace, fleet)).records

    bins: dict[int, dict[str, int]] = {}
    goodput = 0
    for r in recs:
        b = bins.setdefault(int(r.arrival_s // (5 * S)), dict(requests=0, rejected=0, ttft_miss=0, tpot_miss=0, met=0))
        b["requests"] += 1
        if r.status != "completed":
            b["rejected"] += 1
            continue
        ttft_bad = r.ttft_s is not None and r.ttft_s > TTFT_SLO
        tpot_bad = r.tpot_s is not None and r.tpot_s > TPOT_SLO
        b["ttft_miss"] += ttft_bad
        b["tpot_miss"] += tpot_bad
        if not (ttft_bad or tpot_bad):
            b["met"] += 1
            goodput += r.output_tokens
    total = {k: sum(b[k] for b in bins.values()) for k in ("requests", "rejected", "ttft_miss", "tpot_miss", "met")}
    print(f"total {total}; goodput {goodput} output tokens of requests meeting their SLO")
    for k in sorted(bins):
        print(f"  arrivals {k * 5:3d}-{k * 5 + 5:3d} s: {bins[k]}")
    pool = adm._pools[fleet.models[0].name]
    print("controller (wall s, prefill rate per instance, TPOT p95 / SLO):",
          [(round(t / S, 1), None if r is None else round(r * S), None if q is None else round(q, 2))
           for t, r, _, q in pool.controller.history])
    return 0


if __name__ == "__main__":
    sys.exit(main())
