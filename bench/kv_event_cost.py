"""Microbenchmark: what one engine KV event batch costs the router's cache index, on the event loop.

    python bench/kv_event_cost.py [--held 200000] [--batches 3000] [--batch-blocks 512]
    python bench/kv_event_cost.py --baseline-ref 9d5b9e2   # before/after, same process, same stream
    python bench/kv_event_cost.py --routes 6000 --baseline-ref 9d5b9e2   # routed prompts instead

One exact-mode instance (its index follows `BlockStored` / `BlockRemoved` events) holds
`--held` blocks; every batch stores `--batch-blocks` new ones and, once full, removes as many of
the oldest, as an engine's evictions do. Prints the CPU time of `PrefixCacheIndex.apply_events`
per batch (p50 / p99 / max, total) and the slowest batches: what the gateway's KV feed
(`gateway.kv_feed`) holds the loop for, one batch per step. Synthetic, seeded hashes.

`--baseline-ref REF` also loads `tokenpilot/cache_index.py` as it is at commit REF and feeds both
indexes the same batches in one process, alternating which goes first: on a shared machine the
two see the same load at the same moment, which separate runs minutes apart do not. The two
indexes' answers are checked equal at the end (entries, and a match per stored batch sampled).

`--routes N`: the other way the index is fed, approximate mode: N routed prompts over 64
instances (bench/decision_cost.py's Mooncake-like prompts, 512-token blocks, stride-8 keys, the
LRU at its default capacity); per prompt, the CPU time of the decision's `match` and of
`record_route` (what the gateway applies after dispatch), the first third left out as warm-up.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import random
import subprocess
import sys
import tempfile
import time
from array import array
from collections import deque
from pathlib import Path
from typing import Any

from fleetcore.prefix import synthetic_block_hashes
from tokenpilot.cache_index import PrefixCacheIndex

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--held", type=int, default=200_000, help="blocks the instance holds once full")
    ap.add_argument("--batches", type=int, default=3000)
    ap.add_argument("--batch-blocks", type=int, default=512, help="blocks stored (and removed) per batch")
    ap.add_argument("--baseline-ref", metavar="REF", help="also time the index of this commit, interleaved")
    ap.add_argument("--routes", type=int, default=0, help="time N routed prompts instead of KV event batches")
    args = ap.parse_args()
    if args.routes:
        routes(args)
        return
    sides: list[tuple[str, Any]] = [("this checkout", PrefixCacheIndex())]
    if args.baseline_ref:
        sides.insert(0, (f"baseline {args.baseline_ref}", _index_at(args.baseline_ref)()))
    # The engine's view of what it holds, as arrays: lists of ints kept by this script would be
    # scanned by every garbage collection, whose pauses would land in the timed calls.
    held: deque[array[int]] = deque()
    times: list[list[float]] = [[] for _ in sides]
    pauses = _Pauses()
    for seq in range(args.batches):
        stored = synthetic_block_hashes([seq], args.batch_blocks)
        events: list[dict[str, object]] = [{"type": "BlockStored", "block_hashes": stored}]
        held.append(array("Q", stored))
        if len(held) * args.batch_blocks > args.held:
            events.append({"type": "BlockRemoved", "block_hashes": list(held.popleft())})
        order = range(len(sides)) if seq % 2 == 0 else reversed(range(len(sides)))
        for k in order:
            pauses.timing = k
            t = time.thread_time()
            sides[k][1].apply_events("a", seq, events, float(seq))
            times[k].append(time.thread_time() - t)
            pauses.timing = None
    pauses.close()
    for side, ((name, index), ts) in enumerate(zip(sides, times)):
        slowest = sorted(range(len(ts)), key=lambda k: -ts[k])[:5]
        ordered = sorted(ts)
        prefix = f"{name}: " if len(sides) > 1 else ""
        print(f"{prefix}{index.entries('a'):,} blocks held, batches of {args.batch_blocks} stored + "
              f"{args.batch_blocks} removed, CPU time: p50 {ordered[len(ordered) // 2] * 1e3:.2f} ms, "
              f"p99 {ordered[int(len(ordered) * 0.99)] * 1e3:.2f} ms, max {ordered[-1] * 1e3:.2f} ms, "
              f"total {sum(ts):.2f} s")
        print(f"{prefix}slowest batches (#, ms):", ", ".join(f"#{k} {ts[k] * 1e3:.1f}" for k in slowest))
        print(f"{prefix}garbage collections inside the timed batches: {pauses.summary(side)}")
    if len(sides) > 1:
        base, new = sides[0][1], sides[1][1]
        assert base.entries("a") == new.entries("a")
        for seq in range(0, args.batches, max(1, args.batches // 200)):
            probe = synthetic_block_hashes([seq], args.batch_blocks)
            assert base.match(probe, ["a"]) == new.match(probe, ["a"]), seq
        print(f"total CPU, this checkout / baseline: {sum(times[1]) / sum(times[0]):.3f}; answers equal")


class _Pauses:
    """Garbage collections that ran inside a timed call, per side (a collection pauses whichever
    code allocates when the threshold is crossed: it is part of that call's time)."""

    def __init__(self) -> None:
        self.timing: int | None = None
        self._started = 0.0
        self.seen: dict[int, list[tuple[int, float]]] = {}
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if self.timing is None:
            return
        if phase == "start":
            self._started = time.thread_time()
        else:
            self.seen.setdefault(self.timing, []).append((info["generation"], time.thread_time() - self._started))

    def summary(self, side: int) -> str:
        parts = []
        for gen in range(3):
            p = [d for g, d in self.seen.get(side, []) if g == gen]
            if p:
                parts.append(f"gen {gen}: {len(p)} (max {max(p) * 1e3:.2f} ms)")
        return ", ".join(parts) or "none"

    def close(self) -> None:
        gc.callbacks.remove(self._callback)


def routes(args: argparse.Namespace) -> None:
    sides: list[tuple[str, Any]] = [("this checkout", PrefixCacheIndex())]
    if args.baseline_ref:
        sides.insert(0, (f"baseline {args.baseline_ref}", _index_at(args.baseline_ref)()))
    rng = random.Random(0)
    ids = [f"i{k}" for k in range(64)]
    convs: list[list[int]] = []
    next_id = 1
    times = [([], []) for _ in sides]  # (match, record_route) per side
    for n in range(args.routes):
        if convs and rng.random() < 0.4:  # (the prompts of bench/decision_cost.py)
            blocks = rng.choice(convs) + list(range(next_id, next_id + rng.randrange(1, 6)))
        else:
            blocks = [0] + list(range(next_id, next_id + rng.randrange(2, 48)))
        next_id += 64
        convs.append(blocks)
        if len(convs) > 2000:
            convs.pop(0)
        hashes, who = synthetic_block_hashes(blocks, 32), rng.choice(ids)
        for k in range(len(sides)) if n % 2 == 0 else reversed(range(len(sides))):
            index = sides[k][1]
            t = time.thread_time()
            index.match(hashes, ids)
            t1 = time.thread_time()
            index.record_route(who, hashes, float(n))
            t2 = time.thread_time()
            if n >= args.routes // 3:
                times[k][0].append(t1 - t)
                times[k][1].append(t2 - t1)
        if len(sides) > 1:
            assert sides[0][1].match(hashes, ids) == sides[1][1].match(hashes, ids), n
    for (name, index), (match, record) in zip(sides, times):
        print(f"{name}: {index.total_entries:,} entries; per routed prompt, CPU time: match p50 "
              f"{sorted(match)[len(match) // 2] * 1e6:.1f} us, mean {sum(match) / len(match) * 1e6:.1f} us; "
              f"record_route p50 {sorted(record)[len(record) // 2] * 1e6:.1f} us, "
              f"mean {sum(record) / len(record) * 1e6:.1f} us, max {max(record) * 1e3:.2f} ms")
    if len(sides) > 1:
        (_, (m0, r0)), (_, (m1, r1)) = zip(sides, times)
        print(f"this checkout / baseline, total CPU: match {sum(m1) / sum(m0):.3f}, record_route "
              f"{sum(r1) / sum(r0):.3f}; answers equal")


def _index_at(ref: str) -> Any:
    """`PrefixCacheIndex` from tokenpilot/cache_index.py at commit `ref` (it imports only numpy and
    the standard library), as a module of its own."""
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:tokenpilot/cache_index.py"],
                          capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp(prefix="kv-event-cost-")) / "cache_index_baseline.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("cache_index_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up by name)
    spec.loader.exec_module(module)
    return module.PrefixCacheIndex


if __name__ == "__main__":
    main()
