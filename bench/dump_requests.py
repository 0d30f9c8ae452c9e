"""Run `tokenfleet simulate` and write every request's outcome as JSON lines: what the
per-request figures of bench/ROUTING.md ("Interactive lanes") were counted from.

    python bench/dump_requests.py OUT.jsonl --trace traces/conversation_trace.jsonl.gz \
        --policy tokenpilot --rate-scale 3.46 --max-requests 2000 --gateways 4 --sync-ms 100 --seed 0

One policy per run (the file holds the last one run). Each line: id, arrival `t`, prompt
tokens `p`, class `c`, `ttft` and `tpot` (s), `inst`, `ok` (met its SLO), `cached`, `out`
(output tokens) and `rep` (the replica that routed it, with --gateways; else null).
Decisions are the command's own: the wrapper only reads the records and notes which replica
each request went to.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

import fleetsim.cli as cli
from fleetsim.metrics import slo_met
from fleetsim.replicas import ReplicatedRouter


def main(argv: Sequence[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    out, rest = argv[0], list(argv[1:])
    owners: dict[str, int] = {}
    run, replica = cli.FleetSimulator.run, ReplicatedRouter._replica

    def noted(self: ReplicatedRouter, request_id: str) -> int:
        k = replica(self, request_id)
        owners[request_id] = k
        return k

    def dumped(self: Any, inputs: Any) -> Any:
        res = run(self, inputs)
        slos = self.fleet.admission.slos() if hasattr(self, "fleet") else \
            cli.load_fleet_file(cli.DEFAULT_SIM_FLEET).admission.slos()
        with open(out, "w") as f:
            for r in res.records:
                f.write(json.dumps({"id": r.request_id, "t": r.arrival_s, "p": r.prompt_tokens, "c": r.klass,
                                    "ttft": r.ttft_s, "tpot": r.tpot_s, "inst": r.instance,
                                    "ok": slo_met(r, slos), "cached": r.cached_tokens, "out": r.output_tokens,
                                    "rep": owners.get(r.request_id)}) + "\n")
        return res

    cli.FleetSimulator.run = dumped  # type: ignore[method-assign]
    ReplicatedRouter._replica = noted  # type: ignore[method-assign]
    from tokenfleet.cli import main as tokenfleet_main
    return tokenfleet_main(["simulate", *rest])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
