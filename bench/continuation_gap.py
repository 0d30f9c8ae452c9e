"""Time a stream loses when its engine dies or stalls mid-stream and the gateway continues it.

The gateway runs in-process (`gateway.embedded.serve_fleet`) over real simulated workers on
loopback. Each repetition streams one chat answer of `--tokens` tokens; at token `--at` the
serving engine is SIGKILLed (`kill`) or SIGSTOPped (`stop`), or nothing happens (`baseline`).
For each case it reports, from the client's side: end-to-end time, the longest gap between two
tokens (the failure: detection + choice + re-prefill), and the time lost against the baseline
measured in the same run (ratio too, since timings here are noisy). The gateway's own
`tokenfleet_continuation_gap_seconds` (last token before the failure to the continuation's
first token) is reported next to it.

    python bench/continuation_gap.py --reps 5 --tokens 400 --at 50 --idle-s 1.0
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


def config(idle_s: float) -> FleetConfig:
    return FleetConfig.model_validate({
        "regions": ["us-east"], "default_region": "us-east",
        "sites": [{"name": "east", "region": "us-east", "jurisdiction": "us", "rtt_ms": {"us-east": 1}}],
        "models": [{"name": MODEL, "versions": ["v1"],
                    "engine": {"spec": "llama-3.1-8b", "max_model_len": 8192, "block_size": 16}}],
        "deployments": [{"site": "east", "model": MODEL, "instances": 3, "gpu": "H100", "adapter": "sim",
                         "options": {"time_scale": 1.0}}],
        "tenants": [{"name": "bench", "api_keys": [KEY], "region": "us-east"}],
        "gateway": {"stream_idle_timeout_s": idle_s, "first_byte_timeout_floor_s": 5.0},
    })


def pid_of(served: ServedFleet, iid: str) -> int:
    for a in served.adapters:
        for i in a.instances:
            if i.instance_id == iid and isinstance(a, SimAdapter):
                proc = a.process(i)
                assert proc is not None
                return proc.pid
    raise KeyError(iid)


async def all_ready(served: ServedFleet, n: int, timeout_s: float = 60) -> None:
    state = served.app.state.tokenfleet.state
    deadline = time.monotonic() + timeout_s
    while sum(1 for st in state.states() if st.up) < n:
        if time.monotonic() > deadline:
            raise TimeoutError("engines did not come back")
        await asyncio.sleep(0.05)


async def one(served: ServedFleet, case: str, tokens: int, at: int, rep: int) -> dict[str, Any]:
    body = {"model": MODEL, "max_tokens": tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"repetition {rep} of the {case} case"}]}
    times: list[float] = []
    usage: dict[str, Any] | None = None
    errors = 0
    stopped: int | None = None
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=served.url, headers={"Authorization": f"Bearer {KEY}"},
                                 timeout=120) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        iid = r.headers["x-tokenfleet-instance"]
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                errors += 1
            if ev.get("usage"):
                usage = ev["usage"]
            if any((ch.get("delta") or {}).get("content") for ch in ev.get("choices") or ()):
                times.append(time.monotonic())
                if len(times) == at and case != "baseline":
                    pid = pid_of(served, iid)
                    os.kill(pid, signal.SIGKILL if case == "kill" else signal.SIGSTOP)
                    stopped = pid if case == "stop" else None
    if stopped is not None:
        os.kill(stopped, signal.SIGCONT)
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"e2e": times[-1] - t0 if times else float("nan"), "max_gap": max(gaps) if gaps else 0.0,
            "median_gap": statistics.median(gaps) if gaps else 0.0, "tokens": len(times), "errors": errors,
            "completion_tokens": (usage or {}).get("completion_tokens"),
            "reprefill": (usage or {}).get("tokenfleet_reprefill_tokens", 0)}


def gateway_gap(served: ServedFleet) -> dict[str, tuple[float, float]]:
    """reason -> (count, sum) of tokenfleet_continuation_gap_seconds."""
    text = served.app.state.tokenfleet.metrics.render(per_tenant=True).decode()
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        for kind in ("_count", "_sum"):
            if line.startswith("tokenfleet_continuation_gap_seconds" + kind + "{"):
                reason = line.split('reason="', 1)[1].split('"', 1)[0]
                out.setdefault(reason, [0.0, 0.0])[0 if kind == "_count" else 1] = float(line.rsplit(" ", 1)[1])
    return {k: (v[0], v[1]) for k, v in out.items()}


async def main(args: argparse.Namespace) -> None:
    async with serve_fleet(config(args.idle_s), poll_interval_s=0.1) as served:
        await all_ready(served, 3)
        results: dict[str, list[dict[str, Any]]] = {"baseline": [], "kill": [], "stop": []}
        for rep in range(args.reps):
            for case in results:
                await all_ready(served, 3)
                results[case].append(await one(served, case, args.tokens, args.at, rep))
        base = statistics.median(r["e2e"] for r in results["baseline"])
        print(f"{args.reps} reps, {args.tokens} tokens, failure at token {args.at}, "
              f"stream_idle_timeout_s {args.idle_s}")
        print("| case | tokens received | error events | e2e median s | e2e / baseline | lost vs baseline s "
              "| longest gap median s | median inter-token s | re-prefilled tokens median |")
        print("|---|---|---|---|---|---|---|---|---|")
        for case, rs in results.items():
            e2e = statistics.median(r["e2e"] for r in rs)
            print(f"| {case} | {sorted({r['tokens'] for r in rs})} | {sum(r['errors'] for r in rs)} | {e2e:.3f} "
                  f"| {e2e / base:.2f} | {e2e - base:.3f} | {statistics.median(r['max_gap'] for r in rs):.3f} "
                  f"| {statistics.median(r['median_gap'] for r in rs):.4f} "
                  f"| {statistics.median(r['reprefill'] for r in rs):.0f} |")
        for reason, (n, total) in sorted(gateway_gap(served).items()):
            print(f"gateway tokenfleet_continuation_gap_seconds{{reason={reason}}}: "
                  f"{n:.0f} continuations, mean {total / max(n, 1):.3f} s")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--at", type=int, default=50, help="the token at which the engine fails")
    p.add_argument("--idle-s", type=float, default=1.0, help="gateway.stream_idle_timeout_s")
    asyncio.run(main(p.parse_args()))
