"""Turn the JSON results of bench/routing_tables.sh into the markdown tables of bench/ROUTING.md.

    python bench/routing_report.py [bench_out ...] > tables.md

Several folders are merged row by row (same file name: one table), so policies run
separately (the peers once, TokenPilot per change) land in one table. Every row gets the
physical floor, the TTFT every request would have on an idle fleet with an infinite,
perfectly shared prefix cache (no router can beat it; `floor_ms`), each policy's TTFT p50
and p95 as a ratio to it, and TokenPilot's goodput against the best of the published
routers and least_loaded at that load.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

PEERS = ("sglang_cache_aware", "dynamo_kv", "llm_d", "aibrix_prefix", "least_loaded")
P50_TARGET, P95_TARGET = 1.5, 1.15  # x the floor


def floor_ms(trace: str, max_requests: int | None = None) -> tuple[float, float]:
    """TTFT p50/p95 on an idle fleet with an ideal cache (default sim fleet's engine)."""
    from tokenpilot.priors import prior_from_physics
    from workloads import head, load_trace

    p = prior_from_physics("llama-3.1-70b", "H200", 2)
    seen: set[int] = set()
    t = []
    wl = load_trace(trace)
    if max_requests:
        wl = head(wl, max_requests)
    for r in wl.requests:
        k = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            k += 1
        seen.update(r.hash_ids)
        cached = min(r.block_tokens * k, r.input_length - 1)
        u = r.input_length - cached
        t.append(u * p.prefill_token_s + p.attn_s_per_token_ctx * u * (cached + u / 2)
                 + (u / p.max_batched_tokens + 1) * p.step_overhead_s)
    return float(np.percentile(t, 50) * 1000), float(np.percentile(t, 95) * 1000)


def merged(files: list[Path]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(workload of the first file, policy -> result over all files; later files win)."""
    workload: dict[str, Any] = {}
    res: dict[str, dict[str, Any]] = {}
    for f in files:
        d = json.loads(f.read_text())
        workload = workload or d["workload"]
        res.update({r["policy"]: r for r in d["results"]})
    order = ["round_robin", "tokenpilot", *PEERS]
    return workload, {p: res[p] for p in sorted(res, key=lambda p: (order.index(p) if p in order else 99, p))}


def table(name: str, files: list[Path]) -> str:
    w, res = merged(files)
    trace = w.get("trace", "")
    fl = floor_ms(trace, w.get("max_requests")) if trace and Path(trace).exists() else None
    n = w.get("requests")
    out = [f"### {name} (rate-scale {w['rate_scale']}, {n} requests)", ""]
    head = ("| policy | TTFT p50 ms | TTFT p95 ms | TTFT p99 ms | p50 / floor | p95 / floor | TPOT p50 ms "
            "| goodput tok/s | SLO % | interactive SLO % | cache hit % |")
    out += [head, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p, r in res.items():
        ic = r["by_class"].get("interactive", {})
        t = r["ttft_ms"]
        ratio = (f"{t['p50'] / fl[0]:.2f}x | {t['p95'] / fl[1]:.2f}x") if fl else "- | -"
        out.append(f"| {p} | {t['p50']:.0f} | {t['p95']:.0f} | {t['p99']:.0f} | {ratio} "
                   f"| {r['tpot_ms']['p50']:.1f} | {r['goodput_tok_s']:.0f} | {100 * r['slo_attainment']:.1f} "
                   f"| {100 * (ic.get('slo_attainment') or 0):.1f} | {100 * r['cache_hit_rate']:.1f} |")
    peers = [p for p in PEERS if p in res]
    if "tokenpilot" in res and peers:
        t = res["tokenpilot"]
        best = max(peers, key=lambda p: res[p]["goodput_tok_s"])
        g = t["goodput_tok_s"] / res[best]["goodput_tok_s"]
        line = f"TokenPilot goodput / best peer ({best}): **{g:.2f}x** (target >= 1)"
        if fl:
            line += (f"; TTFT p50 **{t['ttft_ms']['p50'] / fl[0]:.2f}x** the floor (target <= {P50_TARGET}), "
                     f"p95 **{t['ttft_ms']['p95'] / fl[1]:.2f}x** (target <= {P95_TARGET})")
        if "round_robin" in res:
            line += f"; round_robin meets {100 * res['round_robin']['slo_attainment']:.0f}% of SLOs here"
        out += ["", line + "."]
        if fl:
            out.append(f"Physical floor (idle fleet, ideal shared cache): p50 {fl[0]:.0f} ms, p95 {fl[1]:.0f} ms.")
    return "\n".join(out)


def main() -> None:
    folders = [Path(a) for a in sys.argv[1:]] or [Path("bench_out")]
    rows: dict[str, list[Path]] = {}
    for folder in folders:
        for f in sorted(folder.glob("*.json")):
            rows.setdefault(f.stem, []).append(f)
    print("\n\n".join(table(name, files) for name, files in sorted(rows.items())))


if __name__ == "__main__":
    main()
