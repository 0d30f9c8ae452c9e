"""Write the FleetMind scenario workloads (canonical JSONL) into a folder.

    python deploy/scenarios/make_workloads.py OUT_DIR [--requests N] [--traces DIR]

multisite.jsonl: the first N requests of the Mooncake conversation trace, all entering
at us-east, split between tenants acme (US-only) and globex (anywhere) by session,
10% of them pinned to model version v2. Deterministic.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from pathlib import Path

from workloads import Workload, assign, head, load_trace

MODEL = "llama-3.1-70b"


def multisite(traces: Path, n: int) -> Workload:
    wl = assign(head(load_trace(traces / "conversation_trace.jsonl.gz"), n),
                tenants={"acme": 0.5, "globex": 0.5}, regions={"us-east": 1.0}, seed=7)
    rng = random.Random(11)
    reqs = [dataclasses.replace(r, model=f"{MODEL}@v2" if rng.random() < 0.1 else MODEL) for r in wl.requests]
    return Workload("multisite", reqs, wl.block_tokens, {"source": "conversation_trace head", "requests": n})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--requests", type=int, default=2400)
    ap.add_argument("--traces", default=str(Path(__file__).resolve().parents[3] / "shared" / "traces"))
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "multisite.jsonl"
    multisite(Path(args.traces), args.requests).to_jsonl(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
