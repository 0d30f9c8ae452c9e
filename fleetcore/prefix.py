"""Chained prefix block hashes: the identity of a KV-cache block.

A block's hash covers its parent's hash and its own token ids, so equal hashes
mean equal prefixes up to and including that block. The gateway, the simulated
engine and the cache index all call this one function.
"""

from __future__ import annotations

from collections.abc import Sequence
from array import array

import xxhash

ROOT_HASH = 0
DEFAULT_BLOCK_SIZE = 16


def block_hashes(token_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE,
                 parent: int = ROOT_HASH) -> list[int]:
    """Hashes of every *full* block of `token_ids` (a partial tail block is not cacheable)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    out: list[int] = []
    h = parent
    full = len(token_ids) - len(token_ids) % block_size
    for start in range(0, full, block_size):
        data = array("Q", [h]).tobytes() + array("I", token_ids[start:start + block_size]).tobytes()
        h = xxhash.xxh64_intdigest(data)
        out.append(h)
    return out


def synthetic_block_hashes(block_ids: Sequence[int], sub_blocks: int,
                           parent: int = ROOT_HASH) -> list[int]:
    """Chained hashes for a trace that names its prefix blocks by id (Mooncake `hash_ids`).

    Each trace block expands to `sub_blocks` engine blocks (512-token trace blocks
    over 16-token engine blocks gives 32). Equal id sequences give equal hashes.
    """
    out: list[int] = []
    h = parent
    for bid in block_ids:
        for i in range(sub_blocks):
            h = xxhash.xxh64_intdigest(array("Q", [h, bid & 0xFFFFFFFFFFFFFFFF, i]).tobytes())
            out.append(h)
    return out
