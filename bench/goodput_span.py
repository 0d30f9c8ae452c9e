"""What sets TokenPilot's goodput against the best peer on a routing-table row: the run's span.

    .venv/bin/python bench/goodput_span.py GEN_DIR --rows "chat-60 azure-conv-60" [--seeds 0,1,2] [--max 2000]

Goodput is good tokens over the run's span (first arrival to last end, `fleetsim.metrics`), so
where every router meets ~100% of SLOs the goodput ratio is the ratio of spans, and the span is
the end of one request. Per row and seed this runs TokenPilot and the issue's peers
(`ranking_ab.PEERS`) on the same prepared requests and seed and gives, against the peer with the
best goodput: both goodputs and their ratio, the ratio of good tokens (what the ratio would be over
one common span), both spans, the last request to end (the same one for both, where it says so)
with its output tokens and its time per token on each, and the uncached prompt tokens that other
requests prefilled on its instance while it decoded (each prefill step stalls every stream there).
GEN_DIR holds the generators' chat.jsonl / agent.jsonl as bench/routing_tables.sh writes them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable from a checkout without installing
sys.path.insert(0, str(REPO / "bench"))

from fleetcore.fleet_config import load_fleet_file  # noqa: E402
from fleetsim.cli import DEFAULT_SIM_FLEET, make_policy  # noqa: E402
from fleetsim.metrics import RequestRecord, summarize_all  # noqa: E402
from fleetsim.simulator import FleetSimulator, HashCache, prepare  # noqa: E402
from ranking_ab import PEERS, table_rows  # noqa: E402


def stalls_during(records: Sequence[RequestRecord], last: RequestRecord) -> int:
    """Uncached prompt tokens of requests that arrived on `last`'s instance while it decoded."""
    start = last.arrival_s + (last.ttft_s or 0.0)
    return sum(r.prompt_tokens - r.cached_tokens for r in records
               if r is not last and r.instance == last.instance and start < r.arrival_s < last.end_s)


def main(argv: Sequence[str] | None = None) -> int:
    from workloads import head, load_trace, scale_rate

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("gen_dir")
    p.add_argument("--rows", required=True)
    p.add_argument("--seeds", default="0")
    p.add_argument("--max", type=int, default=2000)
    p.add_argument("--fleet", default=str(DEFAULT_SIM_FLEET))
    a = p.parse_args(argv)
    fleet = load_fleet_file(Path(a.fleet))
    slos = fleet.admission.slos()
    want = set(a.rows.split())
    seeds = [int(x) for x in a.seeds.split(",")]
    print("| row | seed | TokenPilot goodput | best peer | its goodput | goodput ratio | good tokens ratio "
          "| span s TP / peer | last to end (out tokens) | its TPOT ms TP / peer "
          "| uncached tokens prefilled beside it TP / peer |")
    print("|---|---:|---:|---|---:|---:|---:|---|---|---|---|")
    for name, trace, scale, _ in table_rows(a.gen_dir, str(REPO / "traces")):
        if name not in want:
            continue
        inputs = prepare(scale_rate(head(load_trace(trace), a.max), scale).requests, fleet, hash_cache=HashCache())
        for seed in seeds:
            runs = {}
            for pol in ("tokenpilot", *PEERS):
                recs = FleetSimulator(fleet, make_policy(pol, seed, fleet)).run(inputs).records
                runs[pol] = (summarize_all(recs, slos), recs)
            peer = max(PEERS, key=lambda x: runs[x][0]["goodput_tok_s"])
            (st, rt), (sp, rp) = runs["tokenpilot"], runs[peer]
            lt, lp = (max(recs, key=lambda r: r.end_s or 0.0) for recs in (rt, rp))
            last = lt.request_id if lt.request_id == lp.request_id else f"{lt.request_id} / {lp.request_id}"
            good_t, good_p = (s["goodput_tok_s"] * s["span_s"] for s in (st, sp))
            print(f"| {name} | {seed} | {st['goodput_tok_s']:.0f} | {peer} | {sp['goodput_tok_s']:.0f} "
                  f"| {st['goodput_tok_s'] / sp['goodput_tok_s']:.4f}x | {good_t / good_p:.4f}x "
                  f"| {st['span_s']:.2f} / {sp['span_s']:.2f} | {last} ({lt.output_tokens}) "
                  f"| {1e3 * (lt.tpot_s or 0):.2f} / {1e3 * (lp.tpot_s or 0):.2f} "
                  f"| {stalls_during(rt, lt)} / {stalls_during(rp, lp)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
