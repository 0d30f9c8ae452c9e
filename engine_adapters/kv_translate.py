"""Translate an engine's KV block hashes into the gateway's own chained block hashes.

Why: vLLM names a block by a hash the gateway cannot recompute (sha256 over a
random per-process seed, token ids and extra keys such as LoRA or cache salt),
and SGLang by yet another. The gateway's cache index is keyed by
`fleetcore.prefix.block_hashes` over token ids, the same function it applies to
every incoming request. So for each engine instance we keep a map

    engine block hash -> our hash(es)

built from the events themselves: a `BlockStored` event carries the blocks'
token ids and the engine hash of the parent block. Our hash of the first stored
block is the chained xxhash of (our hash of the parent, its tokens); the next
chains on from it, and so on. Because our chain is computed over the same token
ids the gateway gets from the model's tokenizer (`fleetcore.model_tokenizer`),
a request's block hashes equal the keys that the engine's events put in the index,
block for block. `BlockRemoved` looks the engine hashes up, emits ours, and forgets
them; `AllBlocksCleared` and an engine restart (sequence number going backwards)
empty the map.

The gateway's block may be smaller than the engine's when it divides it (an engine
block then stands for several index keys); equal sizes are the normal case
(the vLLM adapter passes the model's block size to the engine).

Blocks whose parent we never saw (the gateway started after the engine had
cached them, or a batch was lost) cannot be chained and are skipped: the index
then underestimates that instance's cache, which costs affinity, never correctness.
Extra keys (LoRA name, multimodal hashes, cache salt) are not part of our hash:
blocks that differ only by them share one key. Blocks held outside device memory
(`medium` CPU/disk offload tiers) and KV cache groups other than the first
(hybrid models) are left out: the index describes the prefix cache a request can
hit without a load.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fleetcore.prefix import ROOT_HASH, block_hashes

# A runaway map (BlockRemoved events lost for a long time) is dropped whole rather
# than allowed to grow without bound; the next events rebuild it.
MAX_ENTRIES = 2_000_000
_DEVICE_MEDIA = (None, "GPU", "gpu", "device")


@dataclass(slots=True)
class TranslatorStats:
    batches: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    restarts: int = 0
    gaps: int = 0  # batches missing between two we saw
    orphan_blocks: int = 0  # stored blocks whose parent we never saw
    foreign_blocks: int = 0  # other medium / KV group / block size: not indexed
    unknown_removed: int = 0


class BlockHashTranslator:
    """One engine instance's engine-hash -> our-hash map (see the module doc)."""

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.stats = TranslatorStats()
        self._ours: dict[Hashable, tuple[int, ...]] = {}
        self._last_seq = -1

    def __len__(self) -> int:
        return len(self._ours)

    def our_hashes(self) -> set[int]:
        """Every index key this engine holds right now, as far as its events tell."""
        return {h for hs in self._ours.values() for h in hs}

    def reset(self) -> None:
        self._ours.clear()

    def translate(self, seq: int, events: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The batch's events re-keyed with our hashes, in the shape the cache index reads."""
        st = self.stats
        st.batches += 1
        if seq <= self._last_seq:
            st.restarts += 1  # the engine restarted: its cache (and our map of it) is empty
            self.reset()
        elif self._last_seq >= 0 and seq > self._last_seq + 1:
            st.gaps += 1
        self._last_seq = seq
        out: list[dict[str, Any]] = []
        for ev in events:
            kind = ev.get("type")
            if kind == "BlockStored":
                stored = self._stored(ev)
                if stored:
                    out.append({"type": "BlockStored", "block_hashes": stored})
            elif kind == "BlockRemoved":
                removed = self._removed(ev)
                if removed:
                    out.append({"type": "BlockRemoved", "block_hashes": removed})
            elif kind == "AllBlocksCleared":
                st.cleared += 1
                self.reset()
                out.append({"type": "AllBlocksCleared"})
        if len(self._ours) > MAX_ENTRIES:
            self.reset()
            out.append({"type": "AllBlocksCleared"})
        return out

    def _indexed(self, ev: Mapping[str, Any]) -> bool:
        return (ev.get("medium") in _DEVICE_MEDIA and ev.get("group_idx") in (None, 0)
                and ev.get("locality") in (None, "LOCAL"))

    def _stored(self, ev: Mapping[str, Any]) -> list[int]:
        engine_hashes: Sequence[Hashable] = [_key(h) for h in ev.get("block_hashes") or ()]
        tokens: Sequence[int] = ev.get("token_ids") or ()
        engine_bs = int(ev.get("block_size") or 0)
        if not engine_hashes:
            return []
        if (not self._indexed(ev) or engine_bs <= 0 or engine_bs % self.block_size
                or len(tokens) < engine_bs * len(engine_hashes)):
            self.stats.foreign_blocks += len(engine_hashes)
            return []
        parent_engine = ev.get("parent_block_hash")
        if parent_engine is None:
            parent = ROOT_HASH
        else:
            chain = self._ours.get(_key(parent_engine))
            if chain is None:
                self.stats.orphan_blocks += len(engine_hashes)
                return []
            parent = chain[-1]
        out: list[int] = []
        for i, eh in enumerate(engine_hashes):
            ours = tuple(block_hashes(tokens[i * engine_bs:(i + 1) * engine_bs], self.block_size, parent))
            self._ours[eh] = ours
            out.extend(ours)
            parent = ours[-1]
        self.stats.stored_blocks += len(engine_hashes)
        return out

    def _removed(self, ev: Mapping[str, Any]) -> list[int]:
        if not self._indexed(ev):
            return []
        out: list[int] = []
        for h in ev.get("block_hashes") or ():
            ours = self._ours.pop(_key(h), None)
            if ours is None:
                self.stats.unknown_removed += 1
            else:
                out.extend(ours)
                self.stats.removed_blocks += 1
        return out


def _key(h: Any) -> Hashable:
    """Engine hashes arrive as ints or bytes (vLLM's sha256 mode); keep them hashable."""
    return bytes(h) if isinstance(h, (bytearray, memoryview)) else h
