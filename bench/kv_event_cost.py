"""Microbenchmark: what one engine KV event batch costs the router's cache index, on the event loop.

    python bench/kv_event_cost.py [--held 200000] [--batches 3000] [--batch-blocks 512]

One exact-mode instance (its index follows `BlockStored` / `BlockRemoved` events) holds
`--held` blocks; every batch stores `--batch-blocks` new ones and, once full, removes as many of
the oldest, as an engine's evictions do. Prints the CPU time of `PrefixCacheIndex.apply_events`
per batch (p50 / p99 / max, total) and the slowest batches: what the gateway's KV feed
(`gateway.kv_feed`) holds the loop for, one batch per step. Synthetic, seeded hashes.
"""

from __future__ import annotations

import argparse
import time
from collections import deque

from fleetcore.prefix import synthetic_block_hashes
from tokenpilot.cache_index import PrefixCacheIndex


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--held", type=int, default=200_000, help="blocks the instance holds once full")
    ap.add_argument("--batches", type=int, default=3000)
    ap.add_argument("--batch-blocks", type=int, default=512, help="blocks stored (and removed) per batch")
    args = ap.parse_args()
    index = PrefixCacheIndex()
    held: deque[list[int]] = deque()
    times: list[float] = []
    for seq in range(args.batches):
        stored = synthetic_block_hashes([seq], args.batch_blocks)
        events: list[dict[str, object]] = [{"type": "BlockStored", "block_hashes": stored}]
        held.append(stored)
        if len(held) * args.batch_blocks > args.held:
            events.append({"type": "BlockRemoved", "block_hashes": held.popleft()})
        t = time.thread_time()
        index.apply_events("a", seq, events, float(seq))
        times.append(time.thread_time() - t)
    slowest = sorted(range(len(times)), key=lambda k: -times[k])[:5]
    ordered = sorted(times)
    print(f"{index.entries('a'):,} blocks held, batches of {args.batch_blocks} stored + {args.batch_blocks} removed, "
          f"CPU time: p50 {ordered[len(ordered) // 2] * 1e3:.2f} ms, p99 {ordered[int(len(ordered) * 0.99)] * 1e3:.2f} ms, "
          f"max {ordered[-1] * 1e3:.2f} ms, total {sum(times):.2f} s")
    print("slowest batches (#, ms):", ", ".join(f"#{k} {times[k] * 1e3:.1f}" for k in slowest))


if __name__ == "__main__":
    main()
