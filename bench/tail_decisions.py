"""TokenPilot's decisions for the slowest requests of a routing-table row: why a request that
lost cache left the instance holding its prefix.

    .venv/bin/python bench/tail_decisions.py GEN_DIR --row agent-rr75 [--top 100] [--seed 0] [--show 10]

Runs TokenPilot on the row (trace and rate scale from bench/routing_tables.sh, first MAX
requests) keeping every decision with every candidate's terms (explanations only: the decisions
are those of the default configuration), takes the `top` requests by TTFT and counts, among those
that got at least one trace block less than the causal floor's hit (`routing_report.causal_floor_times`),
how many had the prefix holder (the candidate with the most cached tokens) predicted faster to the
first token by the scheduler-forward model, and of those how many were sent elsewhere because
the own-decode and interference terms (the TPOT budget's protection) outweighed that difference.
"""

from __future__ import annotations

import argparse
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable from a checkout without installing

from bench.ranking_ab import table_rows  # noqa: E402
from bench.routing_report import causal_floor_times  # noqa: E402
from fleetcore.fleet_config import load_fleet_file  # noqa: E402
from fleetsim.cli import DEFAULT_SIM_FLEET, make_policy  # noqa: E402
from fleetsim.simulator import FleetSimulator, HashCache, prepare  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    from workloads import head, load_trace, scale_rate

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gen_dir")
    ap.add_argument("--row", required=True)
    ap.add_argument("--top", type=int, default=100)
    ap.add_argument("--show", type=int, default=10, help="print this many decisions in full")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max", type=int, default=2000)
    ap.add_argument("--fleet", default=str(DEFAULT_SIM_FLEET))
    a = ap.parse_args(argv)
    fleet = load_fleet_file(Path(a.fleet))
    rows = {n: (t, s) for n, t, s, _ in table_rows(a.gen_dir, str(REPO / "traces"))}
    trace, scale = rows[a.row]
    reqs = scale_rate(head(load_trace(trace), a.max), scale).requests
    _, causal = causal_floor_times(trace, a.max, scale)
    router = make_policy("tokenpilot", a.seed, fleet)
    router.config = replace(router.config, max_candidates_explained=1 << 10)  # every candidate
    router.decisions = deque(maxlen=len(reqs) + 1)  # every decision (the default keeps 256)
    res = FleetSimulator(fleet, router).run(prepare(reqs, fleet, hash_cache=HashCache()))
    dec = dict(router.decisions)
    rec = {r.request_id: r for r in res.records}
    ttft = np.array([rec[f"r{i}"].ttft_s or 0.0 for i in range(len(reqs))])
    lost = faster = protected = shown = 0
    for i in np.argsort(-ttft, kind="stable")[:a.top]:
        r, d = rec[f"r{i}"], dec.get(f"r{i}")
        if d is None or r.cached_tokens + reqs[i].block_tokens > causal[i]:
            continue
        lost += 1
        by = {c.name: c for c in d.candidates}
        ch = by[d.instance_id]
        holder = max(d.candidates, key=lambda c: c.detail["cached_tokens"])
        if holder.name == d.instance_id:
            continue
        h, c = holder.detail, ch.detail
        if h["forward_ttft_s"] < c["forward_ttft_s"]:
            faster += 1
            if (h["decode_s"] + h["interference_s"]) - (c["decode_s"] + c["interference_s"]) \
                    > c["forward_ttft_s"] - h["forward_ttft_s"]:
                protected += 1
        if shown < a.show:
            shown += 1
            f = "ttft {forward_ttft_s:.3f} s, queue {queue_s:.3f}, prefill {prefill_s:.3f}, own decode {decode_s:.3f}, " \
                "interference {interference_s:.3f}, cached {cached_tokens:.0f}"
            print(f"r{i}: TTFT {r.ttft_s:.3f} s, prompt {r.prompt_tokens}, got {r.cached_tokens} cached "
                  f"(causal {causal[i]:.0f}); {d.reason}\n  chosen {d.instance_id}: cost {ch.score:.3f}, "
                  f"{f.format(**c)}\n  holder {holder.name}: cost {holder.score:.3f}, {f.format(**h)}")
    print(f"{a.row}: of the {a.top} slowest, {lost} got >= 1 block less than the causal hit; the prefix holder was "
          f"predicted faster to the first token for {faster}, and for {protected} of those the own-decode + "
          f"interference terms (TPOT protection) outweighed the difference")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
