"""Which prefix blocks each instance holds: fed by routing history or by engine KV events.

One global map `block hash -> bitmask of instances` answers, for every candidate at
once, how many leading blocks of a request each instance holds. Block hashes are
chained (`fleetcore.prefix`), so an instance that holds block k almost always
holds blocks 0..k-1 too ("prefix closure"); `match` exploits that with a binary
search per change point, so a decision costs O(candidates x log(prompt blocks))
dict lookups instead of walking every block of a long prompt.

Approximate mode (no events): routing a request to an instance records its blocks
there, and an LRU bounded by the instance's KV capacity forgets the oldest.
Blocks of one request are touched last-block-first, so a prefix is always more
recent than its suffix and LRU keeps prefix closure, as vLLM's free-block order does.

Exact mode: once an instance's engine publishes KV events (BlockStored /
BlockRemoved / AllBlocksCleared) the index follows them; routing history is still
recorded, because a routed request's blocks appear on the engine only as its
prefill runs and a second request with the same prefix may arrive before that.
An exact instance whose events stop (`stale_after_s`) falls back to the LRU bound.

Sparse keys. Because hashes are chained, the hash of block k names the whole
prefix up to k, so the index keeps only every `stride`-th block (default 8: one
key per 128 tokens at 16-token blocks). That divides memory and update time by
`stride` and costs at most `stride - 1` blocks of precision in a match, noise next
to a prefill's cost. Callers pass and receive ordinary block counts.

Sharded maps. The index's maps (the global mask, each instance's entries) are split by 8 bits
of the block hash into `SHARDS` unequal dicts. CPython rebuilds a dict whose free slots churn
uses up (inserts of new keys with as many deletions: every ~1,000 KV batches at 200k entries),
which is O(entries) at once on the event loop: ~17 ms for one 200k-entry dict, well under a
millisecond for a shard of one. Lookups cost one more index; an engine's batch is split by shard
once (`_split`) and applied C-level per shard, a routed prompt's few keys one Python step each.
The LRU batches are never rebuilt whole either: each keeps a count of its live references, and
one that falls under 1/STALE_RATIO live is filtered alone (`_shrink`), so no step is
O(entries) (bench/README.md, "KV index at an engine's cache size: sharded maps").
"""

from __future__ import annotations

from array import array
from collections import Counter, OrderedDict, deque
from itertools import compress, repeat
from operator import is_, is_not
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAX_LATER = 1024  # deferred route records kept before they are applied anyway (a bound on memory)
# Pool membership vectors of match groups kept (`match_blocks`): a few MB at 64-256 instances.
MAX_MEMBER_VECTORS = 4096
# Dicts each map is split into, by 8 bits of the block hash (xxh64: uniform; `_SHIFT`). Each shard
# takes a different number of the BUCKETS hash buckets (5 to 11 of 256 at 32 shards): equal
# shards filled and churned at the same rate would all run out of free slots in the same few
# batches, and their rebuilds, small one by one, would stall those batches together; unequal
# ones rebuild at different times. 32 keeps a shard of a 200k-entry map under ~9k entries (a
# rebuild well under a millisecond); more shards cost C calls per shard on every bulk update.
SHARDS = 32
BUCKETS = 256


def _bucket_map(shards: int, buckets: int) -> bytes:
    """bucket -> shard, shard k taking about (10 + 12 k / (shards - 1)) / 16 of the average share."""
    weights = [10 + 12 * k / max(1, shards - 1) for k in range(shards)]
    total = sum(weights)
    bounds = [round(buckets * sum(weights[: k + 1]) / total) for k in range(shards)]
    out, k = bytearray(), 0
    for b in range(buckets):
        while b >= bounds[k]:
            k += 1
        out.append(k)
    return bytes(out)


_SHARD_OF = _bucket_map(SHARDS, BUCKETS)
_LOW = BUCKETS - 1
# The bucket is taken from bits 32-39: a dict places a key by its hash's low bits, and a shard
# holding only keys whose low bits agree would crowd them into a fraction of its table.
_SHIFT = 32
# Keys per update from which it is split by shard and applied C-level shard by shard (an engine's
# KV batch: hundreds); fewer (a routed prompt's sparse keys) take one Python step each.
BULK_MIN = 256
# A batch is filtered down to its live references once fewer than 1/STALE_RATIO of them are:
# references stay within STALE_RATIO x the entries, and each is filtered O(1) times amortised.
STALE_RATIO = 4


def _shards() -> list[dict[int, int]]:
    return [{} for _ in range(SHARDS)]


@dataclass(slots=True)
class _InstanceBlocks:
    """One instance's entries with an LRU kept in batches, one batch per request or event.

    `last[shard]` maps entry -> the tick that last touched it; `batches` holds tick -> keys
    in touch order and `live` each batch's references still current (the key's last touch is
    that batch's tick). Touching a whole request is one C-level dict update per shard plus one
    insertion; eviction pops the oldest batch and drops only the keys whose last touch is
    still that batch's tick. A request's blocks thus age and leave together, and a prefix
    that a newer request touched stays: prefix closure holds.
    """

    bit: int
    capacity: int
    last: list[dict[int, int]] = field(default_factory=_shards)
    batches: OrderedDict[int, Sequence[int]] = field(default_factory=OrderedDict)
    live: dict[int, int] = field(default_factory=dict)
    batch_refs: int = 0
    exact: bool = False
    last_event_at: float = float("-inf")
    last_seq: int = -1

    def held(self) -> int:
        return sum(map(len, self.last))


class PrefixCacheIndex:
    def __init__(self, default_capacity_blocks: int = 1 << 16, stale_after_s: float = 30.0,
                 max_total_blocks: int = 4_000_000, stride: int = 8) -> None:
        if stride < 1:
            raise ValueError("stride must be >= 1")
        self.stride = stride
        self.default_capacity = default_capacity_blocks
        self.stale_after_s = stale_after_s
        self.max_total_blocks = max_total_blocks
        self._mask: list[dict[int, int]] = _shards()  # block hash -> bitmask of the instances holding it
        self._inst: dict[str, _InstanceBlocks] = {}
        self._by_bit: dict[int, str] = {}
        self._free_bits: list[int] = []
        self._tick = 0
        self._want_cache: dict[tuple[str, ...], tuple[int, np.ndarray, int, int]] = {}
        # (pool serial, group bitmask) -> 0/1 per pool member: a decision's groups repeat (the
        # instances holding a shared system prompt, the one holding a conversation), so the
        # bit unpacking runs once per group, not once per decision. A pool whose bits change
        # gets a new serial (`_pool_bits`), so no stale vector is ever read; clearing them
        # with `_want_cache` only frees their memory.
        self._members: dict[tuple[int, int], np.ndarray] = {}
        self._pool_serial = 0
        # Routes recorded after the decision (`record_route_later`), applied in order before any
        # other read or write of the index: every answer is what it would have been had they
        # been applied at once.
        self._later: deque[tuple[str, Sequence[int], float]] = deque()

    # -- deferred route records ------------------------------------------------
    def record_route_later(self, instance: str, block_hashes: Sequence[int], now: float) -> None:
        """`record_route`, applied by `flush()` (the gateway calls it once the request is on its
        way to the engine) or else by the next use of the index: a decision does not pay for
        indexing its own prompt before the request is sent."""
        self._later.append((instance, block_hashes, now))
        if len(self._later) > MAX_LATER:
            self.flush()

    def flush(self) -> None:
        later = self._later
        while later:
            self._record_route(*later.popleft())

    # -- instances ---------------------------------------------------------
    def _entry(self, instance: str) -> _InstanceBlocks:
        e = self._inst.get(instance)
        if e is None:
            bit = self._free_bits.pop() if self._free_bits else len(self._inst)
            e = _InstanceBlocks(bit=bit, capacity=max(1, self.default_capacity // self.stride))
            self._inst[instance] = e
            self._by_bit[bit] = instance
            self._clear_pool_caches()
        return e

    def set_capacity(self, instance: str, capacity_blocks: int) -> None:
        if self._later:
            self.flush()
        e = self._entry(instance)
        e.capacity = max(1, capacity_blocks // self.stride)
        self._evict(e, e.capacity)

    def forget(self, instance: str) -> None:
        """Drop an instance (gone from the fleet) and everything it held."""
        if self._later:
            self.flush()
        e = self._inst.pop(instance, None)
        if e is None:
            return
        self._clear(e)
        del self._by_bit[e.bit]
        self._free_bits.append(e.bit)
        self._clear_pool_caches()

    def _clear_pool_caches(self) -> None:
        """Instances came or went: pool bits, hence membership vectors, are stale."""
        self._want_cache.clear()
        self._members.clear()

    def is_exact(self, instance: str, now: float) -> bool:
        if self._later:
            self.flush()
        e = self._inst.get(instance)
        return e is not None and e.exact and now - e.last_event_at <= self.stale_after_s

    def entries(self, instance: str) -> int:
        """Index entries for `instance`: sparse keys from routing, every block from events."""
        if self._later:
            self.flush()
        e = self._inst.get(instance)
        return 0 if e is None else e.held()

    @property
    def total_entries(self) -> int:
        if self._later:
            self.flush()
        return sum(map(len, self._mask))

    def _keys(self, block_hashes: Sequence[int]) -> Sequence[int]:
        s = self.stride
        return block_hashes[s - 1::s] if s > 1 else block_hashes

    # -- updates -----------------------------------------------------------
    def record_route(self, instance: str, block_hashes: Sequence[int], now: float) -> None:
        """The request was sent to `instance`: its blocks will be cached there."""
        if self._later:
            self.flush()
        self._record_route(instance, block_hashes, now)

    def _record_route(self, instance: str, block_hashes: Sequence[int], now: float) -> None:
        e = self._entry(instance)
        self._touch(e, self._keys(block_hashes))
        if not (e.exact and now - e.last_event_at <= self.stale_after_s):  # (`is_exact`, inlined)
            self._evict(e, e.capacity)
        self._bound_total(e)

    def apply_events(self, instance: str, seq: int, events: Iterable[Mapping[str, Any]], now: float) -> None:
        """Engine KV events (vLLM KVEventBatch shape). A sequence number that goes
        backwards means the engine restarted with an empty cache."""
        if self._later:
            self.flush()
        e = self._entry(instance)
        if seq <= e.last_seq:
            self._clear(e)
        e.last_seq = seq
        e.exact = True
        e.last_event_at = now
        for ev in events:
            kind = ev.get("type")
            if kind == "BlockStored":
                self._touch(e, list(ev.get("block_hashes") or ()))
            elif kind == "BlockRemoved":
                self._remove(e, ev.get("block_hashes") or ())
            elif kind == "AllBlocksCleared":
                self._clear(e)
            # Engines report every block; with stride > 1 the non-key hashes are simply
            # never looked up, and they cost memory only until removed.
        self._bound_total(e)

    def _touch(self, e: _InstanceBlocks, keys: Sequence[int]) -> None:
        if not keys:
            return
        self._tick += 1
        tick = self._tick
        distinct, moved = (self._touch_bulk if len(keys) >= BULK_MIN else self._touch_few)(e, keys, tick)
        e.batches[tick] = _packed(keys)
        e.live[tick] = distinct
        e.batch_refs += len(keys)
        if moved:
            self._lose(e, moved)

    def _touch_few(self, e: _InstanceBlocks, keys: Sequence[int], tick: int) -> tuple[int, list[int]]:
        """`keys` (a routed prompt's sparse keys: tens to hundreds) get `tick`, one Python step
        each; (distinct keys, previous ticks of those e held already)."""
        of, lasts, masks, b = _SHARD_OF, e.last, self._mask, 1 << e.bit
        moved: list[int] = []
        for h in keys:
            s = of[h >> _SHIFT & _LOW]
            old = lasts[s].setdefault(h, tick)
            if old is tick:  # new to e (or a repeat of a key just added: its mask has e's bit)
                mask = masks[s]
                m = mask.setdefault(h, b)
                if m is not b and not m & b:  # held by others only: e's bit joins theirs
                    mask[h] = m | b
            else:  # touched again: its previous batch loses it
                lasts[s][h] = tick
                moved.append(old)
        return len(set(keys)), moved

    def _touch_bulk(self, e: _InstanceBlocks, keys: Sequence[int], tick: int) -> tuple[int, list[int]]:
        """`_touch_few` for an engine's batch of stored blocks (hundreds): split once, then C-level
        maps per shard."""
        b = 1 << e.bit
        distinct, moved = 0, []
        for ks, last, mask in zip(_split(keys), e.last, self._mask):
            if not ks:
                continue
            touched = dict.fromkeys(ks, tick)
            distinct += len(touched)
            if not mask.keys().isdisjoint(touched):  # some are indexed already (stored blocks rarely are)
                masks = list(map(mask.get, touched))
                # e holds a key iff its bit is in the key's mask
                held = [m is not None and m & b != 0 for m in masks]
                joins = [m is not None and m & b == 0 for m in masks]
                if any(joins):  # held by others only: e's bit joins theirs (shared prefixes)
                    mask.update(zip(compress(touched, joins), map(b.__or__, compress(masks, joins))))
                # touched again: its previous batch loses it (-1: not held after all, a broken invariant)
                moved += map(last.get, compress(touched, held), repeat(-1))
                mask.update(dict.fromkeys(compress(touched, map(is_, masks, repeat(None))), b))
            else:
                mask.update(dict.fromkeys(touched, b))
            last.update(touched)
        return distinct, moved

    def _lose(self, e: _InstanceBlocks, ticks: list[int]) -> None:
        """References of the batches `ticks` (one per key, repeats) are no longer current: a batch
        with none left goes, one under 1/STALE_RATIO live is filtered (`_shrink`). Only the
        batches named are visited: there is no O(entries) rebuild."""
        first = ticks[0]
        counts = {first: len(ticks)} if ticks.count(first) == len(ticks) else Counter(ticks)
        live, batches = e.live, e.batches
        for tick, n in counts.items():
            left = live.get(tick)
            if left is None:  # (a broken invariant: nothing to count down)
                continue
            left -= n
            if left <= 0:
                del live[tick]
                e.batch_refs -= len(batches.pop(tick))
            else:
                live[tick] = left
                if left * STALE_RATIO < len(batches[tick]):
                    self._shrink(e, tick)

    def _shrink(self, e: _InstanceBlocks, tick: int) -> None:
        """Keep only the live references of batch `tick`, in place (its age does not change)."""
        keys = e.batches[tick]
        of, lasts = _SHARD_OF, e.last
        kept = [h for h in keys if lasts[of[h >> _SHIFT & _LOW]].get(h) == tick]
        e.batch_refs -= len(keys) - len(kept)
        e.batches[tick] = _packed(kept)

    def _remove(self, e: _InstanceBlocks, hashes: Iterable[int]) -> None:
        """Engines remove blocks in batches of thousands (KV events, on the event loop)."""
        if not isinstance(hashes, (list, tuple)):
            hashes = list(hashes)
        ticks = self._drop_bulk(e, _split(hashes)) if len(hashes) >= BULK_MIN else self._drop_few(e, hashes)
        if ticks:
            self._lose(e, ticks)

    def _drop_few(self, e: _InstanceBlocks, keys: Iterable[int], tick: int | None = None) -> list[int]:
        """Take `keys` out of e (those whose last touch is `tick`, when given) and e's bit out of
        their masks, one Python step each; the ticks of the keys e held (one per key)."""
        of, lasts, masks, b = _SHARD_OF, e.last, self._mask, 1 << e.bit
        clear = ~b
        ticks: list[int] = []
        for h in keys:
            s = of[h >> _SHIFT & _LOW]
            last = lasts[s]
            t = last.get(h)
            if t is None or (tick is not None and t != tick):
                continue
            del last[h]
            ticks.append(t)
            mask = masks[s]
            # (every key an instance holds has its bit in the mask; the defaults keep a broken
            # invariant from raising on the event loop)
            m = mask.get(h, b) & clear
            if m:
                mask[h] = m
            else:
                mask.pop(h, None)
        return ticks

    def _drop_bulk(self, e: _InstanceBlocks, parts: list[list[int]]) -> list[int]:
        """`_drop_few` for keys split by shard (`_split`): C-level maps per shard."""
        b = 1 << e.bit
        clear = ~b
        out: list[int] = []
        for gone, last, mask in zip(parts, e.last, self._mask):
            if not gone:
                continue
            ticks = list(map(last.pop, gone, repeat(None)))
            if None in ticks:  # not all held (removals the index never saw, or repeated): only e's count
                held = list(map(is_not, ticks, repeat(None)))
                gone, ticks = list(compress(gone, held)), list(compress(ticks, held))
            masks = list(map(mask.pop, gone, repeat(b)))
            if masks.count(b) < len(masks):  # others hold some too (shared prefixes): they keep theirs
                others = list(map(b.__ne__, masks))
                mask.update(zip(compress(gone, others), map(clear.__and__, compress(masks, others))))
            out += ticks
        return out

    def _evict(self, e: _InstanceBlocks, limit: int) -> None:
        batches = e.batches
        while batches and e.held() > limit:
            tick, keys = batches.popitem(last=False)
            e.live.pop(tick, None)
            e.batch_refs -= len(keys)
            # the keys whose last touch is this batch's (the others were touched again since)
            if len(keys) < BULK_MIN:
                self._drop_few(e, keys, tick)
            else:
                self._drop_bulk(e, [list(set(compress(ks, map(tick.__eq__, map(last.get, ks, repeat(-1))))))
                                    for ks, last in zip(_split(keys), e.last)])

    def _bound_total(self, e: _InstanceBlocks) -> None:
        # A hard memory bound even for exact instances whose engines never evict.
        total = sum(map(len, self._mask))  # (not `total_entries`: this runs inside `flush`)
        if total > self.max_total_blocks:
            self._evict(e, max(0, e.held() - (total - self.max_total_blocks)))

    def _clear(self, e: _InstanceBlocks) -> None:
        self._drop_bulk(e, [list(last) for last in e.last])
        e.batches.clear()
        e.live.clear()
        e.batch_refs = 0

    # -- queries ---------------------------------------------------------
    def _want_mask(self, instances: tuple[str, ...]) -> int:
        """Bits of `instances` (cached, see `_pool_bits`)."""
        return self._pool_bits(instances)[0]

    def _pool_bits(self, instances: tuple[str, ...]) -> tuple[int, np.ndarray, int, int]:
        """(bitmask of `instances`, each one's bit index, bytes that hold every bit, a serial
        naming this pool in `_members`); pools repeat, so the answer is cached until membership
        changes. An instance the index does not know gets a spare bit index that no instance
        holds, so it matches nothing."""
        cached = self._want_cache.get(instances)
        if cached is None:
            spare = max(self._by_bit, default=-1) + 1
            want, bits = 0, []
            for i in instances:
                e = self._inst.get(i)
                bits.append(spare if e is None else e.bit)
                if e is not None:
                    want |= 1 << e.bit
            if len(self._want_cache) > 1024:
                self._clear_pool_caches()
            self._pool_serial += 1
            cached = self._want_cache[instances] = (want, np.array(bits, dtype=np.intp), spare // 8 + 1,
                                                    self._pool_serial)
        return cached

    def _levels(self, keys: Sequence[int], want: int) -> list[tuple[int, int]]:
        """(instances, keys held) for the nested groups of instances in `want` that hold a
        prefix of `keys`: the first group holds keys 0..a0, the next (a subset) up to a1 > a0,
        and so on. An instance's match is the `keys held` of the last group it belongs to."""
        levels: list[tuple[int, int]] = []
        n = len(keys)
        shards, of = self._mask, _SHARD_OF
        mask = shards[of[keys[0] >> _SHIFT & _LOW]].get(keys[0], 0) & want if n else 0
        lo = 0
        while mask:
            # Everyone in `mask` holds block `lo`; find the last block they all hold.
            a, b = lo, n - 1
            while a < b:
                mid = (a + b + 1) >> 1
                h = keys[mid]
                if shards[of[h >> _SHIFT & _LOW]].get(h, 0) & mask == mask:
                    a = mid
                else:
                    b = mid - 1
            levels.append((mask, a + 1))
            lo = a + 1
            mask = shards[of[keys[lo] >> _SHIFT & _LOW]].get(keys[lo], 0) & mask if lo < n else 0
        return levels

    def match(self, block_hashes: Sequence[int], instances: Iterable[str]) -> dict[str, int]:
        """Leading blocks of `block_hashes` held by each of `instances` (0 when none)."""
        if self._later:
            self.flush()
        result = dict.fromkeys(instances, 0)
        want = self._want_mask(tuple(result))
        levels = self._levels(self._keys(block_hashes), want)
        for (mask, held), (inner, _) in zip(levels, [*levels[1:], (0, 0)]):
            dropped = mask & ~inner  # those that hold no further
            while dropped:
                low = dropped & -dropped
                result[self._by_bit[low.bit_length() - 1]] = held * self.stride
                dropped ^= low
        return result

    def match_blocks(self, block_hashes: Sequence[int], instances: tuple[str, ...]) -> np.ndarray:
        """`match` as a float array aligned with `instances`, for the router's vector scoring.

        Instead of walking the bits of every instance (one Python step per candidate), each
        group's bitmask becomes a 0/1 vector over the pool (cached: groups repeat) and the
        vectors are summed, weighted by the blocks each group adds over the previous one: the
        groups are nested, so the sum telescopes to the last group's count. (Sums of whole
        numbers: exact in floating point.)
        """
        if self._later:
            self.flush()
        want, bits, nbytes, serial = self._pool_bits(instances)
        levels = self._levels(self._keys(block_hashes), want)
        if not levels:
            return np.zeros(len(instances))
        members, stride = self._members, self.stride
        matched: np.ndarray | None = None
        below = 0
        for mask, held in levels:
            member = members.get((serial, mask))
            if member is None:
                if len(members) >= MAX_MEMBER_VECTORS:
                    members.clear()
                member = members[(serial, mask)] = np.unpackbits(
                    np.frombuffer(mask.to_bytes(nbytes, "little"), dtype=np.uint8), bitorder="little")[bits] \
                    .astype(float)
            added = member * float((held - below) * stride)
            matched = added if matched is None else matched + added
            below = held
        assert matched is not None
        return matched


def _split(keys: Iterable[int]) -> list[list[int]]:
    """`keys` by shard (the hash's low bits), order kept within each: one Python step per key,
    which lets every dict operation after it run C-level on one shard."""
    parts: list[list[int]] = [[] for _ in range(SHARDS)]
    of = _SHARD_OF
    for h in keys:
        parts[of[h >> _SHIFT & _LOW]].append(h)
    return parts


def _packed(keys: Sequence[int]) -> Sequence[int]:
    """A batch's keys as one flat array of unsigned 64-bit ints (the block hashes'
    range), which the garbage collector does not track: kept as tuples or lists, every
    collection walked each key of every batch held (a young collection during a decision
    took 3-10 ms). Keys outside that range (another hash function's) stay a tuple."""
    try:
        return array("Q", keys)
    except (OverflowError, TypeError):
        return tuple(keys)
