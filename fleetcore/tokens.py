"""Deterministic tokenizer and chat template shared by the gateway and the simulated engine.

The simulated engine has no vocabulary of its own; what matters is that the gateway
and the worker count the same prompt tokens and derive the same block hashes, so that
a prefix the gateway believes is cached really is. Real engines (vLLM, SGLang) bring
their own tokenizer; the gateway uses this one only as an estimate for them.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import xxhash

VOCAB_SIZE = 1 << 17

# Words, numbers, single punctuation marks, and runs of whitespace that carry a newline.
# Roughly 1.3 tokens per English word, close to what BPE tokenizers give. Every piece is
# at most MAX_PIECE_CHARS long (a longer word or whitespace run splits, as a BPE vocabulary
# would), and the pieces cover the text exactly, so a text of n characters has at least
# n / MAX_PIECE_CHARS tokens: the gateway rejects a prompt that cannot fit a context from
# its length alone, before tokenizing it (`min_tokens`).
MAX_PIECE_CHARS = 32
_PIECE = re.compile(r"\s{0,15}[A-Za-z]{1,16}|\s{0,15}\d{1,3}|\s{0,15}[^\sA-Za-z\d]|\s{1,32}")


# One `findall` over a long text is one C call that holds the GIL all along (~80 ns a character:
# 9 ms for a prompt of 32k tokens), and prompts are tokenized on a pool thread beside the event
# loop, which waits for the GIL that long whenever it wants it back. A longer text is matched a
# slice of this many characters at a time (~0.3 ms), and the thread gives the GIL up between
# slices at the interpreter's switch interval (tests/test_tokenize_stall.py).
SLICE_CHARS = 4096
# The same for the ids of a long prompt's pieces (`_ids`: a C-level map, ~30 ns a piece).
SLICE_PIECES = 8192


def split_pieces(text: str, slice_chars: int | None = None) -> list[str]:
    """The pieces of `text` (one token each); a long text a slice at a time (default
    SLICE_CHARS), with the same result."""
    if slice_chars is None:
        slice_chars = SLICE_CHARS
    n = len(text)
    if n <= slice_chars:
        return _PIECE.findall(text)
    if slice_chars <= MAX_PIECE_CHARS:
        raise ValueError(f"slice_chars must exceed MAX_PIECE_CHARS ({MAX_PIECE_CHARS})")
    findall = _PIECE.findall
    out: list[str] = []
    pos = 0
    while pos + slice_chars < n:
        pieces = findall(text, pos, pos + slice_chars)
        # The last piece may be cut short by the slice's end (a word running on past it): it is
        # matched again, whole, from its start in the next slice. Every piece before it ends
        # before the cut and was decided by the characters it spans and the one after it (the
        # pattern looks no further), so they are the pieces one call over the text gives. A
        # slice holds at least two pieces (each is at most MAX_PIECE_CHARS long): pos advances.
        pieces.pop()
        out += pieces
        pos += sum(map(len, pieces))
    out += findall(text, pos)
    return out


def min_tokens(chars: int) -> int:
    """A lower bound on the tokens of any text of `chars` characters."""
    return -(-chars // MAX_PIECE_CHARS)


class PromptTooLong(ValueError):
    """A prompt has more tokens than the caller's limit: `tokens` of them, or at least that
    many when `exact` is False (counting stopped early, or only a bound was computed)."""

    def __init__(self, tokens: int, exact: bool) -> None:
        super().__init__(f"{'' if exact else 'at least '}{tokens} tokens")
        self.tokens = tokens
        self.exact = exact


def encode_upto(text: str, limit: int) -> list[int]:
    """The ids of `text`, but at most `limit + 1` of them: a caller that only needs to know
    whether the text exceeds `limit` tokens stops paying after that many."""
    cap = max(0, limit) + 1
    if len(text) <= cap:
        # Every piece holds at least one character, so this text cannot have more than `cap`
        # pieces: all of them, without a match object per piece (the gateway's usual case, a
        # prompt far below the context; half the time of the path below).
        return encode(text)
    return _ids([m.group() for m in itertools.islice(_PIECE.finditer(text), cap)])


def token_id(piece: str) -> int:
    # surrogatepass: total on any str (a lone surrogate is an id like any other, not a crash);
    # valid text encodes exactly as with plain UTF-8
    return xxhash.xxh32_intdigest(piece.encode("utf-8", "surrogatepass")) % VOCAB_SIZE


# A piece's id, once computed (`token_id`): prompts repeat their pieces (words, the chat
# template's markers, whitespace), and a dict lookup is a third of the encode + hash. Bounded:
# emptied when full. (Safe from the tokenizer pool's threads: each dict operation is atomic,
# and a lookup that misses, a concurrent clear included, computes the id.)
_ID_CACHE: dict[str, int] = {}
ID_CACHE_MAX = 1 << 15


def _ids(pieces: list[str]) -> list[int]:
    """`[token_id(p) for p in pieces]`, from `_ID_CACHE` where it can (one per prompt token: it shows)."""
    if len(pieces) > SLICE_PIECES:  # (a slice at a time: SLICE_PIECES)
        out: list[int] = []
        for k in range(0, len(pieces), SLICE_PIECES):
            out += _slice_ids(pieces[k:k + SLICE_PIECES])
        return out
    return _slice_ids(pieces)


def _slice_ids(pieces: list[str]) -> list[int]:
    cache = _ID_CACHE
    try:
        # (the usual case: every piece seen before; `map` runs no bytecode per piece)
        return list(map(cache.__getitem__, pieces))
    except KeyError:
        pass
    if len(cache) >= ID_CACHE_MAX:
        cache.clear()
    h = xxhash.xxh32_intdigest
    get = cache.get
    out = []
    for p in pieces:
        t = get(p)
        if t is None:
            t = h(p.encode("utf-8", "surrogatepass")) % VOCAB_SIZE
            if len(cache) < ID_CACHE_MAX:
                cache[p] = t
        out.append(t)
    return out


# The ids of the text up to and including each `|>` (the chat template's markers end so), once
# computed (`encode`). A piece that holds a `>` ends with it (of the four kinds of piece, only a
# single mark can hold one, and it is the last character), so a text cut after each `>` is cut
# between pieces, and its ids are its parts' ids one after another. The parts between the
# markers repeat from prompt to prompt (`<|begin_of_text|>`, `<|start_header_id|>`, `user<|end_header_id|>`,
# ...): ~40% of a short chat prompt's pieces, each ~2 k instructions in the regex (bench/README.md,
# "Issue 14: per layer"). Only for a text that begins as a template does (other text, say code
# full of `|>` pipes, would pay a call per part); only short parts are kept, and the dict is
# bounded as `_ID_CACHE` is (emptied when full; thread-safe the same way).
_MARKER_END = "|>"
_PART_CACHE: dict[str, tuple[int, ...]] = {}
PART_CACHE_MAX = 1 << 12
PART_CACHE_CHARS = 64  # longer parts (the messages' own text) are not kept


def encode(text: str) -> list[int]:
    """Token ids of `text`; equal text gives equal ids."""
    if not text.startswith("<|") or text.find(_MARKER_END) < 0:  # not a rendered template: in one go
        return _ids(split_pieces(text))
    parts = text.split(_MARKER_END)
    last = parts.pop()
    cache = _PART_CACHE
    out: list[int] = []
    for part in parts:
        ids = cache.get(part)
        if ids is None:
            ids = tuple(_ids(split_pieces(part + _MARKER_END)))
            if len(part) <= PART_CACHE_CHARS:
                if len(cache) >= PART_CACHE_MAX:
                    cache.clear()
                cache[part] = ids
        out += ids
    if last:
        out += _ids(split_pieces(last))
    return out


def count_tokens(text: str) -> int:
    return len(split_pieces(text))


def _content_text(content: Any) -> str:
    """Message content as text: a string, or the text parts of a content-part list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise TypeError("message content must be a string or a list of content parts")


def render_chat(messages: Iterable[Mapping[str, Any]]) -> str:
    """The prompt a chat request becomes (a Llama-3-like template).

    Earlier turns render identically whatever follows them, so a multi-turn
    conversation's prompt grows by appending: its prefix blocks stay cacheable.
    """
    out = ["<|begin_of_text|>"]
    for m in messages:
        out.append(f"<|start_header_id|>{m.get('role', 'user')}<|end_header_id|>\n\n")
        out.append(_content_text(m.get("content")))
        out.append("<|eot_id|>")
    out.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(out)


_WORDS = (
    "the of and to in is that for it as with was on be by at this from or an are not "
    "fleet token cache prefix model engine site queue route batch stream latency goodput "
    "tensor kernel block decode prefill request answer signal vector memory compute river "
    "stone garden window silver orange quiet rapid gentle bright north south harbor meadow"
).split()


def pseudo_word(seed: int, index: int) -> str:
    """The `index`-th output word of a response seeded by `seed` (deterministic filler text)."""
    h = xxhash.xxh64_intdigest(index.to_bytes(8, "little"), seed=seed & 0xFFFFFFFFFFFFFFFF)
    return " " + _WORDS[h % len(_WORDS)]
