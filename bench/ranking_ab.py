"""TokenPilot ranking by its physics cost vs by its learned latency model, on the routing table's rows.

    .venv/bin/python bench/ranking_ab.py GEN_DIR [--rows "azure-conv-60 chat-80"] [--max 2000]
    .venv/bin/python bench/ranking_ab.py GEN_DIR --set locality_weight=2 [--set ...]   # any config change

The rows (trace, rate scale) are read from bench/routing_tables.sh, so both benchmarks run
the same loads; GEN_DIR holds the generators' chat.jsonl and agent.jsonl that script writes
(the same bytes every time). For each row TokenPilot runs twice on the same prepared
requests, `learned_cost` off (the default) and on, and one line per run gives goodput, SLO
attainment and TTFT percentiles, then the ratio on/off. The learned model ranks only where it
is fitted: until its first fit both runs decide alike. With `--set FIELD=VALUE` (a
`TokenPilotConfig` field, repeatable) the second run has those fields changed instead, so any
change of TokenPilot's knobs is A/B'd over every row the same way (`--rows rr75` keeps the rows
whose name contains "rr75", the issue's load point). `--seed N` seeds every router of the run
(TokenPilot's 1% exploration, the peers' random tie breaks), so a change is judged over several
draws; `--peers` also runs the peers (default: the issue's five) on the same requests and seed and
gives each TokenPilot run's goodput over the best of them.
"""

from __future__ import annotations

import argparse
import ast
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable from a checkout without installing

from fleetcore.fleet_config import load_fleet_file  # noqa: E402
from fleetsim.cli import DEFAULT_SIM_FLEET, make_policy  # noqa: E402
from fleetsim.metrics import summarize_all  # noqa: E402
from fleetsim.simulator import FleetSimulator, HashCache, prepare  # noqa: E402
from tokenpilot.router import TokenPilot, TokenPilotConfig  # noqa: E402


PEERS = ("sglang_cache_aware", "dynamo_kv", "llm_d", "aibrix_prefix", "least_loaded")  # issue 19's targets


def table_rows(gen_dir: str, traces: str = "traces") -> list[tuple[str, str, float, int | None]]:
    """(name, trace path, rate scale, max requests) of every `run` line of routing_tables.sh."""
    out = []
    for line in (REPO / "bench" / "routing_tables.sh").read_text().splitlines():
        if not re.match(r"run [a-z]", line):
            continue
        w = shlex.split(line.replace("$TRACES", traces).replace("$OUT", gen_dir))
        out.append((w[1], w[2], float(w[3]), int(w[4]) if len(w) > 4 else None))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from workloads import head, load_trace, scale_rate

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("gen_dir")
    p.add_argument("--rows", default="")
    p.add_argument("--max", type=int, default=2000)
    p.add_argument("--fleet", default=str(DEFAULT_SIM_FLEET))
    p.add_argument("--seed", type=int, default=0, help="every router's seed")
    p.add_argument("--peers", nargs="?", const=",".join(PEERS), default="",
                   help="also run these peers (comma list; default the issue's five) and give goodput / best peer")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="compare the default with these TokenPilotConfig fields changed (default: learned_cost=True)")
    a = p.parse_args(argv)
    pairs = (c.split("=", 1) for c in a.set)
    changes = {k: type(getattr(TokenPilotConfig(), k))(ast.literal_eval(v)) for k, v in pairs} or {"learned_cost": True}
    label = ",".join(f"{k}={v}" for k, v in changes.items()) if a.set else "learned"
    fleet = load_fleet_file(Path(a.fleet))
    slos = fleet.admission.slos()
    want = set(a.rows.split())
    sub = "rr75" in want and {"rr75"}
    if sub:
        want.discard("rr75")
    peers = [x for x in a.peers.split(",") if x]
    vs = " | best peer | goodput / best peer" if peers else ""
    print(f"| row | ranking | goodput tok/s | SLO % | TTFT p50 ms | TTFT p95 ms | span s | goodput on/off{vs} |")
    print("|---|---|---:|---:|---:|---:|---:|---:" + ("|---|---:" if peers else "") + "|")
    for name, trace, scale, _ in table_rows(a.gen_dir, str(REPO / "traces")):
        if (want or sub) and name not in want and not (sub and "rr75" in name):
            continue
        inputs = prepare(scale_rate(head(load_trace(trace), a.max), scale).requests, fleet, hash_cache=HashCache())
        best = None
        for peer in peers:
            g = summarize_all(FleetSimulator(fleet, make_policy(peer, a.seed, fleet)).run(inputs).records,
                              slos)["goodput_tok_s"]
            if best is None or g > best[1]:
                best = (peer, g)
        got = []
        for learned in (False, True):
            router = make_policy("tokenpilot", a.seed, fleet)
            assert isinstance(router, TokenPilot)
            if learned:
                router.config = replace(router.config, **changes)
            s = summarize_all(FleetSimulator(fleet, router).run(inputs).records, slos)
            got.append(s)
            ratio = f"{s['goodput_tok_s'] / got[0]['goodput_tok_s']:.3f}x" if learned else ""
            vs = f" | {best[0]} {best[1]:.0f} | {s['goodput_tok_s'] / best[1]:.4f}x" if best else ""
            print(f"| {name} | {label if learned else 'default'} | {s['goodput_tok_s']:.0f} "
                  f"| {100 * s['slo_attainment']:.1f} | {s['ttft_ms']['p50']:.0f} | {s['ttft_ms']['p95']:.0f} "
                  f"| {s['span_s']:.2f} | {ratio}{vs} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
