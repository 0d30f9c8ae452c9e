"""Event-loop stalls from a burst of long prompts: 16 prompts of 32k tokens sent at once.

    .venv/bin/python bench/tokenize_stall.py [--bursts 3] [--workers N] [--switch-interval S]
                                             [--no-helper] [--breakdown]

The gateway (`gateway.embedded.serve_fleet`, FCFS, one sim worker at time_scale 0.01, the
built-in tokenizer) runs in this process; each burst comes from a client in a separate
process (the fleet and client of `tests/test_tokenize_stall.py`). A `LoopMonitor` ticking every
5 ms during the burst gives the longest lag and its busy part (lag less the time the process
was off every CPU: the stall the gateway's own work caused, GIL held by a tokenizer thread
included). `--workers` overrides `gateway.tokenize_workers`, `--switch-interval` the
`gateway.app.SWITCH_INTERVAL_S` the gateway sets while serving, `--no-helper` sets
`gateway.tokenize_helper: false` (the built-in tokenizer on the pool's threads).

`--breakdown` says where the worst ticks' time went, from the loop thread's side (Linux): its
own CPU time (`time.thread_time`), its time runnable but not run (`/proc/self/task/<tid>/schedstat`:
the machine's), and the rest, mostly waiting for the GIL another thread of the process held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.loop_monitor import LoopMonitor  # noqa: E402  (after the path: this tree's gateway)

KEY = "sk-test-acme"
BURST = 16
PROMPT_TOKENS = 32_000

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


def prompt(k: int) -> str:
    # distinct prompts (no shared prefix), each ~32k tokens of the built-in tokenizer
    words = [f"w{k}x{i % 977}" for i in range(PROMPT_TOKENS // 2)]
    return " ".join(words)


class BreakdownMonitor(LoopMonitor):
    """A `LoopMonitor` that also keeps, for each tick late by over 5 ms: (lag, the loop thread's
    CPU time, its run-queue wait) over the tick's span (`--breakdown`)."""

    def __init__(self, interval_s: float) -> None:
        super().__init__(interval_s)
        self.late: list[tuple[float, float, float]] = []
        self._path = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        self._at_arm = (0.0, 0.0)

    def _waited_s(self) -> float:
        with open(self._path) as f:
            return int(f.read().split()[1]) / 1e9

    def _arm(self) -> None:
        self._at_arm = (time.thread_time(), self._waited_s())
        super()._arm()

    def _tick(self) -> None:
        lag = self.clock() - self._due
        if lag > 0.005:
            cpu, waited = self._at_arm
            self.late.append((lag, time.thread_time() - cpu, self._waited_s() - waited))
        super()._tick()


async def burst(url: str, prompts: list[str], monitor: LoopMonitor | None = None) -> LoopMonitor:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT, f"{url}/v1/chat/completions",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    # The client's input (16 x ~150 KB of JSON) is encoded before the monitor starts: encoding
    # it on this loop is the benchmark's work, not the gateway's (it read as a 5-7 ms stall).
    payload = json.dumps(prompts).encode()
    monitor = monitor or LoopMonitor(0.005)
    monitor.start()
    try:
        out, err = await asyncio.wait_for(proc.communicate(payload), 120)
    finally:
        monitor.stop()
    assert proc.returncode == 0, err.decode()
    results = json.loads(out)
    assert [s for s, _ in results] == [200] * BURST, results
    assert all(t >= PROMPT_TOKENS for _, t in results)  # the engine saw the whole prompts
    assert monitor.ticks > 10
    return monitor




async def run(args: argparse.Namespace) -> None:
    import gateway.app
    from fleetcore.fleet_config import parse_fleet
    from gateway.embedded import serve_fleet

    if args.switch_interval is not None:
        gateway.app.SWITCH_INTERVAL_S = args.switch_interval
    fleet = dict(FLEET)
    gateway_settings: dict[str, Any] = {}
    if args.workers is not None:
        gateway_settings["tokenize_workers"] = args.workers
    if args.no_helper:
        gateway_settings["tokenize_helper"] = False
    if gateway_settings:
        fleet["gateway"] = gateway_settings
    config = parse_fleet(fleet)
    prompts = [prompt(k) for k in range(args.bursts * BURST)]
    async with serve_fleet(config, poll_interval_s=0.2) as f:
        for k in range(args.bursts):
            t0 = time.monotonic()
            m = await burst(f.url, prompts[k * BURST:(k + 1) * BURST],
                            BreakdownMonitor(0.005) if args.breakdown else None)
            print(f"burst {k}: busy max {m.max_busy_lag_s * 1e3:6.1f} ms   lag max {m.max_lag_s * 1e3:6.1f} ms   "
                  f"wall {time.monotonic() - t0:5.2f} s   (workers {config.gateway.tokenize_workers}, switch "
                  f"interval {gateway.app.SWITCH_INTERVAL_S * 1e3:g} ms, helper "
                  f"{'on' if config.gateway.tokenize_helper else 'off'})", flush=True)
            if isinstance(m, BreakdownMonitor):
                for lag, cpu, waited in sorted(m.late, reverse=True)[:5]:
                    print(f"    late tick: lag {lag * 1e3:5.1f} ms of a {(lag + m.interval_s) * 1e3:5.1f} ms span: loop "
                          f"thread on CPU {cpu * 1e3:5.1f}, runnable not run {waited * 1e3:5.1f}, rest (GIL, "
                          f"I/O) {max(0.0, lag + m.interval_s - cpu - waited) * 1e3:5.1f}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description="Event-loop stalls from a burst of 16 prompts of 32k tokens.")
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--workers", type=int, help="gateway.tokenize_workers (default: the fleet file's default)")
    p.add_argument("--switch-interval", type=float, help="seconds (default: gateway.app.SWITCH_INTERVAL_S)")
    p.add_argument("--no-helper", action="store_true", help="gateway.tokenize_helper: false")
    p.add_argument("--breakdown", action="store_true", help="where the worst ticks' time went (module docstring)")
    args = p.parse_args()
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
