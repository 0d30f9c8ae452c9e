"""Probe: how long the gateway's event loop stalls around the router's first refit.

    python bench/refit_stall.py [--outcomes 200] [--runs 1]

Each run is a fresh interpreter (scikit-learn not yet imported), doing what the gateway does:
the loop monitor (`gateway.loop_monitor`, 10 ms ticks) runs; start-up calls `RouterRefit.prepare`
(where the code has it) and `RouterRefit.start`, then sets the serving switch interval; TokenPilot
with a learned latency model sees `--outcomes` outcomes, and the first fit runs as the
background task runs it (`RouterRefit.once`: a worker thread). Prints the loop's largest lag
(and its on-CPU part, "busy") during start-up and during the first fit. Works on code without
`prepare` too (a baseline), which then imports scikit-learn inside that first fit.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import asyncio, json, sys, time
assert "sklearn.linear_model" not in sys.modules
from fleetcore.types import InstanceSnapshot, RequestOutcome, RequestProfile
from gateway.app import SWITCH_INTERVAL_S
from gateway.loop_monitor import LoopMonitor
from gateway.router_refit import RouterRefit
from tokenpilot.latency_model import LearnedLatency
from tokenpilot.priors import prior_from_physics
from tokenpilot.router import TokenPilot, TokenPilotConfig

OUTCOMES = int(sys.argv[1])


async def window(monitor, coro):
    # the largest lag and busy lag of ticks that fired while `coro` ran (and one tick after it)
    lag0, busy0 = monitor.max_lag_s, monitor.max_busy_lag_s
    monitor.max_lag_s = monitor.max_busy_lag_s = 0.0
    t = time.perf_counter()
    out = await coro
    took = time.perf_counter() - t
    ticks = monitor.ticks
    while monitor.ticks < ticks + 2:  # a stall ending with `coro` is seen by the next tick
        await asyncio.sleep(monitor.interval_s)
    lag, busy = monitor.max_lag_s, monitor.max_busy_lag_s
    monitor.max_lag_s, monitor.max_busy_lag_s = max(lag0, lag), max(busy0, busy)
    return out, took, lag, busy


async def main():
    monitor = LoopMonitor()
    monitor.start()
    await asyncio.sleep(0.1)
    prior = prior_from_physics("llama-3.1-8b", "H100")
    tp = TokenPilot({"a": prior}, config=TokenPilotConfig(explore=0.0),
                    latency=LearnedLatency(min_samples=64, refit_every=64))
    refit = RouterRefit(tp, interval_s=3600)
    prepare = getattr(refit, "prepare", None)

    async def start_up():
        if prepare is not None:
            await prepare()
        refit.start()
    _, start_s, start_lag, start_busy = await window(monitor, start_up())
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # as the gateway's lifespan, once started
    imported_at_start = "sklearn.linear_model" in sys.modules
    a = InstanceSnapshot(instance_id="a", site="s", model="m", version="v", url="http://a")
    for i in range(OUTCOMES):
        tokens = 200 + 17 * i
        p = RequestProfile(request_id=f"r{i}", model="m", prompt_tokens=tokens, stream=True,
                           block_hashes=tuple(range(i * 1000, i * 1000 + tokens // 16)))
        d = tp.route(p, [a], float(i))
        tp.observe(RequestOutcome(p.request_id, "a", "s", ok=True, prompt_tokens=tokens, output_tokens=1,
                                  ttft_s=0.1 + 3 * d.candidates[0].detail["prior_ttft_s"]))
    await asyncio.sleep(0.1)
    assert tp.refit_due()
    fitted, fit_s, fit_lag, fit_busy = await window(monitor, refit.once())
    await refit.stop()
    monitor.stop()
    print(json.dumps({"imported_at_start": imported_at_start, "start_s": start_s, "start_lag_s": start_lag,
                      "start_busy_s": start_busy, "fitted": fitted, "fit_s": fit_s, "fit_lag_s": fit_lag,
                      "fit_busy_s": fit_busy}))


asyncio.run(main())
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--outcomes", type=int, default=200)
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()
    for k in range(args.runs):
        out = subprocess.run([sys.executable, "-c", CHILD, str(args.outcomes)], capture_output=True, text=True,
                             timeout=300)
        if out.returncode != 0:
            sys.exit(out.stderr[-3000:])
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"run {k + 1}: start-up {r['start_s'] * 1e3:.0f} ms (scikit-learn imported: "
              f"{'yes' if r['imported_at_start'] else 'no'}), loop lag max {r['start_lag_s'] * 1e3:.1f} ms "
              f"(busy {r['start_busy_s'] * 1e3:.1f}); first fit {r['fit_s'] * 1e3:.0f} ms "
              f"(installed: {r['fitted']}), loop lag max {r['fit_lag_s'] * 1e3:.1f} ms (busy {r['fit_busy_s'] * 1e3:.1f})")


if __name__ == "__main__":
    main()
