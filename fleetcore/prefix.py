"""Chained prefix block hashes: the identity of a KV-cache block.

A block's hash covers its parent's hash and its own token ids, so equal hashes
mean equal prefixes up to and including that block. The gateway, the simulated
engine and the cache index all call this one function.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

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
    if not full:
        return out
    # Each block hashes its parent's hash (a native uint64) and its ids (native unsigned ints):
    # the ids of all full blocks made bytes in one go, each block's cut from them (one array
    # and one bytes object a request, not two arrays and three bytes objects a block).
    ids = array("I", token_ids[:full]).tobytes()
    step = block_size * _ID_BYTES
    digest = xxhash.xxh64_intdigest
    for start in range(0, len(ids), step):
        # (`array("Q", [h]).tobytes()`: a uint64 in native order, OverflowError outside it)
        h = digest(h.to_bytes(8, _ORDER) + ids[start:start + step])
        out.append(h)
    return out


_ID_BYTES = array("I").itemsize
_ORDER = sys.byteorder
assert array("Q").itemsize == 8


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
