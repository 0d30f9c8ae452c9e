"""What FleetMind's spill test means on TokenPilot's TTFT: SLO misses by the decision's TTFT / SLO.

    .venv/bin/python bench/spill_calibration.py TRACE [--fleet FILE] [--rate-scale X] [--max-requests N]
        [--ttft-tail F]

Runs TokenPilot under FleetMind in the simulator (`bench/latency_recorder.py`) and bins the routed
requests by the TTFT their router predicted (`TokenPilot.route`'s `predicted_ttft_s`, the one the
site was chosen by since i19-unify; the decision reports it plus the round trip since i19-rtt) over
their class's TTFT SLO; per bin: how many, the share served at
the fleet's first site (home, for untagged traces), the share that missed the TTFT SLO (from
arrival, the client's), the TPOT SLO, either, and the median observed / predicted TTFT (engine time:
after dispatch and the network round trip). `--ttft-tail`: FleetMind's `ttft_tail` for the run
(default: its own, `fleetmind.site_choice.TTFT_TAIL`); 1 shows what the TTFT alone says.
The derivation of `TTFT_TAIL` reads this table (bench/ROUTING.md "i19-unify").
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without installing

import numpy as np  # noqa: E402

from bench.latency_recorder import arguments, run_recorded  # noqa: E402

EDGES = (0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.2, 1.5, 2.0, float("inf"))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    tail = None
    if "--ttft-tail" in argv:
        i = argv.index("--ttft-tail")
        tail = float(argv[i + 1])
        del argv[i:i + 2]
    if tail is not None:  # FleetMind built by `fleetsim.cli.make_placement`, with this factor
        import fleetsim.cli as cli
        from fleetmind.site_choice import FleetMind, FleetMindConfig

        def placement(name, fleet, router):  # type: ignore[no-untyped-def]
            return FleetMind.from_fleet(fleet, router,
                                        config=FleetMindConfig(never_spill=name == "home", ttft_tail=tail))
        cli.make_placement = placement
    from fleetcore.slo import class_by_length

    a = arguments(__doc__, argv)
    router = run_recorded(a)
    slos = router.fleet.admission.slos()
    home = router.fleet.sites[0].name
    rows = []
    for x in router.rows:
        o = x.outcome
        if not (o.ok and o.ttft_s):
            continue
        c = slos[class_by_length(o.prompt_tokens)]
        if c.ttft_s is None:
            continue
        tpot_miss = (o.mean_tpot_s is not None and o.output_tokens > 1 and c.tpot_s is not None
                     and o.mean_tpot_s > c.tpot_s)
        engine = o.ttft_s - x.held - getattr(o, "network_s", 0.0)
        predicted = x.detail["decision_ttft_s"]
        rows.append((predicted / c.ttft_s, o.ttft_s / c.ttft_s, float(tpot_miss), float(o.site == home),
                     engine / predicted))
    r = np.array(rows)
    s = router.summary
    print(f"goodput {s['goodput_tok_s']:.0f} tok/s, SLO {100 * (s['slo_attainment'] or 0):.1f}%, {len(r)} requests")
    print("| predicted TTFT / SLO | requests | at home | TTFT missed | TPOT missed | either | median observed / predicted |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for lo, hi in zip(EDGES, EDGES[1:]):
        b = r[(r[:, 0] >= lo) & (r[:, 0] < hi)]
        if len(b):
            print(f"| [{lo:g}, {hi:g}) | {len(b)} | {b[:, 3].mean():.2f} | {np.mean(b[:, 1] > 1):.2f} "
                  f"| {b[:, 2].mean():.2f} | {np.mean((b[:, 1] > 1) | (b[:, 2] > 0)):.2f} | {np.median(b[:, 4]):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
