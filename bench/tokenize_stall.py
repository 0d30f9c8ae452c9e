"""Event-loop stalls from a burst of long prompts: 16 prompts of 32k tokens sent at once.

    .venv/bin/python bench/tokenize_stall.py [--bursts 3] [--workers N] [--switch-interval S]

The gateway (`gateway.embedded.serve_fleet`, FCFS, one sim worker at time_scale 0.01, the
built-in tokenizer) runs in this process; each burst comes from a client in a separate
process (the fleet and client of `tests/test_tokenize_stall.py`). A `LoopMonitor` ticking every
5 ms during the burst gives the longest lag and its busy part (lag less the time the process
was off every CPU: the stall the gateway's own work caused, GIL held by a tokenizer thread
included). `--workers` overrides `gateway.tokenize_workers`, `--switch-interval` the
`gateway.app.SWITCH_INTERVAL_S` the gateway sets while serving.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


async def run(args: argparse.Namespace) -> None:
    import gateway.app
    import tests.test_tokenize_stall as t
    from fleetcore.fleet_config import parse_fleet
    from gateway.embedded import serve_fleet

    if args.switch_interval is not None:
        gateway.app.SWITCH_INTERVAL_S = args.switch_interval
    fleet = dict(t.FLEET)
    if args.workers is not None:
        fleet["gateway"] = {"tokenize_workers": args.workers}
    config = parse_fleet(fleet)
    prompts = [t._prompt(k) for k in range(args.bursts * t.BURST)]
    async with serve_fleet(config, poll_interval_s=0.2) as f:
        for k in range(args.bursts):
            t0 = time.monotonic()
            m = await t._burst(f.url, prompts[k * t.BURST:(k + 1) * t.BURST])
            print(f"burst {k}: busy max {m.max_busy_lag_s * 1e3:6.1f} ms   lag max {m.max_lag_s * 1e3:6.1f} ms   "
                  f"wall {time.monotonic() - t0:5.2f} s   (workers {config.gateway.tokenize_workers}, switch "
                  f"interval {gateway.app.SWITCH_INTERVAL_S * 1e3:g} ms)", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description="Event-loop stalls from a burst of 16 prompts of 32k tokens.")
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--workers", type=int, help="gateway.tokenize_workers (default: the fleet file's default)")
    p.add_argument("--switch-interval", type=float, help="seconds (default: gateway.app.SWITCH_INTERVAL_S)")
    args = p.parse_args()
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
