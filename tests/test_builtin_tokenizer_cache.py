"""The built-in tokenizer's piece-id cache (`fleetcore.tokens._ID_CACHE`): the same ids as
hashing every piece (`token_id`), whatever the cache holds, fills to or forgets."""

from __future__ import annotations

import random
import unittest.mock

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


# Whitespace of every kind `\s` knows (ASCII, the \x1c-\x1f separators, Unicode spaces and line
# breaks), letters, digits (Unicode ones too), marks, non-Latin letters, an emoji, a lone surrogate.
_SPACES = " \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0\u1680\u2000\u2009\u2028\u2029\u202f\u3000"
_OTHERS = ["a", "Z", "q", "0", "7", "\u0663", "\uff19", ",", "<", "|", "_", "\u00e9", "\u4e2d",
           "\U0001f600", "\ud800", "\u200b"]


def _adversarial(rng: random.Random) -> str:
    """Runs around the pattern's bounds: whitespace of 0-40 (15/16 and 32/33 where a piece's
    lead and a whitespace piece end), letters of 1-40 (16/17), digits of 1-8 (3/4), runs of
    marks and non-Latin text, the chat template's markers, the text's start and end on
    whitespace or not."""
    parts = []
    for _ in range(rng.randrange(0, 40)):
        kind = rng.randrange(6)
        if kind == 0:
            n = rng.choice([0, 1, 2, 14, 15, 16, 17, 31, 32, 33, 40, rng.randrange(0, 70)])
            parts.append("".join(rng.choice(_SPACES) for _ in range(n)))
        elif kind == 1:
            parts.append("".join(rng.choice("abcXYZ") for _ in range(rng.choice([1, 15, 16, 17, 33, 40]))))
        elif kind == 2:
            parts.append("".join(rng.choice("0123\u0663") for _ in range(rng.randrange(1, 9))))
        elif kind == 3:
            parts.append("".join(rng.choice(_OTHERS) for _ in range(rng.randrange(1, 90))))
        elif kind == 4:
            parts.append(rng.choice(["<|eot_id|>", "<|start_header_id|>user<|end_header_id|>\n\n", " the", " of,"]))
        else:
            parts.append(rng.choice(_SPACES))
    return "".join(parts)


@pytest.mark.parametrize("seed", range(4))
def test_ids_equal_the_piece_pattern_on_adversarial_text(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """`encode` and `encode_upto` at every limit around the count against the piece pattern run
    over the whole text and every piece hashed, on texts at the pattern's bounds, with the piece
    cache small enough to fill and empty while it runs (the oracle for any cheaper path)."""
    rng = random.Random(1000 + seed)
    monkeypatch.setattr(tokens, "ID_CACHE_MAX", 50)
    # long texts are matched and looked up a slice at a time: slices as small as they may be
    monkeypatch.setattr(tokens, "SLICE_CHARS", tokens.MAX_PIECE_CHARS + 1 + seed)
    monkeypatch.setattr(tokens, "SLICE_PIECES", 1 + seed)
    tokens._ID_CACHE.clear()
    texts = [_adversarial(rng) for _ in range(250)] + _texts(rng, 50) + ["", " ", "\n" * 40, "x" * 200]
    for text in texts + texts[::-1]:
        want = [token_id(p) for p in tokens._PIECE.findall(text)]
        assert encode(text) == want, repr(text)
        for limit in {0, 1, len(want) - 2, len(want) - 1, len(want), len(want) + 1, rng.randrange(0, len(want) + 2)}:
            if limit >= 0:
                assert encode_upto(text, limit) == want[:limit + 1], (repr(text), limit)
        assert len(tokens._ID_CACHE) <= 50
    tokens._ID_CACHE.clear()


@pytest.mark.parametrize("seed", range(3))
def test_a_long_text_is_split_a_slice_at_a_time_into_the_same_pieces(seed: int) -> None:
    """`split_pieces` matches a long text a slice at a time (one C call over all of it holds the
    GIL, and the event loop with it, ~9 ms for a 32k-token prompt): at every slice size from the
    smallest allowed, the pieces one `findall` over the whole text gives, on texts at the
    pattern's bounds (a slice's end falls inside words, digit runs, whitespace runs of every
    kind, marks)."""
    rng = random.Random(3000 + seed)
    texts = ["".join(_adversarial(rng) for _ in range(5)) for _ in range(60)]
    for text in texts:
        want = tokens._PIECE.findall(text)
        for size in {33, 34, 35, 47, 48, 64, 65, rng.randrange(33, 400), len(text), len(text) + 1}:
            if size > tokens.MAX_PIECE_CHARS:
                assert split_pieces(text, size) == want, (repr(text), size)
    with pytest.raises(ValueError):
        split_pieces("x" * 100, tokens.MAX_PIECE_CHARS)


def test_a_long_text_is_read_no_further_than_the_cap() -> None:
    """A long text without whitespace (one chunk): encode_upto stops after `limit + 1` pieces
    rather than splitting all of it (the bound that keeps a huge prompt as cheap as a fitting one)."""
    text = "abcdefghijklmnop" * 20_000  # 20,000 pieces, one chunk
    calls = []
    real = tokens._ids

    def counting(pieces: list[str]) -> list[int]:
        calls.append(len(pieces))
        return real(pieces)

    with unittest.mock.patch.object(tokens, "_ids", counting):
        assert encode_upto(text, 9) == [token_id("abcdefghijklmnop")] * 10
    assert sum(calls) <= 10


@pytest.mark.parametrize("seed", range(3))
def test_marker_parts_cut_between_pieces(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """`encode` reads a text part by part, cut after each `|>` (`_PART_CACHE`): the same ids as the
    piece pattern over the whole text, whatever comes before and after a `|>` (whitespace of
    every kind, long letter and digit runs, other marks, `>` and `|` alone), with the part cache
    small enough to fill and empty and parts both longer and shorter than it keeps."""
    rng = random.Random(2000 + seed)
    monkeypatch.setattr(tokens, "PART_CACHE_MAX", 8)
    monkeypatch.setattr(tokens, "PART_CACHE_CHARS", 6)
    tokens._PART_CACHE.clear()
    bits = ["|>", "|>", "<|", ">", "|", "||>", "|>>", "<|eot_id|>", "user<|end_header_id|>\n\n"]
    texts = []
    for _ in range(300):
        parts = []
        for _ in range(rng.randrange(0, 30)):
            kind = rng.randrange(4)
            if kind == 0:
                parts.append(rng.choice(bits))
            elif kind == 1:
                parts.append("".join(rng.choice(_SPACES) for _ in range(rng.choice([1, 2, 15, 16, 33]))))
            elif kind == 2:
                parts.append("".join(rng.choice("abZ09\u0663") for _ in range(rng.choice([1, 3, 4, 16, 17]))))
            else:
                parts.append(rng.choice(_OTHERS))
        texts.append("".join(parts))
    texts += ["<|" + t for t in texts]  # (the parts are read only in a text that begins as a template)
    for text in texts + texts[::-1]:
        want = [token_id(p) for p in tokens._PIECE.findall(text)]
        assert encode(text) == want, repr(text)
        assert encode_upto(text, len(want)) == want
        assert len(tokens._PART_CACHE) <= 8 and all(len(k) <= 6 for k in tokens._PART_CACHE)
    tokens._PART_CACHE.clear()


def test_a_chat_prompts_template_parts_are_kept() -> None:
    tokens._PART_CACHE.clear()
    text = render_chat([{"role": "user", "content": " hello there"}])
    assert encode(text) == [token_id(p) for p in split_pieces(text)]
    assert set(tokens._PART_CACHE) == {"<|begin_of_text", "<|start_header_id", "user<|end_header_id",
                                       "\n\n hello there<|eot_id", "assistant<|end_header_id"}
    assert encode(text) == [token_id(p) for p in split_pieces(text)]  # from the kept parts
    tokens._PART_CACHE.clear()
