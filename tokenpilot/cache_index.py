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
"""

from __future__ import annotations

from array import array
from collections import deque
from itertools import repeat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAX_LATER = 1024  # deferred route records kept before they are applied anyway (a bound on memory)
# Pool membership vectors of match groups kept (`match_blocks`): a few MB at 64-256 instances.
MAX_MEMBER_VECTORS = 4096
STALE_SLACK = 1024  # batches are rebuilt when their references exceed 4x the entries plus this


@dataclass(slots=True)
class _InstanceBlocks:
    """One instance's entries with an LRU kept in batches, one batch per request or event.

    `last` maps entry -> the tick that last touched it; `batches` holds (tick, keys)
    in touch order. Touching a whole request is one C-level dict update plus one
    append; eviction pops the oldest batch and drops only the keys whose last touch
    is still that batch's tick. A request's blocks thus age and leave together, and a
    prefix that a newer request touched stays: prefix closure holds.
    """

    bit: int
    capacity: int
    last: dict[int, int] = field(default_factory=dict)
    batches: deque[tuple[int, Sequence[int]]] = field(default_factory=deque)
    batch_refs: int = 0
    exact: bool = False
    last_event_at: float = float("-inf")
    last_seq: int = -1


class PrefixCacheIndex:
    def __init__(self, default_capacity_blocks: int = 1 << 16, stale_after_s: float = 30.0,
                 max_total_blocks: int = 4_000_000, stride: int = 8) -> None:
        if stride < 1:
            raise ValueError("stride must be >= 1")
        self.stride = stride
        self.default_capacity = default_capacity_blocks
        self.stale_after_s = stale_after_s
        self.max_total_blocks = max_total_blocks
        self._mask: dict[int, int] = {}
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
        return 0 if e is None else len(e.last)

    @property
    def total_entries(self) -> int:
        if self._later:
            self.flush()
        return len(self._mask)

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
        last = e.last
        new = set(keys).difference(last)
        last.update(dict.fromkeys(keys, self._tick))
        e.batches.append((self._tick, _packed(keys)))
        e.batch_refs += len(keys)
        if new:
            self._set_bit(new, e.bit)
        if e.batch_refs > 4 * len(last) + STALE_SLACK:
            self._compact(e)

    def _compact(self, e: _InstanceBlocks) -> None:
        """Rebuild the batch queue from live entries when stale references pile up."""
        by_tick: dict[int, list[int]] = {}
        for h, t in e.last.items():
            by_tick.setdefault(t, []).append(h)
        e.batches = deque([(t, _packed(keys)) for t, keys in sorted(by_tick.items())])
        e.batch_refs = len(e.last)

    def _remove(self, e: _InstanceBlocks, hashes: Iterable[int]) -> None:
        """Engines remove blocks in batches of thousands (KV events, on the event loop): set
        operations and C-level maps do the bulk; only keys other instances hold too (shared
        prefixes, few) take a Python step each."""
        gone = e.last.keys() & hashes
        if not gone:
            return
        deque(map(e.last.__delitem__, gone), 0)
        mask, b = self._mask, 1 << e.bit
        # (every key an instance holds has its bit in the mask; `get` with b and `pop` with a
        # default keep a broken invariant from raising on the event loop)
        shared = [h for h, m in zip(gone, map(mask.get, gone, repeat(b))) if m != b]
        if shared:
            gone.difference_update(shared)
            clear = ~b
            for h in shared:
                m = mask[h] & clear
                if m:
                    mask[h] = m
                else:
                    del mask[h]
        deque(map(mask.pop, gone, repeat(None)), 0)

    def _set_bit(self, hashes: set[int], bit: int) -> None:
        """Add `bit` to the masks of `hashes`. Most of a request's new keys are new to the
        whole index (nobody holds them): those go in with one C-level update, and only keys
        other instances hold too take a Python step each."""
        mask, b = self._mask, 1 << bit
        fresh = hashes.difference(mask)  # (set.difference probes a dict; set.intersection would scan it)
        mask.update(dict.fromkeys(fresh, b))
        if len(fresh) < len(hashes):
            for h in hashes.difference(fresh):
                mask[h] |= b

    def _unset(self, h: int, bit: int) -> None:
        m = self._mask.get(h, 0) & ~(1 << bit)
        if m:
            self._mask[h] = m
        else:
            self._mask.pop(h, None)

    def _evict(self, e: _InstanceBlocks, limit: int) -> None:
        last, batches = e.last, e.batches
        while len(last) > limit and batches:
            tick, keys = batches.popleft()
            e.batch_refs -= len(keys)
            # (`_unset` inlined: this loop runs for every evicted key of every routed request)
            mask, clear = self._mask, ~(1 << e.bit)
            held, mask_of = last.get, mask.get
            for h in keys:
                if held(h) == tick:
                    del last[h]
                    m = mask_of(h, 0) & clear
                    if m:
                        mask[h] = m
                    else:
                        mask.pop(h, None)

    def _bound_total(self, e: _InstanceBlocks) -> None:
        # A hard memory bound even for exact instances whose engines never evict.
        if len(self._mask) > self.max_total_blocks:
            self._evict(e, max(0, len(e.last) - (len(self._mask) - self.max_total_blocks)))

    def _clear(self, e: _InstanceBlocks) -> None:
        for h in e.last:
            self._unset(h, e.bit)
        e.last.clear()
        e.batches.clear()
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
        get = self._mask.get
        mask = get(keys[0], 0) & want if n else 0
        lo = 0
        while mask:
            # Everyone in `mask` holds block `lo`; find the last block they all hold.
            a, b = lo, n - 1
            while a < b:
                mid = (a + b + 1) >> 1
                if get(keys[mid], 0) & mask == mask:
                    a = mid
                else:
                    b = mid - 1
            levels.append((mask, a + 1))
            mask, lo = (get(keys[a + 1], 0) & mask if a + 1 < n else 0), a + 1
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


def _packed(keys: Sequence[int]) -> Sequence[int]:
    """A batch's keys as one flat array of unsigned 64-bit ints (the block hashes'
    range), which the garbage collector does not track: kept as tuples or lists, every
    collection walked each key of every batch held (a young collection during a decision
    took 3-10 ms). Keys outside that range (another hash function's) stay a tuple."""
    try:
        return array("Q", keys)
    except (OverflowError, TypeError):
        return tuple(keys)
