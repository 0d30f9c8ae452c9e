"""Tokenization off the loop (issue 14): a burst of 16 prompts of 32k tokens each does not stall
the gateway's event loop for more than 20 ms.

The gateway runs in this process (over a launched sim worker); the burst comes from a client
in a separate process, so the only work on this event loop is the gateway's. A loop monitor
of our own, started just before the burst, measures it: its busy lag (`LoopMonitor`: the lag
less the time the whole process was off a CPU) is what the gateway's own work held the loop,
tokenizer threads holding the GIL included; the machine starving us does not count.
"""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from typing import Any

import yaml

from fleetcore.fleet_config import parse_fleet
from fleetcore.tokens import count_tokens
from gateway.embedded import serve_fleet
from gateway.loop_monitor import LoopMonitor

KEY = "sk-test-acme"
BURST = 16
PROMPT_TOKENS = 32_000
STALL_BOUND_S = 0.020

FLEET: dict[str, Any] = yaml.safe_load(f"""
sites:
  - {{name: east, region: us-east, jurisdiction: us}}
models:
  - name: llama-3.1-8b
    versions: ["v1"]
    engine: {{spec: llama-3.1-8b, max_model_len: 65536, block_size: 16}}
deployments:
  - {{site: east, model: llama-3.1-8b, instances: 1, gpu: H100, adapter: sim, options: {{time_scale: 0.01}}}}
admission: {{policy: fcfs}}
tenants:
  - {{name: acme, api_keys: [{KEY}]}}
""")

CLIENT = textwrap.dedent("""
    import asyncio, json, sys
    import httpx

    async def main(url, bodies):
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as c:
            rs = await asyncio.gather(*(c.post(url, content=b, headers={"Authorization": "Bearer %s",
                                                                        "Content-Type": "application/json"})
                                        for b in bodies))
        print(json.dumps([[r.status_code, r.json().get("usage", {}).get("prompt_tokens")] for r in rs]))

    url = sys.argv[1]
    prompts = json.loads(sys.stdin.read())
    bodies = [json.dumps({"model": "llama-3.1-8b", "max_tokens": 1,
                          "messages": [{"role": "user", "content": p}]}).encode() for p in prompts]
    asyncio.run(main(url, bodies))
""") % KEY


def _prompt(k: int) -> str:
    # distinct prompts (no shared prefix), each ~32k tokens of the built-in tokenizer
    words = [f"w{k}x{i % 977}" for i in range(PROMPT_TOKENS // 2)]
    return " ".join(words)


async def _burst(url: str, prompts: list[str]) -> LoopMonitor:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT, f"{url}/v1/chat/completions",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    monitor = LoopMonitor(0.005)
    monitor.start()
    try:
        out, err = await asyncio.wait_for(proc.communicate(json.dumps(prompts).encode()), 120)
    finally:
        monitor.stop()
    assert proc.returncode == 0, err.decode()
    results = json.loads(out)
    assert [s for s, _ in results] == [200] * BURST
    assert all(t >= PROMPT_TOKENS for _, t in results)  # the engine saw the whole prompts
    assert monitor.ticks > 10
    return monitor


async def test_a_burst_of_16_prompts_of_32k_tokens_stalls_the_loop_under_20_ms() -> None:
    """Three bursts (other prompts each time, so no cache helps); the best must stay under the
    bound. Why several: "busy" counts the loop's lag whenever any thread of this process ran
    meanwhile, so on a crowded machine the OS descheduling the loop thread while the tokenizer
    thread runs reads as a stall of ours; a stall the gateway causes shows in every burst (the
    code before issue 14 held the loop 50-56 ms in each)."""
    prompts = [_prompt(k) for k in range(3 * BURST)]
    assert count_tokens(prompts[0]) >= PROMPT_TOKENS
    async with serve_fleet(parse_fleet(FLEET), poll_interval_s=0.2) as f:
        lags = []
        for k in range(3):
            m = await _burst(f.url, prompts[k * BURST:(k + 1) * BURST])
            lags.append((m.max_busy_lag_s, m.max_lag_s))
    assert min(busy for busy, _ in lags) < STALL_BOUND_S, lags
