"""Public trace files → canonical Workloads.

Formats:
  * `mooncake`  — JSON lines (optionally gzip) with timestamp (ms), input_length,
                  output_length, hash_ids; the files in traces/ (in the repository).
  * `canonical` — the same layout plus optional keys (see `workloads.trace`);
                  one parser serves both, so a Mooncake file is a canonical file.
  * `azure`     — AzureLLMInferenceTrace CSVs: TIMESTAMP (wall clock, 7 fractional
                  digits), ContextTokens, GeneratedTokens. Timestamps become ms
                  after the first row. The trace carries no prefix information, so
                  every request gets its own fresh block ids (ceil(input/block_tokens)
                  of them, in a namespace of this file): nothing is shared, and any
                  cache hit a policy reports on it is a bug.
  * `auto`      — by extension (.csv → azure, .jsonl/.json → canonical, .gz looks
                  through), else by the first non-blank line ('{' → canonical).
"""

from __future__ import annotations

import csv
import io
from datetime import date
from pathlib import Path

from workloads.trace import (
    DEFAULT_BLOCK_TOKENS,
    TraceRequest,
    Workload,
    _stem,
    id_namespace,
    parse_jsonl,
    read_text,
)

FORMATS = ("auto", "mooncake", "canonical", "azure")


def detect_format(path: str | Path) -> str:
    name = Path(path).name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    if name.endswith(".csv"):
        return "azure"
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "canonical"
    for line in read_text(path).splitlines():
        if line.strip():
            return "canonical" if line.lstrip().startswith("{") else "azure"
    return "canonical"


def load_trace(path: str | Path, fmt: str = "auto", *, block_tokens: int = DEFAULT_BLOCK_TOKENS,
               id_offset: int = 0, name: str | None = None) -> Workload:
    """Load a trace file. `block_tokens` applies to azure (JSONL files say their own);
    `id_offset` shifts JSONL hash ids so two traces can be merged without false sharing."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown trace format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt in ("mooncake", "canonical"):
        return parse_jsonl(path, id_offset=id_offset, name=name, fmt=fmt)
    return load_azure(path, block_tokens=block_tokens, name=name)


def _tenth_us(stamp: str, days: dict[str, int]) -> int:
    """'2023-11-16 18:17:03.9799600' → integer 100 ns units (exact: no float drift over an hour)."""
    d, t = stamp.strip().split(" ")
    day = days.get(d)
    if day is None:
        day = days[d] = date.fromisoformat(d).toordinal()
    hh, mm, ss = t.split(":")
    sec, _, frac = ss.partition(".")
    frac = (frac + "0000000")[:7]
    return ((((day * 24 + int(hh)) * 60 + int(mm)) * 60 + int(sec)) * 10_000_000) + int(frac)


def load_azure(path: str | Path, *, block_tokens: int = DEFAULT_BLOCK_TOKENS,
               name: str | None = None) -> Workload:
    p = Path(path)
    reader = csv.reader(io.StringIO(read_text(p)))
    try:
        header = [h.strip().lower() for h in next(reader)]
    except StopIteration:
        raise ValueError(f"{p}:1: empty file, expected a TIMESTAMP,ContextTokens,GeneratedTokens header") from None
    try:
        i_ts, i_in, i_out = (header.index(c) for c in ("timestamp", "contexttokens", "generatedtokens"))
    except ValueError:
        raise ValueError(f"{p}:1: header must name TIMESTAMP, ContextTokens and GeneratedTokens, "
                         f"got {header}") from None
    base = id_namespace(f"azure:{p.name}")
    next_id = base
    days: dict[str, int] = {}
    t0: int | None = None
    requests: list[TraceRequest] = []
    for row in reader:
        lineno = reader.line_num
        if not row or all(not c.strip() for c in row):
            continue
        try:
            ts = _tenth_us(row[i_ts], days)
            inp = int(row[i_in])
            out = int(row[i_out])
            if inp < 0 or out < 0:
                raise ValueError("token counts must be non-negative")
        except (ValueError, IndexError) as e:
            raise ValueError(f"{p}:{lineno}: malformed row {row!r}: {e}") from None
        if t0 is None:
            t0 = ts
        n_blocks = -(-inp // block_tokens)
        requests.append(TraceRequest((ts - t0) / 10_000.0, inp, out,
                                     tuple(range(next_id, next_id + n_blocks)), block_tokens))
        next_id += n_blocks
    return Workload(name or _stem(p), requests, block_tokens,
                    {"source": str(p), "format": "azure", "prefix_info": False})
