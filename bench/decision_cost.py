"""Microbenchmark: the cost of one TokenPilot decision with 64 instances and ~1M indexed blocks.

    python bench/decision_cost.py [--instances 64] [--blocks 1000000] [--cpu-time]
    python bench/decision_cost.py --cpu-time --baseline-ref main --rounds 3   # before/after, interleaved

Prints p50/p99 per decision for TokenPilot and, as a baseline measured in the same
run, for round_robin and least_loaded (whose decisions do no cache lookups). TokenPilot
indexes a routed prompt after the decision (`PrefixCacheIndex.record_route_later`); the
gateway applies it once the request is sent, and so does this script, outside the decision's
timing: that update's own cost is printed on the line below.

`--baseline-ref REF` measures the code of another commit against this checkout's in one run:
the commit's tree (`git archive`, as bench/decision_replay.py does) and this one run this
script alternately (baseline, this, baseline, this, ...) in their own processes, `--rounds`
times each, so both see the same machine; each line is one round. The workload is this
script's, whichever code it drives.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from pathlib import Path

from fleetcore.prefix import synthetic_block_hashes
from fleetcore.types import InstanceSnapshot, RequestProfile
from tokenpilot.priors import prior_from_physics
from tokenpilot.registry import make_router
from tokenpilot.router import TokenPilot, TokenPilotConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--instances", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=1_000_000, help="indexed 16-token blocks to fill first")
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument("--cpu-time", action="store_true",
                    help="time each decision in this thread's CPU time, not wall time: on a shared machine the "
                         "wall-time p99 is the scheduler's (another job preempting us), not the decision's")
    ap.add_argument("--baseline-ref", metavar="REF",
                    help="also measure the code of this commit, in alternate rounds (see the module doc)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per side with --baseline-ref")
    args = ap.parse_args()
    if args.baseline_ref:
        interleave(args)
        return
    clock = time.thread_time if args.cpu_time else time.perf_counter
    rng = random.Random(0)
    prior = prior_from_physics("llama-3.1-8b", "H100")
    ids = [f"i{k}" for k in range(args.instances)]
    pool = [InstanceSnapshot(i, "s", "m", "v", f"http://{i}", num_running=rng.randrange(0, 40)) for i in ids]
    tp = TokenPilot({i: prior for i in ids}, config=TokenPilotConfig(explore=0.0))
    # Mooncake-like prompts: a shared first block, then ~24 512-token blocks, 40% sharing a
    # conversation prefix with an earlier request.
    convs: list[list[int]] = []
    next_id = 1

    def prompt() -> list[int]:
        nonlocal next_id
        if convs and rng.random() < 0.4:
            base = rng.choice(convs)
            ids_ = base + list(range(next_id, next_id + rng.randrange(1, 6)))
        else:
            ids_ = [0] + list(range(next_id, next_id + rng.randrange(2, 48)))
        next_id += 64
        convs.append(ids_)
        if len(convs) > 2000:
            convs.pop(0)
        return ids_

    t0 = time.perf_counter()
    filled, n = 0, 0
    while tp.index.total_entries * tp.index.stride < args.blocks:
        ids_ = prompt()
        h = synthetic_block_hashes(ids_, 32)
        tp.route(RequestProfile(f"f{n}", "m", 512 * len(ids_), tuple(h)), pool, float(n))
        filled += len(h)
        n += 1
    print(f"indexed {tp.index.total_entries * tp.index.stride:,} distinct blocks "
          f"({tp.index.total_entries:,} sparse entries, stride {tp.index.stride}) from {n:,} requests "
          f"in {time.perf_counter() - t0:.1f} s")
    reqs = []
    for k in range(args.decisions):
        ids_ = prompt()
        reqs.append(RequestProfile(f"q{k}", "m", 512 * len(ids_), tuple(synthetic_block_hashes(ids_, 32))))
    # As a long-running gateway's old generation: the index is not rescanned. (After the
    # requests are built: a gateway holds one request's profile at a time, not thousands,
    # and collecting them in the first timed decisions would be this script's cost.)
    gc.collect()
    gc.freeze()
    pauses = _CollectorPauses()  # garbage collections while the decisions run (each router's loop)
    for name, router in (("tokenpilot", tp), ("round_robin", make_router("round_robin")),
                         ("least_loaded", make_router("least_loaded"))):
        times, updates = [], []
        pauses.reset()
        flush = getattr(getattr(router, "index", None), "flush", None)
        for k, r in enumerate(reqs):
            t = clock()
            router.route(r, pool, 1e6 + k)
            times.append(clock() - t)
            if flush is not None:  # what the gateway does once the request is sent (gateway.routing)
                t = clock()
                flush()
                updates.append(clock() - t)
        print(f"{name:>13}: {_percentiles(times)}   ({len(times)} decisions, {args.instances} instances"
              f"{', CPU time' if args.cpu_time else ''})")
        if updates:
            print(f"{'':>13}  index update after dispatch: {_percentiles(updates)}")
        print(f"{'':>13}  garbage collections meanwhile: {pauses.summary()}")
    pauses.close()


class _CollectorPauses:
    """Collections (by generation) and their pauses, in this thread's CPU time."""

    def __init__(self) -> None:
        self._started = 0.0
        self._pauses: list[tuple[int, float]] = []
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.thread_time()
        else:
            self._pauses.append((info["generation"], time.thread_time() - self._started))

    def reset(self) -> None:
        self._pauses.clear()

    def summary(self) -> str:
        parts = []
        for gen in range(3):
            p = [d for g, d in self._pauses if g == gen]
            if p:
                parts.append(f"gen {gen}: {len(p)} (max {max(p) * 1e3:.2f} ms, total {sum(p) * 1e3:.1f} ms)")
        return ", ".join(parts) or "none"

    def close(self) -> None:
        gc.callbacks.remove(self._callback)


def interleave(args: argparse.Namespace) -> None:
    """Run this script over the baseline commit's code and this checkout's, alternately."""
    from decision_replay import run_alternately  # (bench/ is this script's folder: its first import path)

    run_alternately(Path(__file__).resolve(), _child_args(args), args.baseline_ref, args.rounds)


def _child_args(args: argparse.Namespace) -> list[str]:
    """This run's options, less the interleaving ones."""
    out = ["--instances", str(args.instances), "--blocks", str(args.blocks), "--decisions", str(args.decisions)]
    return out + (["--cpu-time"] if args.cpu_time else [])


def _percentiles(times: list[float]) -> str:
    times = sorted(times)
    p50, p99 = times[len(times) // 2], times[int(len(times) * 0.99)]
    return f"p50 {p50 * 1e6:7.1f} us   p99 {p99 * 1e6:7.1f} us"


if __name__ == "__main__":
    main()
