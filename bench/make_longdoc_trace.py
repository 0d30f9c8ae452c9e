"""Write the long-document workload of bench/DISAGG.md: `workloads.generators.document_analysis`
(each question re-sends a long document plus the question; class long_context), seeded.

    python bench/make_longdoc_trace.py OUT.jsonl [--documents N] [--rate R] [--seed S]
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Sequence
from pathlib import Path

from workloads.generators import document_analysis


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--documents", type=int, default=1200, help="documents (default 1200)")
    p.add_argument("--rate", type=float, default=0.5, help="new documents per second (default 0.5)")
    p.add_argument("--seed", type=int, default=17)
    a = p.parse_args(argv)
    w = document_analysis(documents=a.documents, rate=a.rate, seed=a.seed, question_gap_s=20.0)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    w.to_jsonl(a.out)
    digest = hashlib.sha256(a.out.read_bytes()).hexdigest()
    print(f"wrote {a.out}: {len(w.requests)} requests, sha256 {digest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
