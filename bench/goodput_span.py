"""What sets TokenPilot's goodput against the best peer on a routing-table row: the run's span.

    .venv/bin/python bench/goodput_span.py GEN_DIR --rows "chat-60 azure-conv-60" [--seeds 0,1,2] [--max 2000] [--decode] [--tail N]

Goodput is good tokens over the run's span (first arrival to last end, `fleetsim.metrics`), so
where every router meets ~100% of SLOs the goodput ratio is the ratio of spans, and the span is
the end of one request. Per row and seed this runs TokenPilot and the issue's peers
(`ranking_ab.PEERS`) on the same prepared requests and seed and gives, against the peer with the
best goodput: both goodputs and their ratio, the ratio of good tokens (what the ratio would be over
one common span), both spans, the last request to end (the same one for both, where it says so)
with its output tokens and its time per token on each, and the uncached prompt tokens that other
requests prefilled on its instance while it decoded (each prefill step stalls every stream there).
GEN_DIR holds the generators' chat.jsonl / agent.jsonl as bench/routing_tables.sh writes them.

With `--decode` a second table follows, one line per run of TokenPilot and that peer, on how
crowded each request's decode was (`decode_load`): TPOT p50 / mean over all requests, the decoding
streams beside a request and their context (time-weighted over its decode, averaged over requests),
the uncached prompt tokens whose prefill ran beside it per second of its decode, the same three for
the last request to end, the drain (last end - last arrival), and goodput without the last request
(its good tokens out, the span to the next end): how much of the ratio one request carries.
With `--tail N`, the N requests that end last in each of those runs, one line each.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable from a checkout without installing
sys.path.insert(0, str(REPO / "bench"))

from fleetcore.fleet_config import load_fleet_file  # noqa: E402
from fleetsim.cli import DEFAULT_SIM_FLEET, make_policy  # noqa: E402
from fleetsim.metrics import RequestRecord, slo_met, summarize_all  # noqa: E402
from fleetsim.simulator import FleetSimulator, HashCache, prepare  # noqa: E402
from ranking_ab import PEERS, table_rows  # noqa: E402


def stalls_during(records: Sequence[RequestRecord], last: RequestRecord) -> int:
    """Uncached prompt tokens of requests that arrived on `last`'s instance while it decoded."""
    start = last.arrival_s + (last.ttft_s or 0.0)
    return sum(r.prompt_tokens - r.cached_tokens for r in records
               if r is not last and r.instance == last.instance and start < r.arrival_s < last.end_s)


def decode_load(records: Sequence[RequestRecord]) -> dict[str, dict[str, float]]:
    """Per request (id -> figures) over its decode, from its first token to its end, on its instance:
    `streams`, the other requests decoding there (time-weighted mean); `context`, their context in
    tokens (prompt + half their output: the mean over a stream's life); `prefill_tok_s`, uncached
    prompt tokens of requests whose first token came there meanwhile, per second (each such prefill
    ran in steps this request shared). Requests without a first token or an end are left out."""
    by_inst: dict[str | None, list[tuple[float, float, RequestRecord]]] = {}
    for r in records:
        if r.ttft_s is None or r.end_s is None:
            continue
        by_inst.setdefault(r.instance, []).append((r.arrival_s + r.ttft_s, r.end_s, r))
    out: dict[str, dict[str, float]] = {}
    for rows in by_inst.values():
        for s0, e0, r in rows:
            dur = e0 - s0
            streams = context = prefill = 0.0
            for s1, e1, q in rows:
                if q is r:
                    continue
                if s0 < s1 <= e0:
                    prefill += q.prompt_tokens - q.cached_tokens
                ov = min(e0, e1) - max(s0, s1)
                if ov > 0 and dur > 0:
                    streams += ov / dur
                    context += ov / dur * (q.prompt_tokens + q.output_tokens / 2)
            out[r.request_id] = {"streams": streams, "context": context,
                                 "prefill_tok_s": prefill / dur if dur > 0 else 0.0}
    return out


def decode_line(name: str, seed: int, pol: str, st: dict, recs: Sequence[RequestRecord], slos: Any,
                load: dict[str, dict[str, float]]) -> str:
    """One line of `--decode`'s table for one run (`st`: its `summarize_all`; `load`: its `decode_load`)."""
    import numpy as np

    last = max(recs, key=lambda r: r.end_s or 0.0)
    tpots = [r.tpot_s for r in recs if r.status == "completed" and r.tpot_s is not None]
    mean = {k: float(np.mean([v[k] for v in load.values()])) for k in ("streams", "context", "prefill_tok_s")}
    lv = load.get(last.request_id, {"streams": 0.0, "context": 0.0, "prefill_tok_s": 0.0})
    drain = (last.end_s or 0.0) - max(r.arrival_s for r in recs)
    # Without the last request (its tokens and its end): the span runs to the next end.
    rest = sorted((r.end_s for r in recs if r.end_s is not None), reverse=True)
    span2 = rest[1] - min(r.arrival_s for r in recs) if len(rest) > 1 else st["span_s"]
    good = st["goodput_tok_s"] * st["span_s"] - (last.output_tokens if slo_met(last, slos) else 0)
    return (f"| {name} | {seed} | {pol} | {1e3 * float(np.percentile(tpots, 50)):.2f} / {1e3 * float(np.mean(tpots)):.2f} "
            f"| {mean['streams']:.2f} | {mean['context'] / 1e3:.1f} | {mean['prefill_tok_s']:.0f} "
            f"| {last.request_id} {lv['streams']:.2f} / {lv['context'] / 1e3:.1f} / {lv['prefill_tok_s']:.0f} "
            f"| {drain:.2f} | {st['goodput_tok_s']:.0f} | {good / span2:.0f} |")


def tail_lines(name: str, seed: int, pol: str, recs: Sequence[RequestRecord], n: int,
               load: dict[str, dict[str, float]]) -> list[str]:
    """`--tail`'s lines: the `n` requests of one run that end last, latest first (`load`: its `decode_load`)."""
    z = {"streams": 0.0, "context": 0.0, "prefill_tok_s": 0.0}
    out = []
    for r in sorted((r for r in recs if r.end_s is not None), key=lambda r: -(r.end_s or 0.0))[:n]:
        v = load.get(r.request_id, z)
        out.append(f"| {name} | {seed} | {pol} | {r.request_id} | {r.end_s:.2f} | {r.arrival_s:.2f} "
                   f"| {1e3 * (r.ttft_s or 0):.0f} | {r.output_tokens} | {1e3 * (r.tpot_s or 0):.2f} | {r.instance} "
                   f"| {r.cached_tokens} / {r.prompt_tokens} | {v['streams']:.2f} | {v['context'] / 1e3:.1f} "
                   f"| {v['prefill_tok_s']:.0f} |")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from workloads import head, load_trace, scale_rate

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("gen_dir")
    p.add_argument("--rows", required=True)
    p.add_argument("--seeds", default="0")
    p.add_argument("--max", type=int, default=2000)
    p.add_argument("--fleet", default=str(DEFAULT_SIM_FLEET))
    p.add_argument("--decode", action="store_true", help="also the table of how crowded decodes were")
    p.add_argument("--tail", type=int, default=0, help="also the N requests that end last, per run")
    a = p.parse_args(argv)
    fleet = load_fleet_file(Path(a.fleet))
    slos = fleet.admission.slos()
    want = set(a.rows.split())
    seeds = [int(x) for x in a.seeds.split(",")]
    print("| row | seed | TokenPilot goodput | best peer | its goodput | goodput ratio | good tokens ratio "
          "| span s TP / peer | last to end (out tokens) | its TPOT ms TP / peer "
          "| uncached tokens prefilled beside it TP / peer |")
    print("|---|---:|---:|---|---:|---:|---:|---|---|---|---|")
    decode: list[str] = []
    tails: list[str] = []
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
            for pol in ("tokenpilot", peer) if a.decode or a.tail else ():
                load = decode_load(runs[pol][1])  # (once per run, for both tables)
                if a.decode:
                    decode.append(decode_line(name, seed, pol, runs[pol][0], runs[pol][1], slos, load))
                if a.tail:
                    tails += tail_lines(name, seed, pol, runs[pol][1], a.tail, load)
    if a.decode:
        print("\n| row | seed | policy | TPOT p50 / mean ms | streams beside | their context k tok "
              "| prefill tok/s beside | last to end: streams / context k / prefill tok/s | drain s "
              "| goodput | goodput without the last request |")
        print("|---|---:|---|---|---:|---:|---:|---|---:|---:|---:|")
        print("\n".join(decode))
    if a.tail:
        print("\n| row | seed | policy | request | end s | arrival s | TTFT ms | out tokens | TPOT ms | instance "
              "| cached / prompt | streams beside | their context k tok | prefill tok/s beside |")
        print("|---|---:|---|---|---:|---:|---:|---:|---:|---|---|---:|---:|---:|")
        print("\n".join(tails))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
