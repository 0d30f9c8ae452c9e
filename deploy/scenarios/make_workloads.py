"""Write the FleetMind scenario workloads (canonical JSONL) into a folder.

    python deploy/scenarios/make_workloads.py OUT_DIR [--requests N] [--traces DIR]

multisite.jsonl: the first N requests of the Mooncake conversation trace, all entering
at us-east, split between tenants acme (US-only) and globex (anywhere) by session,
10% of them pinned to model version v2.
demand-shift.jsonl: 20 minutes of the trace entering at us-east, then 20 at us-west.
flash-crowd.jsonl: 30 minutes entering at us-east, plus a 2-minute burst at us-west.
cheap-site.jsonl: 30 minutes entering at us-west (whose site has slower GPUs).
busy-neighbour.jsonl: 20 minutes at us-east at 0.75x the trace's rate, and other sessions
at us-west at 0.35x.
All deterministic.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from pathlib import Path

from workloads import Workload, assign, head, load_trace, merge, scale_rate, window

MODEL = "llama-3.1-70b"


def multisite(traces: Path, n: int) -> Workload:
    wl = assign(head(load_trace(traces / "conversation_trace.jsonl.gz"), n),
                tenants={"acme": 0.5, "globex": 0.5}, regions={"us-east": 1.0}, seed=7)
    rng = random.Random(11)
    reqs = [dataclasses.replace(r, model=f"{MODEL}@v2" if rng.random() < 0.1 else MODEL) for r in wl.requests]
    return Workload("multisite", reqs, wl.block_tokens, {"source": "conversation_trace head", "requests": n})


def _at(wl: Workload, region: str, start_s: float) -> list:  # type: ignore[type-arg]
    return [dataclasses.replace(r, region=region, timestamp_ms=r.timestamp_ms + 1000 * start_s) for r in wl.requests]


def demand_shift(traces: Path, rate_scale: float = 0.7) -> Workload:
    trace = scale_rate(load_trace(traces / "conversation_trace.jsonl.gz"), rate_scale)
    first, second = window(trace, 0, 1200), window(trace, 1200, 1200)
    return Workload("demand-shift", _at(first, "us-east", 0) + _at(second, "us-west", 1200), trace.block_tokens,
                    {"phases": "0-1200 s us-east, 1200-2400 s us-west", "rate_scale": rate_scale})


def flash_crowd(traces: Path, rate_scale: float = 0.7) -> Workload:
    trace = scale_rate(load_trace(traces / "conversation_trace.jsonl.gz"), rate_scale)
    steady = window(trace, 0, 1800)
    burst = scale_rate(window(trace, 1800, 360), 3.0)  # 6 minutes of traffic in 2
    return merge(Workload("steady", _at(steady, "us-east", 0), trace.block_tokens),
                 Workload("burst", _at(burst, "us-west", 600), trace.block_tokens), name="flash-crowd")


def cheap_site(traces: Path, rate_scale: float = 0.7) -> Workload:
    trace = scale_rate(load_trace(traces / "conversation_trace.jsonl.gz"), rate_scale)
    return Workload("cheap-site", _at(window(trace, 0, 1800), "us-west", 0), trace.block_tokens,
                    {"phases": "0-1800 s us-west", "rate_scale": rate_scale})


def busy_neighbour(traces: Path) -> Workload:
    trace = load_trace(traces / "conversation_trace.jsonl.gz")
    hot = window(scale_rate(trace, 0.75), 0, 1200)  # ~150% of the east site
    own = window(scale_rate(trace, 0.35), 1200, 1200)  # ~70% of the west site, other sessions
    return merge(Workload("hot", _at(hot, "us-east", 0), trace.block_tokens),
                 Workload("own", _at(own, "us-west", 0), trace.block_tokens), name="busy-neighbour")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--requests", type=int, default=2400)
    ap.add_argument("--traces", default=str(Path(__file__).resolve().parents[2] / "traces"))
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    traces = Path(args.traces)
    for name, wl in (("multisite", multisite(traces, args.requests)), ("demand-shift", demand_shift(traces)),
                     ("flash-crowd", flash_crowd(traces)), ("cheap-site", cheap_site(traces)),
                     ("busy-neighbour", busy_neighbour(traces))):
        path = out / f"{name}.jsonl"
        wl.to_jsonl(path)
        print(f"wrote {path} ({len(wl)} requests)")


if __name__ == "__main__":
    main()
