"""Added latency of fleet-wide budgets on the admission path (one Redis round trip, loopback).

Runs admissions through `AdmissionGate.enter` and `release` (the gateway's admission step and
its give-back: SLOMax with a budgeted tenant), shared budgets off and on, against a private
redis-server, and prints p50/p99 per admission and the difference. Off and on alternate in
`--rounds` rounds of n / rounds admissions each, so that a machine whose load drifts during
the run weighs on both alike. The event loop is the gateway's (`--loop uvloop`, what
`tokenfleet up` runs) unless asked otherwise; the line printed first says which loop and
whether redis-py found hiredis.

    .venv/bin/python -m bench.shared_budget_latency [--n 2000] [--rounds 4] [--loop uvloop|asyncio]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from fleetcore.fleet_config import GatewaySettings, parse_fleet
from fleetcore.types import RequestProfile
from gateway.admission import AdmissionGate
from gateway.budget_store import SharedBudgets
from gateway.replicas import private_redis
from gateway.shared_state import SharedRedis
from slomax import SLOMax


@dataclass
class _Parsed:  # the part of gateway.requests.ParsedRequest admission reads
    profile: RequestProfile
    obs: None = None  # no telemetry record: the bench times admission alone


class _View:
    sites: tuple[Any, ...] = ()

    def instances(self) -> list[Any]:
        return []


def _config() -> Any:
    return parse_fleet({
        "sites": [{"name": "use1", "region": "us-east", "jurisdiction": "us"}],
        "models": [{"name": "m1", "versions": ["v1"], "engine": {"spec": "llama-3.1-8b", "max_model_len": 4096}}],
        "tenants": [{"name": "a", "api_keys": ["k"], "budgets": {"requests_per_minute": 10_000_000,
                                                                 "tokens_per_minute": 10_000_000_000}}],
    })


async def run(n: int, url: str | None) -> list[float]:
    policy = SLOMax.from_fleet(_config())
    state = SimpleNamespace(view=lambda: _View())
    gate = AdmissionGate(policy, state, time.monotonic)  # type: ignore[arg-type]
    shared = None
    if url is not None:
        shared = SharedRedis(url, GatewaySettings(redis_prefix="bench"))
        await shared.beat()
        gate.shared_budgets = SharedBudgets(shared, policy, time.monotonic)
    out = []
    for i in range(n + 200):  # 200 warm-up admissions
        profile = RequestProfile(request_id=f"r{i}", model="m1", prompt_tokens=100, tenant="a", max_tokens=16,
                                 arrival=time.monotonic())
        parsed = _Parsed(profile)
        t0 = time.perf_counter()
        await gate.enter(parsed, lambda aw: aw)  # type: ignore[arg-type]
        dt = time.perf_counter() - t0
        gate.release(profile.request_id)
        if i >= 200:
            out.append(dt * 1000)
    if shared is not None:
        await gate.shared_budgets.close()  # type: ignore[union-attr]
        await shared.stop()
    return out


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


async def measure(n: int, rounds: int) -> tuple[list[float], list[float]]:
    off: list[float] = []
    on: list[float] = []
    async with private_redis() as url:  # the one `tokenfleet up --replicas` starts
        for _ in range(rounds):
            off += await run(max(1, n // rounds), None)
            on += await run(max(1, n // rounds), url)
    return off, on


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    args = ap.parse_args()
    from redis.utils import HIREDIS_AVAILABLE

    print(f"loop {args.loop}, redis-py {'with' if HIREDIS_AVAILABLE else 'without'} hiredis")
    if args.loop == "uvloop":
        import uvloop
        off, on = uvloop.run(measure(args.n, max(1, args.rounds)))
    else:
        off, on = asyncio.run(measure(args.n, max(1, args.rounds)))
    for name, xs in (("shared budgets off", off), ("shared budgets on ", on)):
        print(f"{name}: p50 {pct(xs, 0.5):.3f} ms  p99 {pct(xs, 0.99):.3f} ms  mean {statistics.mean(xs):.3f} ms "
              f"(n={len(xs)})")
    print(f"added by the Redis round trip: p50 {pct(on, 0.5) - pct(off, 0.5):.3f} ms  "
          f"p99 {pct(on, 0.99) - pct(off, 0.99):.3f} ms")


if __name__ == "__main__":
    main()
