"""Where a policy's TTFT goes above the physical floor, request by request, on routing-table rows.

    .venv/bin/python bench/floor_gap.py GEN_DIR --rows "chat-rr75 agent-rr75" [--policies tokenpilot,dynamo_kv] [--seed 1]

For every request of every policy run (the row's trace and rate scale from bench/routing_tables.sh,
first MAX requests) three prefill times by the same roofline prior as `routing_report.floor_ms`:

- floor: idle fleet, ideal shared cache (the issue's floor, `floor_ms`);
- causal floor (`routing_report.causal_floor_times`): idle fleet, ideal shared cache holding only
  the tokens an earlier request's prompt carried, from that prompt's first token on the idle
  fleet, at engine-block granularity. No engine can hit tokens whose prefill has not run, or that
  no prompt carried; the issue's floor counts a trace block as soon as a request carrying it
  *arrived*, partial blocks whole. A reference, never a replacement;
- idle with its hit: idle instance, the cached tokens the request actually got in this run.

So TTFT - floor splits into (causal floor - floor: unreachable by any router) + (idle with its hit -
causal floor: cache the routing lost, by spreading or eviction) + (TTFT - idle with its hit:
queueing and batching behind other work). Printed as p50/p95 of each time and means of the parts,
plus where the first missed block of each request that got less than the causal ideal lived.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable from a checkout without installing

from bench.ranking_ab import table_rows  # noqa: E402
from fleetcore.fleet_config import load_fleet_file  # noqa: E402
from fleetsim.cli import DEFAULT_SIM_FLEET, make_policy  # noqa: E402
from fleetsim.metrics import summarize_all  # noqa: E402
from fleetsim.simulator import FleetSimulator, HashCache, prepare  # noqa: E402
from bench.routing_report import causal_floor_times, floor_times, ideal_cached_blocks, prefill_s  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    from workloads import head, load_trace, scale_rate

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gen_dir")
    ap.add_argument("--rows", required=True)
    ap.add_argument("--policies", default="tokenpilot,dynamo_kv,sglang_cache_aware")
    ap.add_argument("--max", type=int, default=2000)
    ap.add_argument("--fleet", default=str(DEFAULT_SIM_FLEET))
    ap.add_argument("--seed", type=int, default=0, help="the policies' seed (TokenPilot: its exploration draws)")
    a = ap.parse_args(argv)
    fleet = load_fleet_file(Path(a.fleet))
    slos = fleet.admission.slos()
    want = set(a.rows.split())
    for name, trace, scale, _ in table_rows(a.gen_dir, str(REPO / "traces")):
        if name not in want:
            continue
        wl = scale_rate(head(load_trace(trace), a.max), scale)
        reqs = wl.requests
        n = len(reqs)
        keys = [[tuple(r.hash_ids[:j + 1]) for j in range(len(r.hash_ids))] for r in reqs]
        arrival = np.array([r.timestamp_ms / 1000.0 for r in reqs])
        inp = np.array([r.input_length for r in reqs], dtype=float)
        bt = np.array([r.block_tokens for r in reqs], dtype=float)
        floor = floor_times(trace, a.max)
        cfloor, causal = causal_floor_times(trace, a.max, scale)
        ideal_hit = [min(r.block_tokens * _k, r.input_length - 1) for r, _k in zip(reqs, ideal_cached_blocks(reqs))]
        inputs = prepare(reqs, fleet, hash_cache=HashCache())
        print(f"### {name} (rate-scale {scale}, {n} requests): floor p50 {np.percentile(floor, 50) * 1e3:.0f} / "
              f"p95 {np.percentile(floor, 95) * 1e3:.0f} ms; causal floor p50 {np.percentile(cfloor, 50) * 1e3:.0f} / "
              f"p95 {np.percentile(cfloor, 95) * 1e3:.0f} ms; ideal hit {100 * sum(ideal_hit) / inp.sum():.1f}%, "
              f"causal {100 * causal.sum() / inp.sum():.1f}% of prompt tokens")
        print("| policy | TTFT p50 / p95 ms | idle with its hit p50 / p95 ms | hit % | mean ms: unreachable | "
              "cache lost | queue+batching | short of causal hit: n | first missed block: nowhere yet | "
              "other instance | same instance (evicted / in flight) | goodput |")
        print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for pol in a.policies.split(","):
            router = make_policy(pol, a.seed, fleet)
            res = FleetSimulator(fleet, router).run(inputs)
            s = summarize_all(res.records, slos)
            rec = {r.request_id: r for r in res.records}
            ttft = np.full(n, np.nan)
            got = np.zeros(n)
            inst: list[str | None] = [None] * n
            first = np.full(n, np.inf)  # absolute first-token time
            for i in range(n):
                r = rec.get(f"r{i}")
                if r is None or r.ttft_s is None:
                    continue
                ttft[i], got[i], inst[i] = r.ttft_s, r.cached_tokens, r.instance
                first[i] = r.arrival_s + r.ttft_s
            idle = prefill_s(inp - got, got)
            ok = ~np.isnan(ttft)
            # Where was the first block it missed (of those the causal ideal had)?
            holders: dict[tuple[int, ...], list[int]] = {}
            nowhere = other = same = short = 0
            for i in np.argsort(arrival, kind="stable"):
                kb = int(got[i] // bt[i])
                if ok[i] and got[i] + bt[i] <= causal[i] and kb < len(keys[i]):
                    short += 1
                    hs = [j for j in holders.get(keys[i][kb], ()) if first[j] <= arrival[i]]
                    if not hs:
                        nowhere += 1
                    elif any(inst[j] == inst[i] for j in hs):
                        same += 1
                    else:
                        other += 1
                for key in keys[i]:
                    holders.setdefault(key, []).append(i)
            t = ttft[ok]
            print(f"| {pol} | {np.percentile(t, 50) * 1e3:.0f} / {np.percentile(t, 95) * 1e3:.0f} "
                  f"| {np.percentile(idle[ok], 50) * 1e3:.0f} / {np.percentile(idle[ok], 95) * 1e3:.0f} "
                  f"| {100 * got.sum() / inp.sum():.1f} | {(cfloor - floor)[ok].mean() * 1e3:.1f} "
                  f"| {(idle - cfloor)[ok].mean() * 1e3:.1f} | {(ttft - idle)[ok].mean() * 1e3:.1f} "
                  f"| {short} | {nowhere} | {other} | {same} | {s['goodput_tok_s']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
