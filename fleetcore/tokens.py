"""Deterministic tokenizer and chat template shared by the gateway and the simulated engine.

The simulated engine has no vocabulary of its own; what matters is that the gateway
and the worker count the same prompt tokens and derive the same block hashes, so that
a prefix the gateway believes is cached really is. Real engines (vLLM, SGLang) bring
their own tokenizer; the gateway uses this one only as an estimate for them.
"""

from __future__ import annotations

import bisect
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


def split_pieces(text: str) -> list[str]:
    return _PIECE.findall(text)


# Chunks: a run of whitespace and the run of non-whitespace after it (or trailing whitespace).
# Where whitespace follows non-whitespace a piece always ends (a piece is whitespace, then
# letters, digits or one mark, never whitespace again), and a piece depends only on the text
# from its start on: the pieces of a text are those of its chunks, one after another. Text
# repeats its chunks (" the", " of,", the chat template's markers), so ids are looked up per
# chunk (`_CHUNK_IDS`): one match and one lookup per word instead of one per piece (the
# overhead benchmark's chat prompt: 66 chunks, 119 pieces).
_CHUNK = re.compile(r"\s*\S+|\s+")


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
        # pieces: findall gives the same list without a match object per piece (the gateway's
        # usual case, a prompt far below the context; half the time of the path below).
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
    cache = _ID_CACHE
    try:
        return [cache[p] for p in pieces]  # (the usual case: every piece seen before)
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


# A chunk's ids (`_CHUNK`), once computed, for chunks of at most CHUNK_MAX_CHARS characters
# (the chat template's first chunk, `<|begin_of_text|><|start_header_id|>system<|end_header_id|>`,
# is 59). Bounded: emptied when full, ~16 MB at worst (every chunk 96 one-character pieces),
# ~2 MB of English words; thread-safe as `_ID_CACHE` is. A value is a tuple: never changed.
_CHUNK_IDS: dict[str, tuple[int, ...]] = {}
CHUNK_CACHE_MAX = 1 << 14
CHUNK_MAX_CHARS = 96


def _chunk_ids(chunks: list[str] | tuple[str, ...]) -> list[int]:
    """The ids of the text the `_CHUNK` chunks `chunks` make up, from `_CHUNK_IDS` where it can."""
    found = list(map(_CHUNK_IDS.get, chunks))
    if None not in found:
        return list(itertools.chain.from_iterable(found))  # (the usual case: every chunk seen before)
    return _learn_chunks(chunks, found)


def _learn_chunks(chunks: list[str] | tuple[str, ...], found: list[tuple[int, ...] | None]) -> list[int]:
    """`_chunk_ids` for chunks some of which are not in `_CHUNK_IDS` (None in `found`): those
    are split together, in one pass of the piece pattern over their concatenation (every chunk
    but a text's first starts with whitespace, every one but its last ends without: where two
    meet a piece ends, as in the text), and remembered."""
    memo = _CHUNK_IDS
    missing = [c for c, f in zip(chunks, found) if f is None]
    pieces = _PIECE.findall("".join(missing))
    ids = _ids(pieces)
    piece_ends = list(itertools.accumulate(map(len, pieces)))  # where each piece ends in the join
    if len(memo) + len(missing) > CHUNK_CACHE_MAX:
        memo.clear()
    out: list[int] = []
    j = end = 0
    for chunk, f in zip(chunks, found):
        if f is None:
            end += len(chunk)
            k = bisect.bisect_left(piece_ends, end, j) + 1  # (a chunk's end is a piece's end)
            f = tuple(ids[j:k])
            j = k
            if len(chunk) <= CHUNK_MAX_CHARS and len(memo) < CHUNK_CACHE_MAX:
                memo[chunk] = f
        out += f
    return out


# Texts up to this long are split by chunks: a chat turn, a system prompt, a conversation's
# history sent again. A chunk seen before costs less than its pieces, one not seen more (a
# prompt of new chunks only, 40 words: 17 -> 36 us, timeit, ad-hoc), so a long text, most often
# a new document, is split by pieces directly.
CHUNKED_TEXT_MAX = 4096


def encode(text: str) -> list[int]:
    """Token ids of `text`; equal text gives equal ids."""
    if len(text) <= CHUNKED_TEXT_MAX:
        return _chunk_ids(_CHUNK.findall(text))
    return _ids(_PIECE.findall(text))


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
