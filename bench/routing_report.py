"""Turn the JSON results of bench/routing_tables.sh into the markdown tables of bench/ROUTING.md.

    python bench/routing_report.py [bench_out] > tables.md

Each table gets TokenPilot's ratios against round_robin and against the best published
router at that load (lowest TTFT p95 among sglang_cache_aware, dynamo_kv, llm_d,
aibrix_prefix), and the physical floor: the TTFT every request would have on an idle
fleet with an infinite, perfectly shared prefix cache (no router can beat it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

PEERS = ("sglang_cache_aware", "dynamo_kv", "llm_d", "aibrix_prefix")


def floor_ms(trace: str) -> tuple[float, float]:
    """TTFT p50/p95 on an idle fleet with an ideal cache (default sim fleet's engine)."""
    from tokenpilot.priors import prior_from_physics
    from workloads import load_trace

    p = prior_from_physics("llama-3.1-70b", "H200", 2)
    seen: set[int] = set()
    t = []
    for r in load_trace(trace).requests:
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


def table(path: Path, floors: dict[str, tuple[float, float]]) -> str:
    d = json.loads(path.read_text())
    res = {r["policy"]: r for r in d["results"]}
    out = [f"### {path.stem} (rate-scale {d['workload']['rate_scale']}, {d['workload']['requests']} requests)", "",
           "| policy | TTFT p50 ms | TTFT p95 ms | TTFT p99 ms | TPOT p50 ms | goodput tok/s | SLO % "
           "| interactive SLO % | cache hit % |", "|---|---|---|---|---|---|---|---|---|"]
    for p, r in res.items():
        ic = r["by_class"].get("interactive", {})
        out.append(f"| {p} | {r['ttft_ms']['p50']:.0f} | {r['ttft_ms']['p95']:.0f} | {r['ttft_ms']['p99']:.0f} "
                   f"| {r['tpot_ms']['p50']:.1f} | {r['goodput_tok_s']:.0f} | {100 * r['slo_attainment']:.1f} "
                   f"| {100 * (ic.get('slo_attainment') or 0):.1f} | {100 * r['cache_hit_rate']:.1f} |")
    if "tokenpilot" in res and "round_robin" in res:
        t, rr = res["tokenpilot"], res["round_robin"]
        peers = [p for p in PEERS if p in res]
        best = min(peers, key=lambda p: res[p]["ttft_ms"]["p95"])
        trace = d["workload"].get("trace", "")
        fl = floors.get(trace)
        out += ["", f"TokenPilot / round_robin: TTFT p50 **{t['ttft_ms']['p50'] / rr['ttft_ms']['p50']:.2f}x** "
                    f"(target <= 0.25), p95 **{t['ttft_ms']['p95'] / rr['ttft_ms']['p95']:.2f}x** (target <= 0.60). "
                    f"TokenPilot / best peer ({best}): TTFT p95 **{t['ttft_ms']['p95'] / res[best]['ttft_ms']['p95']:.2f}x** "
                    f"(target <= 0.85), goodput **{t['goodput_tok_s'] / res[best]['goodput_tok_s']:.2f}x** (target >= 1)."]
        if fl:
            out.append(f"Physical floor (idle fleet, ideal shared cache): p50 {fl[0]:.0f} ms, p95 {fl[1]:.0f} ms; "
                       f"so p50 <= 0.25x round_robin needs <= {0.25 * rr['ttft_ms']['p50']:.0f} ms and p95 <= 0.85x "
                       f"{best} needs <= {0.85 * res[best]['ttft_ms']['p95']:.0f} ms.")
    return "\n".join(out)


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "bench_out")
    files = sorted(folder.glob("*.json"))
    traces = {json.loads(f.read_text())["workload"].get("trace", "") for f in files}
    floors = {t: floor_ms(t) for t in traces if t and Path(t).exists()}
    print("\n\n".join(table(f, floors) for f in files))


if __name__ == "__main__":
    main()
