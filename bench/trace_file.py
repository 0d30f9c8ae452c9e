"""Writing a generated trace for a bench doc: the file, and the line its command is quoted with.

Every figure in a bench doc names the checksum of the inputs it was measured on, so a script
that generates a trace prints the sha256 of what it wrote (`make_agent_trace.py`,
`make_longdoc_trace.py`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from workloads.trace import Workload


def write_trace(w: Workload, out: Path) -> str:
    """Write `w` to `out` as canonical JSON lines (its folder made if missing), print how many
    requests and the file's sha256, and return the sha256."""
    out.parent.mkdir(parents=True, exist_ok=True)
    w.to_jsonl(out)
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    print(f"wrote {out}: {len(w.requests)} requests, sha256 {digest}")
    return digest
