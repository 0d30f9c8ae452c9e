"""Write the long-document workload of bench/DISAGG.md: `workloads.generators.document_analysis`
(each question re-sends a long document plus the question; class long_context), seeded.

    python bench/make_longdoc_trace.py OUT.jsonl [--documents N] [--rate R] [--seed S]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.trace_file, from a checkout

from bench.trace_file import write_trace  # noqa: E402
from workloads.generators import document_analysis  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--documents", type=int, default=1200, help="documents (default 1200)")
    p.add_argument("--rate", type=float, default=0.5, help="new documents per second (default 0.5)")
    p.add_argument("--seed", type=int, default=17)
    a = p.parse_args(argv)
    w = document_analysis(documents=a.documents, rate=a.rate, seed=a.seed, question_gap_s=20.0)
    write_trace(w, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
