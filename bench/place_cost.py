"""Microbenchmark: the policy work of one relayed request, outside the gateway — placement
(`fleetmind.place`: FleetMind's site choice with TokenPilot's prediction, then TokenPilot's
route), the index update after dispatch, the first token, the outcome — and parsing the body.

    python bench/place_cost.py [--instances 1] [--requests 4000]
    python bench/place_cost.py --baseline-ref main --rounds 3 --instances 1   # before/after, interleaved

The setup is `bench/peers.py --parts overhead`'s gateway: one site, `--instances` static
instances of one model, TokenPilot + FleetMind as `gateway.routing` builds them, streamed
requests of 64 prompt tokens (4 blocks, the first one random, the rest shared) arriving every
5 ms, each getting its first token 2 ms later and ending well; the learned latency model is
fitted after 1,000 outcomes, as the gateway's background refit does. Each step is timed in this
thread's CPU time (`time.thread_time_ns`: another job preempting us does not count); medians over
the requests after the first 1,500. `parse` is `gateway.requests.parse_request` of a chat body of
~110 built-in tokens (200 bodies, the best of 7 repeats, CPU time too). `--baseline-ref` runs this script over that
commit's tree (`git archive`, as `bench/decision_cost.py` does) and this checkout alternately, each
in its own process; each line is one round. Everything is generated in-process (seed 0).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
import timeit
from pathlib import Path


def measure(instances: int, requests: int) -> str:
    from engine_adapters.base import Instance
    from fleetcore.fleet_config import parse_fleet
    from fleetcore.prefix import block_hashes
    from fleetcore.types import FleetView, InstanceSnapshot, RequestOutcome, RequestProfile, SiteSnapshot
    from fleetmind.place import place
    from gateway.auth import Caller
    from gateway.requests import parse_request
    from gateway.routing import build_router, build_site_chooser

    config = parse_fleet({"sites": [{"name": "use1", "region": "us-east", "jurisdiction": "us"}],
                          "models": [{"name": "m1", "engine": {"spec": "llama-3.1-8b", "max_model_len": 4096}}]})
    insts = [Instance(instance_id=f"e{i}", site="use1", model="m1", version="v1", url=f"http://x{i}",
                      adapter="static") for i in range(instances)]
    router = build_router("tokenpilot", insts)
    chooser = build_site_chooser(config, router)
    snaps = tuple(InstanceSnapshot(f"e{i}", "use1", "m1", "v1", f"http://x{i}") for i in range(instances))
    view = FleetView((SiteSnapshot("use1", "us-east", "us", {}, snaps),))
    rng = random.Random(0)
    toks = list(range(64))
    steps: dict[str, list[int]] = {k: [] for k in ("place", "index update", "first token", "outcome")}
    ns = time.thread_time_ns
    gc.freeze()
    t0 = 1000.0
    for r in range(requests):
        prof = RequestProfile(f"r{r}", "m1", 64, tuple(block_hashes([rng.randrange(1000)] + toks[1:], 16)), 16, 4,
                              stream=True, arrival=t0 + r * 0.005)
        now = t0 + r * 0.005 + 0.0003
        a = ns()
        choice = place(prof, view, now, chooser, router)
        b = ns()
        router.index.flush()
        c = ns()
        router.on_first_token(prof.request_id, now + 0.002)
        d = ns()
        router.observe(RequestOutcome(prof.request_id, choice.instance.instance_id, "use1", True, 64,
                                      ttft_s=0.002 + rng.random() * 0.001, mean_tpot_s=0.0005, output_tokens=4))
        e = ns()
        for k, v in zip(steps, (b - a, c - b, d - c, e - d)):
            steps[k].append(v)
        if r == 1000 and router.refit_due():
            router.refit()
    med = {k: sorted(v[1500:])[(len(v) - 1500) // 2] / 1000 for k, v in steps.items()}
    words = "the of and to in is that for it as with was on be by at this from or an are not fleet token".split()
    bodies = [json.dumps({"model": "m1", "max_tokens": 4, "stream": True, "messages": [
        {"role": "user", "content": " ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(28))}]}).encode()
        for _ in range(200)]
    caller = Caller("anonymous")

    def parse_all() -> None:
        for body in bodies:
            parse_request("chat", body, config=config, caller=caller, headers={}, request_id="r", now=1.0)

    parse_us = min(timeit.Timer(parse_all, timer=time.thread_time).repeat(number=10, repeat=7)) / (10 * len(bodies)) * 1e6
    return (f"{instances} instance(s), fitted {router.latency.ttft is not None}: "
            + "  ".join(f"{k} {v:5.1f}" for k, v in med.items())
            + f"  | sum {sum(med.values()):5.1f} us   parse {parse_us:5.1f} us  (CPU us, medians)")


def interleave(args: argparse.Namespace) -> None:
    from decision_replay import run_alternately  # (bench/ is this script's folder: its first import path)

    run_alternately(Path(__file__).resolve(), ["--instances", str(args.instances), "--requests", str(args.requests)],
                    args.baseline_ref, args.rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", type=int, default=1)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--baseline-ref", metavar="REF", help="also measure that commit's code, in alternate rounds")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per side with --baseline-ref")
    args = ap.parse_args()
    if args.baseline_ref:
        interleave(args)
        return
    print(measure(args.instances, args.requests))


if __name__ == "__main__":
    main()
