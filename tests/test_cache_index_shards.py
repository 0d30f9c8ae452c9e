"""The prefix cache index's sharded maps and live-counted LRU batches hold exactly the state a
plain index would (issue 14: no O(entries) step on the event loop at an engine's cache size).

`PlainIndex` below is the index's meaning written without any of the machinery: one dict per
map, LRU batches never cleaned. Random streams of routes (small capacities, so the LRU evicts),
KV events (stores, removals of held and unknown blocks, repeats, clears, restarts), the total
bound, forgotten instances and capacity changes go to both; after every step the maps
(key -> instances' bits, and per instance key -> last touch), the entry counts and the prefix
groups a decision reads must be equal, and the batch references must stay bounded."""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import pytest

import tokenpilot.cache_index as ci
from fleetcore.prefix import synthetic_block_hashes
from tokenpilot.cache_index import PrefixCacheIndex


class PlainIndex:
    def __init__(self, default_capacity_blocks: int, stride: int, max_total_blocks: int,
                 stale_after_s: float = 30.0) -> None:
        self.default_capacity, self.stride, self.max_total = default_capacity_blocks, stride, max_total_blocks
        self.stale_after_s = stale_after_s
        self.mask: dict[int, int] = {}
        self.last: dict[str, dict[int, int]] = {}
        self.batches: dict[str, deque[tuple[int, list[int]]]] = {}
        self.bit: dict[str, int] = {}
        self.capacity: dict[str, int] = {}
        self.exact: dict[str, bool] = {}
        self.event_at: dict[str, float] = {}
        self.seq: dict[str, int] = {}
        self.free: list[int] = []
        self.tick = 0

    def entry(self, i: str) -> None:
        if i not in self.last:
            self.bit[i] = self.free.pop() if self.free else len(self.last)
            self.last[i], self.batches[i] = {}, deque()
            self.capacity[i] = max(1, self.default_capacity // self.stride)
            self.exact[i], self.event_at[i], self.seq[i] = False, float("-inf"), -1

    def unset(self, h: int, i: str) -> None:
        m = self.mask.get(h, 0) & ~(1 << self.bit[i])
        if m:
            self.mask[h] = m
        else:
            self.mask.pop(h, None)

    def touch(self, i: str, keys: Sequence[int]) -> None:
        if not keys:
            return
        self.tick += 1
        for h in keys:
            self.mask[h] = self.mask.get(h, 0) | 1 << self.bit[i]
            self.last[i][h] = self.tick
        self.batches[i].append((self.tick, list(keys)))

    def evict(self, i: str, limit: int) -> None:
        while len(self.last[i]) > limit and self.batches[i]:
            tick, keys = self.batches[i].popleft()
            for h in keys:
                if self.last[i].get(h) == tick:
                    del self.last[i][h]
                    self.unset(h, i)

    def remove(self, i: str, hashes: Iterable[int]) -> None:
        for h in hashes:
            if self.last[i].pop(h, None) is not None:
                self.unset(h, i)

    def clear(self, i: str) -> None:
        for h in list(self.last[i]):
            self.unset(h, i)
        self.last[i].clear()
        self.batches[i].clear()

    def bound_total(self, i: str) -> None:
        if len(self.mask) > self.max_total:
            self.evict(i, max(0, len(self.last[i]) - (len(self.mask) - self.max_total)))

    def record_route(self, i: str, hashes: Sequence[int], now: float) -> None:
        self.entry(i)
        s = self.stride
        self.touch(i, hashes[s - 1::s] if s > 1 else hashes)
        if not (self.exact[i] and now - self.event_at[i] <= self.stale_after_s):
            self.evict(i, self.capacity[i])
        self.bound_total(i)

    def apply_events(self, i: str, seq: int, events: Iterable[Mapping[str, Any]], now: float) -> None:
        self.entry(i)
        if seq <= self.seq[i]:
            self.clear(i)
        self.seq[i], self.exact[i], self.event_at[i] = seq, True, now
        for ev in events:
            if ev["type"] == "BlockStored":
                self.touch(i, list(ev["block_hashes"]))
            elif ev["type"] == "BlockRemoved":
                self.remove(i, ev["block_hashes"])
            else:
                self.clear(i)
        self.bound_total(i)

    def set_capacity(self, i: str, blocks: int) -> None:
        self.entry(i)
        self.capacity[i] = max(1, blocks // self.stride)
        self.evict(i, self.capacity[i])

    def forget(self, i: str) -> None:
        if i in self.last:
            self.clear(i)
            self.free.append(self.bit.pop(i))
            for d in (self.last, self.batches, self.capacity, self.exact, self.event_at, self.seq):
                del d[i]  # type: ignore[attr-defined]


def merged(shards: list[dict[int, int]]) -> dict[int, int]:
    out: dict[int, int] = {}
    for d in shards:
        assert not out.keys() & d.keys()  # each key lives in one shard
        out.update(d)
    return out


def assert_same(idx: PrefixCacheIndex, plain: PlainIndex, probes: list[list[int]], step: int) -> None:
    assert merged(idx._mask) == plain.mask, step
    assert set(idx._inst) == set(plain.last), step
    for i, e in idx._inst.items():
        assert e.bit == plain.bit[i], step
        assert merged(e.last) == plain.last[i], (step, i)
        assert idx.entries(i) == len(plain.last[i]), step
        # references stay bounded: a batch under 1/STALE_RATIO live is filtered (repeats aside)
        assert e.batch_refs <= ci.STALE_RATIO * e.held() + 64, (step, i, e.batch_refs, e.held())
        assert e.batch_refs == sum(map(len, e.batches.values())), step
        # each batch's live count is the keys whose last touch it is; a batch with none is gone
        assert e.live == Counter(plain.last[i].values()) and e.live.keys() == e.batches.keys(), (step, i)
    assert idx.total_entries == len(plain.mask), step
    # what a decision reads: the same prefix groups, looked up through the shards and in one dict
    one_dict = SimpleNamespace(_mask=[plain.mask] * ci.SHARDS)
    want = sum(1 << b for b in plain.bit.values())
    for p in probes:
        keys = idx._keys(p)
        assert idx._levels(keys, want) == PrefixCacheIndex._levels(one_dict, keys, want), step  # type: ignore[arg-type]


@pytest.mark.parametrize("bulk_min", [0, ci.BULK_MIN, 1 << 30])  # every update bulk, as shipped, none bulk
@pytest.mark.parametrize("seed", [5, 17])
def test_sharded_index_holds_the_plain_index_state(seed: int, bulk_min: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ci, "BULK_MIN", bulk_min)  # both ways of applying an update, on the same streams
    rng = random.Random(seed)
    kw = dict(default_capacity_blocks=96, stride=2, max_total_blocks=400)
    idx, plain = PrefixCacheIndex(**kw), PlainIndex(**kw)  # type: ignore[arg-type]
    ids = ["a", "b", "c", "d"]
    convs: list[list[int]] = [[0, 1]]
    seqs = {i: 0 for i in ids}
    stored: dict[str, list[list[int]]] = {i: [] for i in ids}
    clock = 0.0
    for n in range(2500):
        blocks = rng.choice(convs[-50:]) + [10_000 + n] if rng.random() < 0.7 else [0, 20_000 + n]
        convs.append(blocks)
        hashes = synthetic_block_hashes(blocks, 4)
        who, step = rng.choice(ids), rng.random()
        clock += 60.0 if rng.random() < 0.01 else 0.5  # now and then an exact instance goes stale
        ops: list[tuple[str, tuple[Any, ...]]] = []
        if step < 0.5:
            removed: list[int] = []
            if stored[who] and rng.random() < 0.8:
                old = stored[who].pop(rng.randrange(len(stored[who])))
                removed = rng.sample(old, rng.randrange(1, len(old) + 1))
            removed += rng.sample(hashes, rng.randrange(0, 3))  # just stored, or not held at all
            removed += [rng.getrandbits(64)] * rng.randrange(0, 2)  # a block the index never saw
            events: list[dict[str, Any]] = [{"type": "BlockStored", "block_hashes": hashes + hashes[:2]},  # repeats
                                            {"type": "BlockRemoved", "block_hashes": removed + removed[:1]}]
            if rng.random() < 0.01:
                events.append({"type": "AllBlocksCleared"})
            stored[who].append(hashes)
            ops.append(("apply_events", (who, seqs[who], events, clock)))
            seqs[who] += 1
        elif step < 0.505:
            ops.append(("apply_events", (who, 0, [], clock)))  # the engine restarted: its cache is empty
            seqs[who], stored[who] = 1, []
        elif step < 0.51:
            ops.append(("forget", (who,)))
            seqs[who], stored[who] = 0, []
        elif step < 0.52:
            ops.append(("set_capacity", (who, rng.choice([8, 48, 96, 400]))))
        else:
            ops.append(("record_route", (who, hashes, clock)))
        for name, args in ops:
            getattr(idx, name)(*args)
            getattr(plain, name)(*args)
        probes = [synthetic_block_hashes(rng.choice(convs[-80:]), 4) for _ in range(2)]
        assert_same(idx, plain, probes, n)


@pytest.mark.parametrize("bulk_min", [0, 1 << 30])
def test_keys_outside_uint64_and_sparse_keys_agree(bulk_min: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys another hash function might give (negative, wider than 64 bits) and small ones go to
    some shard and back out the same way; routes keep every `stride`-th key."""
    monkeypatch.setattr(ci, "BULK_MIN", bulk_min)
    kw = dict(default_capacity_blocks=64, stride=4, max_total_blocks=10_000)
    idx, plain = PrefixCacheIndex(**kw), PlainIndex(**kw)  # type: ignore[arg-type]
    odd = [-(2**63) - 5, -1, 2**70 + 3, 7, 2**40 + 9, *range(100, 140)]
    for k in range(30):
        for x in (idx, plain):
            x.record_route("a", [h + k for h in odd], float(k))
            x.apply_events("b", k, [{"type": "BlockStored", "block_hashes": [h + k for h in odd]},
                                    {"type": "BlockRemoved", "block_hashes": [h + k - 1 for h in odd[:20]]}], float(k))
        assert_same(idx, plain, [[h + k for h in odd]], k)


def test_shards_are_unequal_and_spread_their_keys() -> None:
    """An engine-sized index spreads over every shard, unequally (so the shards' dicts do not all
    run out of free slots in the same batches), and inside a shard the keys' low bits, which
    place them in the dict's table, take every value (bits 32-39 pick the shard, not bits 0-7)."""
    idx = PrefixCacheIndex()
    for seq in range(80):
        idx.apply_events("a", seq, [{"type": "BlockStored", "block_hashes": synthetic_block_hashes([seq], 512)}],
                         float(seq))
    sizes = [len(d) for d in idx._mask]
    assert sum(sizes) == 80 * 512
    assert min(sizes) > 0 and max(sizes) / min(sizes) > 1.6  # weights 10..22
    assert max(sizes) < 0.1 * sum(sizes)
    for d in idx._mask:
        assert len({h & 255 for h in d}) > 200


@pytest.mark.parametrize("bulk_min", [0, 1 << 30])
def test_mostly_removed_batches_are_filtered_and_keep_their_age(bulk_min: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine removes most blocks of every stored batch but keeps a few (a shared prefix):
    the batches' stale references are filtered one batch at a time, so references stay within
    STALE_RATIO x the entries, and the filtered batches keep their place in the LRU (the total
    bound then evicts the oldest first, as the plain index does)."""
    monkeypatch.setattr(ci, "BULK_MIN", bulk_min)
    kw = dict(default_capacity_blocks=1 << 16, stride=1, max_total_blocks=1_000_000)
    idx, plain = PrefixCacheIndex(**kw), PlainIndex(**kw)  # type: ignore[arg-type]
    for seq in range(200):
        hashes = synthetic_block_hashes([seq], 64)
        for x in (idx, plain):
            x.apply_events("a", 2 * seq, [{"type": "BlockStored", "block_hashes": hashes}], float(seq))
            x.apply_events("a", 2 * seq + 1, [{"type": "BlockRemoved", "block_hashes": hashes[4:]}], float(seq))
    e = idx._inst["a"]
    assert e.held() == 200 * 4 and len(e.batches) == 200
    assert e.batch_refs <= ci.STALE_RATIO * e.held()  # 12,800 references without the filtering
    assert_same(idx, plain, [synthetic_block_hashes([k], 64) for k in (0, 199)], 0)
    for x in (idx, plain):
        x.max_total = x.max_total_blocks = 500  # type: ignore[union-attr]
        x.apply_events("a", 1000, [{"type": "BlockStored", "block_hashes": synthetic_block_hashes([999], 8)}], 1e3)
    assert_same(idx, plain, [synthetic_block_hashes([k], 64) for k in (0, 150, 199)], 1)
    assert idx.match(synthetic_block_hashes([0], 64), ["a"]) == {"a": 0}  # the oldest went
    assert idx.match(synthetic_block_hashes([199], 64), ["a"]) == {"a": 4}
