"""Write the agent-loop workload of bench/DISAGG.md: `workloads.generators.agent_loops`
(agents re-send a long tool prefix and their growing history every step), seeded.

    python bench/make_agent_trace.py OUT.jsonl [--agents N] [--rate R] [--prefixes K] [--seed S]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.trace_file, from a checkout

from bench.trace_file import write_trace  # noqa: E402
from workloads.generators import agent_loops  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--agents", type=int, default=350, help="agents (default 350)")
    p.add_argument("--rate", type=float, default=1.0, help="new agents per second (default 1)")
    p.add_argument("--prefixes", type=int, default=4, help="agent apps, each with its own tool prefix (default 4)")
    p.add_argument("--seed", type=int, default=17)
    a = p.parse_args(argv)
    w = agent_loops(agents=a.agents, rate=a.rate, prefixes=a.prefixes, seed=a.seed)
    write_trace(w, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
