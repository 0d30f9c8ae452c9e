"""Write the agent-loop workload of bench/DISAGG.md: `workloads.generators.agent_loops`
(agents re-send a long tool prefix and their growing history every step), seeded.

    python bench/make_agent_trace.py OUT.jsonl [--agents N] [--rate R] [--prefixes K] [--seed S]
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Sequence
from pathlib import Path

from workloads.generators import agent_loops


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--agents", type=int, default=350, help="agents (default 350)")
    p.add_argument("--rate", type=float, default=1.0, help="new agents per second (default 1)")
    p.add_argument("--prefixes", type=int, default=4, help="agent apps, each with its own tool prefix (default 4)")
    p.add_argument("--seed", type=int, default=17)
    a = p.parse_args(argv)
    w = agent_loops(agents=a.agents, rate=a.rate, prefixes=a.prefixes, seed=a.seed)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    w.to_jsonl(a.out)
    digest = hashlib.sha256(a.out.read_bytes()).hexdigest()
    print(f"wrote {a.out}: {len(w.requests)} requests, sha256 {digest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
