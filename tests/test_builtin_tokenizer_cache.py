"""The built-in tokenizer's piece-id cache (`fleetcore.tokens._ID_CACHE`): the same ids as
hashing every piece (`token_id`), whatever the cache holds, fills to or forgets."""

from __future__ import annotations

import random

import pytest

from fleetcore import tokens
from fleetcore.tokens import encode, encode_upto, render_chat, split_pieces, token_id


def _texts(rng: random.Random, n: int) -> list[str]:
    alphabet = "ab cd\n\tXYZ 0123 ,.;!?\u00e9\u4e2d\U0001f600\ud800\u2028"  # a lone surrogate too
    return ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 300))) for _ in range(n)]


@pytest.mark.parametrize("seed", range(3))
def test_cached_ids_equal_hashing_every_piece(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    monkeypatch.setattr(tokens, "ID_CACHE_MAX", 64)  # small: it fills and empties while this runs
    tokens._ID_CACHE.clear()
    texts = _texts(rng, 200)
    texts.append(render_chat([{"role": "user", "content": t} for t in texts[:3]]))
    for text in texts + texts[::-1]:  # (the second pass mostly from the cache)
        want = [token_id(p) for p in split_pieces(text)]
        assert encode(text) == want
        limit = rng.randrange(0, len(want) + 2)
        assert encode_upto(text, limit) == want[:limit + 1]
        assert len(tokens._ID_CACHE) <= 64
    tokens._ID_CACHE.clear()
