"""Turn the JSON results of bench/routing_tables.sh into the markdown tables of bench/ROUTING.md.

    python bench/routing_report.py [bench_out ...] > tables.md
    python bench/routing_report.py --targets [bench_out ...]   # the "Against the targets" table

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
from collections.abc import Sequence
from typing import Any

import numpy as np

PEERS = ("sglang_cache_aware", "dynamo_kv", "llm_d", "aibrix_prefix", "least_loaded")
P50_TARGET, P95_TARGET = 1.5, 1.15  # x the floor


def _prior():  # type: ignore[no-untyped-def]
    from tokenpilot.priors import prior_from_physics

    return prior_from_physics("llama-3.1-70b", "H200", 2)


def prefill_s(u: np.ndarray, cached: np.ndarray) -> np.ndarray:
    """Prefill of u uncached tokens after `cached` ones on an idle instance (default sim fleet's engine)."""
    p = _prior()
    return (u * p.prefill_token_s + p.attn_s_per_token_ctx * u * (cached + u / 2)
            + (u / p.max_batched_tokens + 1) * p.step_overhead_s)


def _requests(trace: str, max_requests: int | None, rate_scale: float = 1.0) -> list[Any]:
    from workloads import head, load_trace, scale_rate

    wl = load_trace(trace)
    if max_requests:
        wl = head(wl, max_requests)
    return list(scale_rate(wl, rate_scale).requests if rate_scale != 1.0 else wl.requests)


def ideal_cached_blocks(reqs: Sequence) -> list[int]:
    """Per request, its leading blocks that any earlier request carried (the issue's ideal
    shared cache: a block counts as cached from the arrival of the first request carrying it)."""
    seen: set[int] = set()
    out = []
    for r in reqs:
        k = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            k += 1
        seen.update(r.hash_ids)
        out.append(k)
    return out


def floor_times(trace: str, max_requests: int | None = None) -> np.ndarray:
    """Per request (trace order), the TTFT on an idle fleet with an ideal cache, seconds."""
    reqs = _requests(trace, max_requests)
    u, c = [], []
    for r, k in zip(reqs, ideal_cached_blocks(reqs)):
        cached = min(r.block_tokens * k, r.input_length - 1)
        u.append(r.input_length - cached)
        c.append(cached)
    return prefill_s(np.array(u, dtype=float), np.array(c, dtype=float))


def floor_ms(trace: str, max_requests: int | None = None) -> tuple[float, float]:
    """TTFT p50/p95 on an idle fleet with an ideal cache (default sim fleet's engine)."""
    t = floor_times(trace, max_requests)
    return float(np.percentile(t, 50) * 1000), float(np.percentile(t, 95) * 1000)


ENGINE_BLOCK = 16  # the default sim fleet's engine KV block (tokens)


def causal_floor_times(trace: str, max_requests: int | None = None,
                       rate_scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Per request (trace order): (TTFT s, cached tokens) on an idle fleet with an ideal shared
    cache that holds only what an engine could have computed by the request's arrival.

    Not the issue's floor (`floor_times`), a reference beside it. Two differences, both things
    no router can change: (1) a token is cached only once an earlier request's *prompt* carried
    it and that prompt had its first token (its own causal-floor TTFT after its arrival): the
    issue's floor counts a block as soon as a request holding it arrived; (2) at the engine's
    block granularity, not the trace's: a trace block id covers the tokens of a partial last
    block, and the next turn of a chat or agent reuses that id once the block is full (the reply
    and the new message); the issue's floor counts that whole block as cached, while an engine
    holds only the part an earlier prompt covered (the simulated engine caches prompt blocks,
    not generated ones: `engine_adapters/sim/engine.py`). Depends on the rate scale (arrivals).
    """
    reqs = _requests(trace, max_requests, rate_scale)
    keys = [[tuple(r.hash_ids[:j + 1]) for j in range(len(r.hash_ids))] for r in reqs]  # ids are per position
    arrival = np.array([r.timestamp_ms / 1000.0 for r in reqs])
    ready: dict[tuple[int, ...], list[tuple[float, int]]] = {}  # key -> (time, tokens of it covered)
    ttft, cached = np.zeros(len(reqs)), np.zeros(len(reqs))
    for i in np.argsort(arrival, kind="stable"):
        r = reqs[i]
        bt, full = r.block_tokens, r.input_length // ENGINE_BLOCK * ENGINE_BLOCK
        hit = 0
        for j, key in enumerate(keys[i]):
            cov = max((c for t, c in ready.get(key, ()) if t <= arrival[i]), default=0)
            hit = j * bt + cov
            if cov < bt:
                break
        cached[i] = min(hit, (r.input_length - 1) // ENGINE_BLOCK * ENGINE_BLOCK)
        ttft[i] = prefill_s(np.array(float(r.input_length - cached[i])), np.array(cached[i]))
        t = arrival[i] + ttft[i]
        for j, key in enumerate(keys[i]):
            ready.setdefault(key, []).append((t, max(0, min(bt, full - j * bt))))
    return ttft, cached


def causal_floor_ms(trace: str, max_requests: int | None, rate_scale: float) -> tuple[float, float]:
    t, _ = causal_floor_times(trace, max_requests, rate_scale)
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
            cf = causal_floor_ms(trace, w.get("max_requests"), float(w["rate_scale"]))
            out.append(f"Causal floor (reference, not the target: only what earlier prompts carried, once their "
                       f"prefill ran, at engine-block granularity): p50 {cf[0]:.0f} ms, p95 {cf[1]:.0f} ms; "
                       f"TokenPilot {t['ttft_ms']['p50'] / cf[0]:.2f}x / {t['ttft_ms']['p95'] / cf[1]:.2f}x of it.")
    return "\n".join(out)


LEVELS = ("60", "80", "95", "rr75")  # rr75: where round robin meets ~75% of SLOs (the floor targets' load)


def targets(rows: dict[str, list[Path]]) -> str:
    """The "Against the targets" table: every row's goodput against the best peer (a target at
    every load), its floor ratios (judged at the rr75 row only, as the issue sets them; shown at
    every load), and the causal floor's ratios as a reference column (never judged)."""
    def mark(x: float, ok: bool, judged: bool) -> str:
        return (f"**{x:.2f}**" if ok else f"{x:.2f} (miss)") if judged else f"{x:.2f}"

    out = ["| row (first 2,000 requests) | rate scale | round_robin SLO % | TTFT p50 / floor (<= 1.5 at rr75) "
           "| TTFT p95 / floor (<= 1.15 at rr75) | goodput / best peer (>= 1) | p50 / causal floor "
           "| p95 / causal floor |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    def order(name: str) -> tuple[str, int]:
        w, _, lv = name.rpartition("-")
        return (w, LEVELS.index(lv) if lv in LEVELS else 9)
    for name in sorted(rows, key=order):
        w, res = merged(rows[name])
        trace = w.get("trace", "")
        if "tokenpilot" not in res or not trace or not Path(trace).exists():
            continue
        t = res["tokenpilot"]["ttft_ms"]
        fl = floor_ms(trace, w.get("max_requests"))
        cf = causal_floor_ms(trace, w.get("max_requests"), float(w["rate_scale"]))
        peers = [p for p in PEERS if p in res]
        best = max(peers, key=lambda p: res[p]["goodput_tok_s"])
        g = res["tokenpilot"]["goodput_tok_s"] / res[best]["goodput_tok_s"]
        judged = name.endswith("-rr75")
        rr = f"{100 * res['round_robin']['slo_attainment']:.0f}" if "round_robin" in res else "-"
        out.append(f"| {'**' + name + '**' if judged else name} | {w['rate_scale']} | {rr} "
                   f"| {mark(t['p50'] / fl[0], t['p50'] / fl[0] <= P50_TARGET, judged)} "
                   f"| {mark(t['p95'] / fl[1], t['p95'] / fl[1] <= P95_TARGET, judged)} "
                   f"| {mark(g, g >= 1.0, True)} ({best}) | {t['p50'] / cf[0]:.2f} | {t['p95'] / cf[1]:.2f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="*", default=["bench_out"], help="routing_tables.sh OUT folders, merged row by row")
    p.add_argument("--targets", action="store_true", help='only the "Against the targets" table')
    a = p.parse_args(argv)
    rows: dict[str, list[Path]] = {}
    for folder in map(Path, a.folders):
        for f in sorted(folder.glob("*.json")):
            rows.setdefault(f.stem, []).append(f)
    if a.targets:
        print(targets(rows))
        return
    print("\n\n".join(table(name, files) for name, files in sorted(rows.items())))

if __name__ == "__main__":
    main()
