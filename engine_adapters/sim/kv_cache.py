"""Paged KV block manager with a prefix cache (vLLM V1 semantics, no tensors).

Blocks are ints 0..num_blocks-1. A block is in exactly one of three states:
  * referenced by >= 1 sequence (ref count > 0);
  * free and cached: holds a registered prefix hash, evictable, kept in an LRU
    (OrderedDict, least recently freed first);
  * free and uncached: in a plain free list.
New blocks come from the free list first, then by evicting the LRU head, so a
cached prefix survives as long as there is uncached space to use.

Prefix identity is the chained block hash the caller supplies, one per FULL
prompt block (parent hash folded in, DESIGN.md principle 3). Blocks written by
decode are never cached: the engine does not know the generated tokens' hash,
and vLLM only reuses them when the same output text comes back as a prompt,
which the simulator cannot know either.

All per-block work is O(1) (dict / OrderedDict operations). Events can be
switched off for simulations that never read them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Literal

KVEventKind = Literal["stored", "removed", "all_cleared"]


@dataclass(slots=True)
class KVEvent:
    """Mirror of vLLM's BlockStored / BlockRemoved / AllBlocksCleared."""

    kind: KVEventKind
    block_hashes: list[int] = field(default_factory=list)
    parent_block_hash: int | None = None
    block_size: int = 16


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_events: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_events = enable_events
        self._ref = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._lru: OrderedDict[int, None] = OrderedDict()  # free cached block ids, LRU first
        # Pop from the end; reversed so block 0 is handed out first (readable tests).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._seq_blocks: dict[Hashable, list[int]] = {}
        self._seq_hashes: dict[Hashable, Sequence[int]] = {}
        self._seq_committed: dict[Hashable, int] = {}  # leading blocks already in the cache
        self._events: list[KVEvent] = []
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0

    # -- queries ------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks not referenced by any sequence (uncached + evictable cached)."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks referenced by running sequences (vllm:kv_cache_usage_perc)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def match_prefix(self, block_hashes: Sequence[int]) -> int:
        """Leading blocks of ``block_hashes`` present in the cache. No side effects."""
        cached = self._cached
        n = 0
        for h in block_hashes:
            if h not in cached:
                break
            n += 1
        return n

    def blocks_of(self, seq_id: Hashable) -> list[int]:
        """The block ids a sequence holds (what vLLM's P/D connector hands the decode side)."""
        return list(self._seq_blocks.get(seq_id, ()))

    def num_blocks_of(self, seq_id: Hashable) -> int:
        blocks = self._seq_blocks.get(seq_id)
        return len(blocks) if blocks is not None else 0

    # -- allocation -----------------------------------------------------------

    def allocate_prompt(
        self,
        seq_id: Hashable,
        block_hashes: Sequence[int],
        num_prompt_tokens: int,
        max_new_tokens: int | None = None,
    ) -> int | None:
        """Admit a sequence: reference its cached prefix, allocate its first chunk.

        Blocks are allocated for cached + min(max_new_tokens, rest) tokens
        (all of the prompt when max_new_tokens is None); later chunks and decode
        grow with ensure_capacity. At least one prompt token is always
        recomputed (its logits are needed), as in vLLM. Returns the number of
        cached tokens, or None, changing nothing, when the blocks can't be had.
        Counts prefix queries/hits in tokens on success.
        """
        if seq_id in self._seq_blocks:
            raise ValueError(f"sequence {seq_id!r} already allocated")
        bs = self.block_size
        cached = self._cached
        ref = self._ref
        max_cached_blocks = (num_prompt_tokens - 1) // bs
        hit_ids: list[int] = []
        revived = 0  # matched blocks currently free in the LRU: not free after we take them
        for h in block_hashes:
            if len(hit_ids) >= max_cached_blocks:
                break
            b = cached.get(h)
            if b is None:
                break
            hit_ids.append(b)
            if ref[b] == 0:
                revived += 1
        cached_tokens = len(hit_ids) * bs
        rest = num_prompt_tokens - cached_tokens
        new_tokens = rest if max_new_tokens is None else min(rest, max_new_tokens)
        need = -(-(cached_tokens + new_tokens) // bs) - len(hit_ids)
        if need > self.num_free_blocks - revived:
            return None
        lru = self._lru
        for b in hit_ids:
            if ref[b] == 0:
                del lru[b]
            ref[b] += 1
        blocks = hit_ids
        if need > 0:
            self._take(blocks, need)
        self._seq_blocks[seq_id] = blocks
        self._seq_hashes[seq_id] = block_hashes
        self._seq_committed[seq_id] = cached_tokens // bs
        self.prefix_queries_tokens += num_prompt_tokens
        self.prefix_hits_tokens += cached_tokens
        return cached_tokens

    def ensure_capacity(self, seq_id: Hashable, total_tokens: int) -> bool:
        """Grow the sequence's blocks to hold total_tokens; False (no change) if short."""
        blocks = self._seq_blocks[seq_id]
        need = -(-total_tokens // self.block_size) - len(blocks)
        if need <= 0:
            return True
        if need > len(self._free) + len(self._lru):
            return False
        self._take(blocks, need)
        return True

    def _take(self, out: list[int], n: int) -> None:
        """Append n fresh blocks (ref 1) to out; evicts LRU cached blocks if needed."""
        free = self._free
        ref = self._ref
        k = min(n, len(free))
        if k:
            got = free[-k:]
            del free[-k:]
            for b in got:
                ref[b] = 1
            out.extend(got)
            n -= k
        if n:
            lru = self._lru
            cached = self._cached
            hash_of = self._hash_of
            popitem = lru.popitem
            evicted = [popitem(False)[0] for _ in range(n)]
            removed = [hash_of[b] for b in evicted]
            for b, h in zip(evicted, removed):
                hash_of[b] = None
                del cached[h]
                ref[b] = 1
            out.extend(evicted)
            if self.enable_events:
                self._events.append(KVEvent("removed", removed, None, self.block_size))

    def commit_full_blocks(self, seq_id: Hashable, num_computed_tokens: int) -> int:
        """Register the sequence's full, computed prompt blocks in the prefix cache.

        Call as prefill progresses. Only blocks with a caller-supplied hash are
        registered (prompt blocks); a hash already cached by another sequence
        leaves this copy uncached (it is freed to the plain pool later). Emits
        one "stored" event per contiguous run of new hashes. Returns the number
        of blocks newly registered.
        """
        hashes = self._seq_hashes[seq_id]
        start = self._seq_committed[seq_id]
        end = min(num_computed_tokens // self.block_size, len(hashes))
        if end <= start:
            return 0
        blocks = self._seq_blocks[seq_id]
        cached = self._cached
        hash_of = self._hash_of
        events = self.enable_events
        run: list[int] = []
        run_parent: int | None = None
        added = 0
        for i in range(start, end):
            h = hashes[i]
            if h in cached:
                if run:
                    self._events.append(KVEvent("stored", run, run_parent, self.block_size))
                    run = []
                continue
            b = blocks[i]
            cached[h] = b
            hash_of[b] = h
            added += 1
            if events:
                if not run:
                    run_parent = hashes[i - 1] if i > 0 else None
                run.append(h)
        if run and events:
            self._events.append(KVEvent("stored", run, run_parent, self.block_size))
        self._seq_committed[seq_id] = end
        return added

    def free(self, seq_id: Hashable) -> None:
        """Drop the sequence's references. Cached blocks at ref 0 join the LRU
        tail (tail block first, so a shared prefix's leaves are evicted before
        its root, as in vLLM); uncached ones return to the free list."""
        blocks = self._seq_blocks.pop(seq_id, None)
        if blocks is None:
            return
        del self._seq_hashes[seq_id]
        del self._seq_committed[seq_id]
        ref = self._ref
        hash_of = self._hash_of
        lru = self._lru
        free = self._free
        for b in reversed(blocks):
            r = ref[b] - 1
            ref[b] = r
            if r == 0:
                if hash_of[b] is None:
                    free.append(b)
                else:
                    lru[b] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any block is referenced."""
        if self.num_free_blocks != self.num_blocks:
            return False
        hash_of = self._hash_of
        for b in self._lru:
            hash_of[b] = None
        self._free.extend(self._lru)
        self._lru.clear()
        self._cached.clear()
        if self.enable_events:
            self._events.append(KVEvent("all_cleared", [], None, self.block_size))
        return True

    def drain_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
