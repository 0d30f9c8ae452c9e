"""fleetcore.prefix.block_hashes: the chained hash of each full block, exactly as specified (the
parent's hash as a native uint64, then the block's ids as native uint32s, xxh64), whatever way
the bytes are assembled: every cache key of the gateway, the sim engine and the index rests on it."""

from __future__ import annotations

import struct

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetcore.prefix import block_hashes


def _spec(ids: list[int], block_size: int, parent: int) -> list[int]:
    out, h = [], parent
    for start in range(0, len(ids) - block_size + 1, block_size):
        h = xxhash.xxh64_intdigest(struct.pack("=Q", h) + struct.pack(f"={block_size}I", *ids[start:start + block_size]))
        out.append(h)
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=70), st.integers(1, 20), st.integers(0, 2**64 - 1))
def test_block_hashes_follow_the_spec(ids: list[int], block_size: int, parent: int) -> None:
    assert block_hashes(ids, block_size, parent) == _spec(ids, block_size, parent)


def test_pinned_values() -> None:
    """Values computed by the implementation before the bytes were assembled in one go (main 9cad9c7)."""
    assert block_hashes(list(range(1000, 1040)), 16) == [1176540212935391029, 5814932884591531899]
    assert block_hashes([7] * 33, 4, parent=12345678901234567890)[-1] == 16935499247207575236
    assert block_hashes(list(range(15)), 16) == [] and block_hashes([], 16) == []


def test_what_a_block_cannot_hold_is_refused_as_before() -> None:
    with pytest.raises(OverflowError):
        block_hashes([-1] * 16, 16)
    with pytest.raises(OverflowError):
        block_hashes([2**32] + [0] * 15, 16)
    with pytest.raises(OverflowError):
        block_hashes([0] * 16, 16, parent=-1)
    assert block_hashes([-1] * 15, 16) == []  # a partial tail block is never hashed, nor checked
    with pytest.raises(ValueError):
        block_hashes([1], 0)
