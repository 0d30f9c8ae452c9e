"""TokenPilot's TTFT predictions live: the real gateway over simulated worker processes (real HTTP, real time).

    .venv/bin/python bench/latency_live.py [--requests 1200] [--rate 40] [--models prior,learned]

Fleet: bench/fleet_noisy_live.yaml (2 x Llama-3.1-70B on 2 x H200, workers 4x faster than
real time, which the routers' physics prior does not know: it starts 4x off). Streams
`--requests` completions with prompt and output lengths from the Azure conversation trace
(fresh text each: nothing cached), `--rate` per second, open loop; per request it compares
the gateway's `x-tokenfleet-predicted-ttft-ms` with the TTFT the client measured (wall).
`prior`: TokenPilot with its learned latency model never fitted (the physics prior with its
online factors: this branch's cost model); `learned`: as shipped (the gateway's background
task fits it once enough outcomes are in). Errors are reported over the second half of each
run, once the models have data. One fresh fleet per model. The gateway's own TTFT (from its
arrival, as its router observes it) is compared too: the gap to the client's is this process's
event loop (client and gateway share it) and the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable from a checkout without installing
sys.path.insert(0, str(REPO / "bench"))

import numpy as np  # noqa: E402

from fleetcore.fleet_config import load_fleet_file  # noqa: E402
from fleetcore.types import RequestOutcome  # noqa: E402
from workloads import head, load_trace  # noqa: E402
from workloads.prompts import prompt_text  # noqa: E402
from noisy_live import all_ready, read_stream  # noqa: E402

FLEET = REPO / "bench" / "fleet_noisy_live.yaml"
TRACE = REPO / "traces" / "AzureLLMInferenceTrace_conv.csv"
MODEL, KEY = "llama-3.1-70b", "sk-live-chat"


async def one(s: aiohttp.ClientSession, url: str, prompt: str, out: int,
              seen: dict[str, float]) -> tuple[float, float, float] | None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": out, "stream": True, "ignore_eos": True}
    t0 = time.monotonic()
    async with s.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
        if r.status != 200:
            await r.read()
            return None
        predicted = r.headers.get("x-tokenfleet-predicted-ttft-ms")
        rid = r.headers.get("x-request-id", "")
        first = (await read_stream(r)).first_token_at
        if first is None or predicted is None:
            return None
        await asyncio.sleep(0)  # the relay's release (the router's outcome) runs after the stream's end
        return float(predicted) / 1000, first - t0, seen.pop(rid, float("nan"))


async def run(model: str, n: int, rate: float) -> list[tuple[float, float, float]]:
    from gateway.embedded import serve_fleet
    from tokenpilot.latency_model import LearnedLatency

    config = load_fleet_file(FLEET)
    rows = head(load_trace(TRACE), n).requests
    async with serve_fleet(config, poll_interval_s=0.2) as f:
        router = f.app.state.tokenfleet.relay.router
        if model == "prior":
            router.latency = LearnedLatency(min_samples=10**9)
        seen: dict[str, float] = {}  # the TTFT the gateway saw (from its arrival), per request id
        observe = router.observe

        def watch(outcome: RequestOutcome) -> None:
            if outcome.ttft_s is not None:
                seen[outcome.request_id] = outcome.ttft_s
            observe(outcome)
        router.observe = watch  # type: ignore[method-assign]
        await all_ready(f.url, sum(d.instance_count for d in config.deployments))
        base = int(time.time() * 1000) % 1_000_000 * 1000
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120),
                                         connector=aiohttp.TCPConnector(limit=0)) as s:
            tasks = []
            for i, r in enumerate(rows):
                tokens = min(r.input_length, 8000)
                tasks.append(asyncio.create_task(one(s, f.url, prompt_text(
                    range(base + 100 * i, base + 100 * i + max(1, tokens // 512)), tokens), max(2, min(r.output_length, 64)), seen)))
                await asyncio.sleep(1 / rate)
            got = await asyncio.gather(*tasks)
    return [g for g in got if g is not None]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1200)
    p.add_argument("--rate", type=float, default=40.0)
    p.add_argument("--models", default="prior,learned")
    p.add_argument("--save", default=None, help="write each model's rows (predicted, client, gateway s) to SAVE.MODEL.npy")
    a = p.parse_args(argv)
    print("| model | requests (second half) | TTFT median err | TTFT P90 err | median predicted ms "
          "| median observed ms | vs gateway's TTFT: median err | P90 err | gateway's median ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for model in a.models.split(","):
        got = np.array(asyncio.run(run(model, a.requests, a.rate)))
        if a.save:
            np.save(f"{a.save}.{model}.npy", got)
        half = got[len(got) // 2:]
        e = 100 * np.abs(half[:, 0] - half[:, 1]) / half[:, 1]
        gw = half[np.isfinite(half[:, 2])]
        g = 100 * np.abs(gw[:, 0] - gw[:, 2]) / gw[:, 2]
        print(f"| {model} | {len(half)} | {np.median(e):.0f}% | {np.percentile(e, 90):.0f}% "
              f"| {1000 * np.median(half[:, 0]):.0f} | {1000 * np.median(half[:, 1]):.0f} "
              f"| {np.median(g):.0f}% | {np.percentile(g, 90):.0f}% | {1000 * np.median(gw[:, 2]):.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
