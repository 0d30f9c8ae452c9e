"""Prompt text for live replay: block ids become deterministic text.

Each block id maps to a fixed chunk of exactly `block_tokens` tokens under
`fleetcore.tokens.count_tokens`: words from a fixed list, each written as
" word" (a leading space and letters only), which that tokenizer counts as one
piece and which never merges with its neighbour. Chunks are concatenated, so
equal leading ids give byte-identical leading text (shared KV prefix on the live
workers), and the token count of the text is exactly `input_length`: the last
block is truncated to fit. If the ids cover fewer tokens than `input_length`,
the rest is filler keyed by the whole id sequence (private to that sequence).

The chat template the replayer wraps the text in adds its own few tokens.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from functools import lru_cache

import xxhash

# 256 letter-only words, so a word choice carries 8 bits and text looks varied.
_WORDS: tuple[str, ...] = tuple(" " + w for w in (
    "able acid aged also area army away baby back ball band bank base bath bear beat "
    "been beer bell belt best bill bird blow blue boat body bomb bond bone book boom "
    "born boss both bowl bulk burn bush busy call calm came camp card care case cash "
    "cast cell chat chip city club coal coat code cold come cook cool cope copy core "
    "cost crew crop dark data date dawn days dead deal dean dear debt deep deny desk "
    "dial diet disk done door dose down draw drew drop drug dual duke dust duty each "
    "earn ease east easy edge else even ever exit face fact fail fair fall farm fast "
    "fate fear feed feel feet fell felt file fill film find fine fire firm fish five "
    "flat flow food foot ford form fort four free from fuel full fund gain game gate "
    "gave gear gene gift girl give glad goal goes gold golf gone good gray grew grey "
    "grow gulf hair half hall hand hang hard harm hate have head hear heat held hell "
    "help here hero high hill hire hold hole holy home hope host hour huge hung hunt "
    "hurt idea inch into iron item jack jane jean john join jump jury just keen keep "
    "kent kept kick kill kind king knee knew know lack lady laid lake land lane last "
    "late lead left less life lift like line link list live load loan lock logo long "
    "look lord lose loss lost love luck made mail main make male many mark mass matt"
).split())
assert len(_WORDS) == 256 and len(set(_WORDS)) == 256


@lru_cache(maxsize=4096)  # ~3 KB per 512-token chunk: bounded at ~15 MB
def _chunk(block_id: int, block_tokens: int, seed: int) -> tuple[str, tuple[str, ...]]:
    h = xxhash.xxh64_intdigest(block_id.to_bytes(16, "little", signed=True),
                               seed=seed & 0xFFFFFFFFFFFFFFFF)
    # random.Random(int) and choices() are stable across CPython versions.
    words = tuple(random.Random(h).choices(_WORDS, k=block_tokens))
    return "".join(words), words


def chunk_text(block_id: int, block_tokens: int = 512, seed: int = 0) -> str:
    """The fixed text of one block: exactly `block_tokens` tokens."""
    return _chunk(block_id, block_tokens, seed)[0]


def prompt_text(hash_ids: Sequence[int], input_length: int, block_tokens: int = 512,
                seed: int = 0) -> str:
    """Text of exactly `input_length` tokens whose blocks are the chunks of `hash_ids`."""
    if block_tokens <= 0:
        raise ValueError("block_tokens must be positive")
    parts: list[str] = []
    left = max(0, input_length)
    for bid in hash_ids:
        if left <= 0:
            break
        text, words = _chunk(bid, block_tokens, seed)
        if left >= block_tokens:
            parts.append(text)
            left -= block_tokens
        else:
            parts.append("".join(words[:left]))
            left = 0
    if left > 0:
        # Filler ids: negative, so they never equal a real (non-negative) block id.
        key = xxhash.xxh64_intdigest(repr(tuple(hash_ids)).encode()) >> 2
        i = 0
        while left > 0:
            text, words = _chunk(-1 - ((key + i) & ((1 << 62) - 1)), block_tokens, seed)
            take = min(left, block_tokens)
            parts.append(text if take == block_tokens else "".join(words[:take]))
            left -= take
            i += 1
    return "".join(parts)
