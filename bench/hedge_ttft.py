"""Does hedged prefill pay? Interactive TTFT with and without `gateway.hedge`, one straggler.

Two simulated H100 engines at real speed behind the in-process gateway; one of them is a
straggler: SIGSTOPped for `--pause-s` every `--period-s` (a GC pause, a noisy neighbour, a
hiccuping host). `--requests` short interactive chat streams arrive every `--gap-s`. Run once
with hedging off and once on (the same arrivals, fresh engines each); report TTFT P50/P90/P99,
the hedges sent and the extra prefill they cost (prompt tokens sent twice / all prompt tokens).

    python bench/hedge_ttft.py --requests 60 --gap-s 0.1 --pause-s 0.4 --period-s 1.5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import time
from typing import Any

import httpx

from engine_adapters.sim.launcher import SimAdapter
from fleetcore.fleet_config import FleetConfig
from gateway.embedded import ServedFleet, serve_fleet

MODEL = "llama-3.1-8b"
KEY = "sk-bench"


def config(hedge: bool) -> FleetConfig:
    return FleetConfig.model_validate({
        "sites": [{"name": "east", "region": "us-east", "jurisdiction": "us"}],
        "models": [{"name": MODEL, "engine": {"spec": "llama-3.1-8b", "max_model_len": 8192, "block_size": 16}}],
        "deployments": [{"site": "east", "model": MODEL, "instances": 2, "gpu": "H100", "adapter": "sim",
                         "options": {"time_scale": 1.0}}],
        "tenants": [{"name": "bench", "api_keys": [KEY]}],
        "gateway": {"hedge": {"enabled": hedge, "min_delay_s": 0.1, "delay_factor": 3.0}},
    })


async def straggle(pid: int, pause_s: float, period_s: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), period_s - pause_s)
        except asyncio.TimeoutError:
            pass
        if stop.is_set():
            break
        os.kill(pid, signal.SIGSTOP)
        await asyncio.sleep(pause_s)
        os.kill(pid, signal.SIGCONT)


async def one(served: ServedFleet, n: int) -> float | None:
    body = {"model": MODEL, "max_tokens": 16, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": f"question {n}: " + "context words " * 100}]}
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=served.url, headers={"Authorization": f"Bearer {KEY}"},
                                 timeout=60) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return None
        async for line in r.aiter_lines():
            if line.startswith("data: {") and any((ch.get("delta") or {}).get("content")
                                                   for ch in json.loads(line[6:]).get("choices") or ()):
                return time.monotonic() - t0
    return None


def metric(served: ServedFleet, name: str, **labels: str) -> float:
    text = served.app.state.tokenfleet.metrics.render(per_tenant=True).decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()))


async def run(hedge: bool, a: argparse.Namespace) -> dict[str, Any]:
    async with serve_fleet(config(hedge), poll_interval_s=0.1) as served:
        state = served.app.state.tokenfleet.state
        while sum(st.up for st in state.states()) < 2:
            await asyncio.sleep(0.05)
        (adapter,) = served.adapters
        assert isinstance(adapter, SimAdapter)
        proc = adapter.process(adapter.instances[0])
        assert proc is not None
        stop = asyncio.Event()
        pauser = asyncio.create_task(straggle(proc.pid, a.pause_s, a.period_s, stop))
        tasks = []
        for n in range(a.requests):
            tasks.append(asyncio.create_task(one(served, n)))
            await asyncio.sleep(a.gap_s)
        ttfts = await asyncio.gather(*tasks)
        stop.set()
        await pauser
        os.kill(proc.pid, signal.SIGCONT)
        ok = sorted(t for t in ttfts if t is not None)
        q = statistics.quantiles(ok, n=100)
        return {"hedge": hedge, "ok": len(ok), "p50": q[49], "p90": q[89], "p99": q[98],
                "hedges": metric(served, "tokenfleet_hedges_total", outcome="sent"),
                "second_won": metric(served, "tokenfleet_hedges_total", outcome="second_won"),
                "extra_prefill": metric(served, "tokenfleet_hedge_prefill_tokens_total"),
                "prompt": metric(served, "tokenfleet_prompt_tokens_total")}


async def main(a: argparse.Namespace) -> None:
    rows = [await run(False, a), await run(True, a)]
    base = rows[0]
    print(f"{a.requests} requests every {a.gap_s} s; straggler paused {a.pause_s} s every {a.period_s} s")
    print("| hedge | ok | TTFT p50 s | p90 s | p99 s | p99 / off | hedges sent | kept the hedge | extra prefill |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        extra = r["extra_prefill"] / r["prompt"] if r["prompt"] else 0.0
        print(f"| {'on' if r['hedge'] else 'off'} | {r['ok']} | {r['p50']:.3f} | {r['p90']:.3f} | {r['p99']:.3f} "
              f"| {r['p99'] / base['p99']:.2f} | {r['hedges']:.0f} | {r['second_won']:.0f} | {100 * extra:.1f}% |")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--gap-s", type=float, default=0.1)
    p.add_argument("--pause-s", type=float, default=0.4)
    p.add_argument("--period-s", type=float, default=1.5)
    asyncio.run(main(p.parse_args()))
