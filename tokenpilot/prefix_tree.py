"""Approximate per-instance prefix trees over chained KV block hashes.

Published routers that run without engine KV events (SGLang's approximate radix
tree, Dynamo's ApproxKvIndexer and ActiveSequences, the llm-d/GIE prefix indexer,
AIBrix's prefix hash table) guess an engine's cache from their own routing
history: a prompt sent to an instance is assumed cached there until evicted.
This module holds that guess for `tokenpilot.peers`.

Shape. A block hash chains its parent's hash (`fleetcore.prefix`), so one hash
names a whole prefix and the blocks an instance holds form a tree. `BlockTree`
is a radix tree over block hashes: a node is a run of consecutive blocks, and a
node's children are keyed by their first block. Because hashes chain, a prompt
that agrees with a run at some depth agrees with it at every shallower depth, so
the point where a prompt leaves a run is found by binary search, and matching
costs O(nodes on the path x log run length) - not O(blocks). Inserting a prompt
copies its new blocks into one list (C speed) and stamps the nodes on its path.

Eviction is LRU over leaves, as SGLang's `evict_tenant_by_size`: an insert stamps
every node on its path with `now`, so a parent is never older than its children
and the least recently used node is always a leaf. A leaf is trimmed from its
tail when only part of it must go, so block bounds are exact, and what remains
is always prefix-closed (a block's parent is held whenever the block is).

`PrefixIndex` is the routers' cache guess: one tree per instance, bounded per
instance (`max_blocks_per_instance`), across instances (`max_blocks_total`,
pruned to `prune_ratio` of it when exceeded, as Dynamo prunes) and by idle time
(`ttl_s`). `ActiveBlocks` counts the distinct blocks of the requests running on
an instance (Dynamo's ActiveSequences with kv reuse). Cost: about 45 bytes per
held block (a list slot and its 64-bit int) plus ~250 bytes per node.
Pure: time comes in as `now`, never from a clock.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from itertools import count



class _Node:
    __slots__ = ("blocks", "start", "parent", "children", "last", "refs", "alive")

    def __init__(self, blocks: list[int], start: int, parent: _Node | None, last: float) -> None:
        self.blocks = blocks          # consecutive block hashes, root side first
        self.start = start            # depth (position in any prompt) of blocks[0]
        self.parent = parent
        self.children: dict[int, _Node] = {}   # keyed by the child's first block
        self.last = last              # last time a path through this node was inserted
        self.refs = 0                 # requests holding this node (ActiveBlocks only)
        self.alive = True


class BlockTree:
    """Radix tree of the block hashes one instance holds (see module docstring)."""

    def __init__(self, *, lru: bool = True) -> None:
        self.root = _Node([], 0, None, float("-inf"))
        self.size = 0                       # held blocks
        self._lru = lru
        self._heap: list[tuple[float, int, _Node]] = []   # leaves by last use (lazy)
        self._seq = count()
        self._nodes = 0

    def _walk(self, blocks: Sequence[int]) -> tuple[int, _Node, int]:
        """(matched blocks, last node reached, how many of its blocks matched)."""
        node, pos, n = self.root, 0, len(blocks)
        while pos < n:
            child = node.children.get(blocks[pos])
            if child is None:
                break
            run = child.blocks
            end = min(len(run), n - pos)
            if run[end - 1] == blocks[pos + end - 1]:
                k = end
            else:                        # run[lo] agrees, run[hi] does not
                lo, hi = 0, end - 1
                while hi - lo > 1:
                    mid = (lo + hi) >> 1
                    if run[mid] == blocks[pos + mid]:
                        lo = mid
                    else:
                        hi = mid
                k = hi
            pos += k
            if k < len(run):
                return pos, child, k
            node = child
        return pos, node, len(node.blocks)

    def match(self, blocks: Sequence[int]) -> int:
        """Number of leading `blocks` held (longest cached prefix)."""
        return self._walk(blocks)[0] if blocks else 0

    def insert(self, blocks: Sequence[int], now: float) -> _Node:
        """Hold `blocks` (root first); returns the node the prompt ends in (at its last block)."""
        if not blocks:
            return self.root
        m, end, used = self._walk(blocks)
        if used < len(end.blocks):       # the prompt leaves `end` mid-run: split it there
            end = self._split(end, used)
        n = len(blocks)
        if m < n:
            node = _Node(list(blocks[m:]), m, end, now)
            end.children[blocks[m]] = node
            self.size += n - m
            self._nodes += 1
            end = node
        node = end
        while node is not self.root:   # stamp the path: parents never older than children
            node.last = now
            node = node.parent  # type: ignore[assignment]
        if self._lru and not end.children:
            self._push(end)
        return end

    def _split(self, node: _Node, keep: int) -> _Node:
        """Cut `node` after `keep` blocks: a new head node takes them, `node` keeps the tail.

        The tail keeps its identity so handles to the node a prompt ends in stay valid.
        """
        parent = node.parent
        assert parent is not None
        head = _Node(node.blocks[:keep], node.start, parent, node.last)
        head.refs = node.refs           # every path through node covers all of it
        parent.children[head.blocks[0]] = head
        del node.blocks[:keep]
        node.start += keep
        node.parent = head
        head.children[node.blocks[0]] = node
        self._nodes += 1
        return head

    def _push(self, leaf: _Node) -> None:
        heapq.heappush(self._heap, (leaf.last, next(self._seq), leaf))
        if len(self._heap) > 4 * self._nodes + 64:   # drop stale entries now and then
            self._heap = [e for e in self._heap
                          if e[2].alive and not e[2].children and e[2].last == e[0]]
            heapq.heapify(self._heap)

    def _remove_leaf(self, leaf: _Node) -> None:
        self.size -= len(leaf.blocks)
        self._nodes -= 1
        leaf.alive = False
        parent = leaf.parent
        assert parent is not None
        del parent.children[leaf.blocks[0]]
        if self._lru and parent is not self.root and not parent.children:
            self._push(parent)

    def oldest_leaf(self) -> _Node | None:
        """The least recently used leaf (drops stale heap entries on the way)."""
        heap = self._heap
        while heap:
            t, _, node = heap[0]
            if node.alive and not node.children and node.last == t:
                return node
            heapq.heappop(heap)
        return None

    def evict(self, nblocks: int) -> int:
        """Evict `nblocks` least recently used blocks, deepest first; returns how many went."""
        gone = 0
        while gone < nblocks:
            leaf = self.oldest_leaf()
            if leaf is None:
                break
            gone += self._evict_from(leaf, nblocks - gone)
        return gone

    def _evict_from(self, leaf: _Node, nblocks: int) -> int:
        """Evict up to `nblocks` from the tail of `leaf`, the current oldest leaf."""
        size = len(leaf.blocks)
        if size <= nblocks:
            heapq.heappop(self._heap)
            self._remove_leaf(leaf)
            return size
        del leaf.blocks[size - nblocks:]   # the rest stays a valid leaf, same age
        self.size -= nblocks
        return nblocks

    def expire(self, horizon: float) -> int:
        """Evict every leaf last used before `horizon` (whole nodes); returns blocks gone."""
        gone = 0
        while True:
            leaf = self.oldest_leaf()
            if leaf is None or leaf.last >= horizon:
                return gone
            gone += len(leaf.blocks)
            heapq.heappop(self._heap)
            self._remove_leaf(leaf)

    def held_blocks(self) -> set[int]:
        """Every held block hash (for tests and debugging; O(size))."""
        out: set[int] = set()
        stack = [self.root]
        while stack:
            node = stack.pop()
            out.update(node.blocks)
            stack.extend(node.children.values())
        return out

    # -- reference counting (ActiveBlocks) --

    def acquire(self, blocks: Sequence[int], now: float) -> _Node:
        end = self.insert(blocks, now)
        node = end
        while node is not self.root:
            node.refs += 1
            node = node.parent  # type: ignore[assignment]
        return end

    def release(self, end: _Node) -> None:
        """Undo one `acquire` whose returned node was `end`."""
        node: _Node | None = end
        while node is not None and node is not self.root:
            parent = node.parent
            node.refs -= 1
            if node.refs <= 0 and not node.children and node.alive:   # nobody holds it
                self._remove_leaf(node)
            node = parent


class PrefixIndex:
    """Which prefix blocks each instance probably caches, learned from routing history."""

    def __init__(self, *, max_blocks_per_instance: int | None = None,
                 max_blocks_total: int | None = None, prune_ratio: float = 1.0,
                 ttl_s: float | None = None, expire_every_s: float = 1.0) -> None:
        for label, bound in (("max_blocks_per_instance", max_blocks_per_instance),
                             ("max_blocks_total", max_blocks_total)):
            if bound is not None and bound <= 0:
                raise ValueError(f"{label} must be positive")
        if not 0.0 < prune_ratio <= 1.0:
            raise ValueError("prune_ratio must be in (0, 1]")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self.max_blocks_per_instance = max_blocks_per_instance
        self.max_blocks_total = max_blocks_total
        self.prune_ratio = prune_ratio
        self.ttl_s = ttl_s
        self.expire_every_s = expire_every_s   # TTL sweeps at most this often (AIBrix: 1 s)
        self._next_expire = float("-inf")
        self._trees: dict[str, BlockTree] = {}
        self._total = 0

    def tree(self, instance_id: str) -> BlockTree | None:
        return self._trees.get(instance_id)

    @property
    def total_blocks(self) -> int:
        return self._total

    def size(self, instance_id: str) -> int:
        """Blocks attributed to the instance (SGLang's tree size, Dynamo's tree_sizes)."""
        tree = self._trees.get(instance_id)
        return tree.size if tree is not None else 0

    def match(self, instance_id: str, blocks: Sequence[int]) -> int:
        """Number of leading `blocks` the instance probably caches."""
        tree = self._trees.get(instance_id)
        return tree.match(blocks) if tree is not None else 0

    def match_many(self, instance_ids: Iterable[str], blocks: Sequence[int]) -> list[int]:
        trees = self._trees
        out = []
        for iid in instance_ids:
            tree = trees.get(iid)
            out.append(tree.match(blocks) if tree is not None else 0)
        return out

    def insert(self, instance_id: str, blocks: Sequence[int], now: float) -> None:
        """Record that the instance now caches `blocks` (root first), used at `now`."""
        if not blocks:
            return
        tree = self._trees.get(instance_id)
        if tree is None:
            tree = self._trees[instance_id] = BlockTree()
        before = tree.size
        tree.insert(blocks, now)
        self._total += tree.size - before
        cap = self.max_blocks_per_instance
        if cap is not None and tree.size > cap:
            self._total -= tree.evict(tree.size - cap)
        if self.max_blocks_total is not None and self._total > self.max_blocks_total:
            self._prune(int(self.max_blocks_total * self.prune_ratio))

    def _prune(self, target: int) -> None:
        """Evict the globally least recently used blocks until `target` remain."""
        while self._total > target:
            best: tuple[float, BlockTree, _Node] | None = None
            for tree in self._trees.values():
                leaf = tree.oldest_leaf()
                if leaf is not None and (best is None or leaf.last < best[0]):
                    best = (leaf.last, tree, leaf)
            if best is None:
                return
            _, tree, leaf = best
            self._total -= tree._evict_from(leaf, self._total - target)

    def expire(self, now: float) -> int:
        """Drop entries idle for longer than `ttl_s`; returns how many blocks went."""
        if self.ttl_s is None or now < self._next_expire:
            return 0
        self._next_expire = now + self.expire_every_s
        gone = sum(tree.expire(now - self.ttl_s) for tree in self._trees.values())
        self._total -= gone
        return gone

    def remove_instance(self, instance_id: str) -> None:
        tree = self._trees.pop(instance_id, None)
        if tree is not None:
            self._total -= tree.size


class ActiveBlocks:
    """Distinct prompt blocks of the requests in flight per instance, shared blocks once.

    Dynamo's ActiveSequences with `router_assume_kv_reuse`: a block held by several
    running requests counts once and is released with the last of them.
    """

    def __init__(self) -> None:
        self._trees: dict[str, BlockTree] = {}

    def tree(self, instance_id: str) -> BlockTree | None:
        return self._trees.get(instance_id)

    def count(self, instance_id: str) -> int:
        tree = self._trees.get(instance_id)
        return tree.size if tree is not None else 0

    def shared(self, instance_id: str, blocks: Sequence[int]) -> int:
        """Leading `blocks` already held by running requests on the instance."""
        tree = self._trees.get(instance_id)
        return tree.match(blocks) if tree is not None else 0

    def add(self, instance_id: str, blocks: Sequence[int], now: float) -> object:
        """Hold `blocks` for a new request; returns the handle `remove` takes."""
        tree = self._trees.get(instance_id)
        if tree is None:
            tree = self._trees[instance_id] = BlockTree(lru=False)
        return tree.acquire(blocks, now)

    def remove(self, instance_id: str, handle: object) -> None:
        tree = self._trees.get(instance_id)
        if tree is not None and isinstance(handle, _Node):
            tree.release(handle)
