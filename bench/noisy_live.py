"""Noisy neighbour, live: the real gateway over simulated workers (processes, real HTTP, real time).

    .venv/bin/python bench/noisy_live.py [--admission fcfs,slomax] [--flood 48] [--chats 60]

Fleet: bench/fleet_noisy_live.yaml — 2 x Llama-3.1-70B on 2 x H200 run 4x faster than real
time, class SLOs scaled by the same 0.25 (interactive TTFT 0.25 s wall = 1 s of engine time).
Tenant `flood` fires `--flood` long prompts (10k tokens, fresh text each: all prefill, no
cache) at once: about 5 s of the whole fleet's prefill, 100% of its KV cache. Tenant `chat`
sends `--chats` short streamed chats, one every 0.1 s, from 0.2 s after the flood started.
Reported per admission policy: chat TTFT p50/p95 (wall, from the client), chat SLO
attainment, flood requests completed / rejected. Run on one machine; nothing leaves it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fleetcore.fleet_config import load_fleet_file
from fleetcore.sse import StreamReader
from workloads.prompts import prompt_text

FLEET = REPO / "bench" / "fleet_noisy_live.yaml"
MODEL = "llama-3.1-70b"
CHAT_KEY, FLOOD_KEY = "sk-live-chat", "sk-live-flood"


@dataclass
class Result:
    status: int
    ttft_s: float | None = None
    tpot_s: float | None = None
    code: str | None = None


@dataclass
class Report:
    admission: str
    chat: list[Result] = field(default_factory=list)
    flood: list[Result] = field(default_factory=list)

    def summary(self, slo_ttft_s: float, slo_tpot_s: float, flood_ttft_s: float) -> dict[str, Any]:
        ok = [r for r in self.chat if r.status == 200 and r.ttft_s is not None]
        ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)

        def q(p: float) -> float | None:
            return ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))] if ttfts else None

        met = sum(1 for r in ok if r.ttft_s is not None and r.ttft_s <= slo_ttft_s
                  and (r.tpot_s is None or r.tpot_s <= slo_tpot_s))
        return {
            "admission": self.admission, "chat_requests": len(self.chat), "chat_ok": len(ok),
            "chat_ttft_p50_s": q(0.5), "chat_ttft_p95_s": q(0.95), "chat_slo_attainment": met / len(self.chat),
            "flood_requests": len(self.flood), "flood_ok": sum(1 for r in self.flood if r.status == 200),
            "flood_rejected": sum(1 for r in self.flood if r.status in (429, 503)),
            "flood_ttft_met": sum(1 for r in self.flood if r.ttft_s is not None and r.ttft_s <= flood_ttft_s),
        }


async def read_stream(r: aiohttp.ClientResponse) -> Any:
    """Read an SSE response to its end; its stream stats (first/last token times, tokens)."""
    reader = StreamReader()
    async for data in r.content.iter_any():
        reader.feed(data, time.monotonic())
        if reader.finished:
            break
    else:
        reader.close(time.monotonic())
    return reader.stats


async def stream_one(session: aiohttp.ClientSession, url: str, key: str, prompt: str, max_tokens: int) -> Result:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    t0 = time.monotonic()
    async with session.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status != 200:
            err = (await r.json(content_type=None)).get("error", {})
            return Result(r.status, code=err.get("code"))
        st = await read_stream(r)
        first, last, n = st.first_token_at, st.last_token_at, st.output_tokens()
        ttft = first - t0 if first is not None else None
        tpot = (last - first) / (n - 1) if first is not None and last is not None and n > 1 else None
        return Result(200, ttft, tpot)


async def scenario(url: str, admission: str, flood: int, chats: int) -> Report:
    rep = Report(admission)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
        # Fresh block ids per request and per run: nothing is cached, nothing shared.
        base = int(time.time() * 1000) % 1_000_000 * 1000
        flood_tasks = [asyncio.create_task(stream_one(s, url, FLOOD_KEY, prompt_text(
            range(base + 100 * i, base + 100 * i + 20), 10_000), 16)) for i in range(flood)]
        await asyncio.sleep(0.2)
        chat_tasks = []
        for i in range(chats):
            chat_tasks.append(asyncio.create_task(stream_one(
                s, url, CHAT_KEY, prompt_text([base + 90_000_000 + i], 300), 24)))
            await asyncio.sleep(0.1)
        rep.chat = list(await asyncio.gather(*chat_tasks))
        rep.flood = list(await asyncio.gather(*flood_tasks))
    return rep


async def all_ready(url: str, instances: int, timeout_s: float = 30.0) -> None:
    """Wait until the gateway's health checks have seen every instance ready: the scenario measures
    admission in steady state, not a race with the gateway's first polls (which sized the
    prefill budget for fewer instances and let the flood's queue time out on some runs)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        while True:
            async with s.get(f"{url}/health") as r:
                if (await r.json()).get("ready_instances") == instances:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"not all {instances} instances ready within {timeout_s:g} s")
            await asyncio.sleep(0.05)


async def run(admission: str, flood: int = 48, chats: int = 60, fleet_path: Path = FLEET) -> dict[str, Any]:
    """One fleet (fresh worker processes) and gateway under `admission`; returns the summary."""
    from slomax import from_fleet, make_admission
    from slomax.config import Knobs
    from gateway.embedded import serve_fleet

    config = load_fleet_file(fleet_path)
    # Engines 4x faster than real time: the valve's starting target scaled alike (0.25 s x 0.25).
    policy = make_admission(admission, from_fleet(config, knobs=Knobs(engine_wait_s=0.0625)))
    async with serve_fleet(config, poll_interval_s=0.2, admission=policy) as f:
        await all_ready(f.url, sum(d.instance_count for d in config.deployments))
        rep = await scenario(f.url, admission, flood, chats)
    classes = from_fleet(config).classes
    slo = classes["interactive"].slo
    out = rep.summary(slo.ttft_s or 1.0, slo.tpot_s or 1.0, classes["long_context"].slo.ttft_s or 8.0)
    out["slo_ttft_s"] = slo.ttft_s
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--admission", default="fcfs,slomax")
    p.add_argument("--flood", type=int, default=48)
    p.add_argument("--chats", type=int, default=60)
    a = p.parse_args(argv)
    rows = [asyncio.run(run(name.strip(), a.flood, a.chats)) for name in a.admission.split(",") if name.strip()]
    print(f"{'admission':<10} {'chat p50 ms':>11} {'chat p95 ms':>11} {'chat SLO%':>9} {'flood ok':>8} "
          f"{'flood rej':>9} {'flood in TTFT SLO':>17}")
    for r in rows:
        p50, p95 = r["chat_ttft_p50_s"], r["chat_ttft_p95_s"]
        print(f"{r['admission']:<10} {1e3 * p50 if p50 else float('nan'):>11.0f} {1e3 * p95 if p95 else float('nan'):>11.0f} "
              f"{100 * r['chat_slo_attainment']:>9.1f} {r['flood_ok']:>8} {r['flood_rejected']:>9} "
              f"{r['flood_ttft_met']:>17}")
    print(f"(interactive TTFT SLO {1e3 * rows[0]['slo_ttft_s']:.0f} ms wall = 1 s of engine time at time_scale 0.25)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
