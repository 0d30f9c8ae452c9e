"""Microbenchmark: what the relay spends per streamed token event reading the SSE stream.

    python bench/sse_cost.py [--events 2000] [--repeat 7]

The relay splits every upstream read into events, parses each one and accounts it
(first/last token time, usage, errors) before passing the bytes on: once per token, on
the gateway's event loop. Measured here: that work alone (`fleetcore.sse`: SSESplitter,
parse_sse_event, StreamStats.account) over a vLLM-shaped chat stream, in three read
patterns (one event per read, the usual; 16 events per read, a burst; every event split
across two reads), the relay's fast path for plain token events (`plain_token_text`, no
json.loads), the same through a stream's template (`PlainTokens`, what the relay runs), and
parsing alone. Prints the best of `--repeat` runs, ns per event.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable

from fleetcore.sse import PlainTokens, SSESplitter, StreamStats, parse_sse_event, plain_token_text


def stream(n: int) -> list[bytes]:
    """n content chunks as vLLM sends them, the usage-only chunk, [DONE]."""
    def ev(obj: object) -> bytes:
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    head = {"id": "chatcmpl-9f2c4b7e1a", "object": "chat.completion.chunk", "created": 1_700_000_000,
            "model": "llama-3.1-8b"}
    out = [ev({**head, "choices": [{"index": 0, "delta": {"content": f" tok{i}"}, "logprobs": None,
                                    "finish_reason": None}]}) for i in range(n)]
    out.append(ev({**head, "choices": [], "usage": {"prompt_tokens": 812, "completion_tokens": n,
                                                     "total_tokens": 812 + n,
                                                     "prompt_tokens_details": {"cached_tokens": 512}}}))
    out.append(b"data: [DONE]\n\n")
    return out


def relay_pass(reads: list[bytes], tokens: int) -> int:
    """What RelayStream does with each read: split, parse, account (`tokens`: chunks expected)."""
    sp, stats, n = SSESplitter(), StreamStats(), 0
    for data in reads:
        for raw in sp.feed(data):
            stats.account(parse_sse_event(raw), 0.0)
            n += 1
    assert stats.token_events == tokens, stats.token_events  # the work was really done
    return n


def relay_pass_plain(reads: list[bytes], tokens: int,
                     read: Callable[[bytes], str | None] = plain_token_text) -> int:
    """The same with the relay's fast path (`plain_token_text`: token events read from their bytes,
    their text kept as a continuation's record keeps it); the rest parsed as above. `read`: how a
    token event is read (the relay's own: a stream's `PlainTokens().text`)."""
    sp, stats, sent, n = SSESplitter(), StreamStats(), [], 0
    for data in reads:
        for raw in sp.feed(data):
            text = read(raw)
            if text is not None:
                stats.token(0.0)
                sent.append(text)
            else:
                stats.account(parse_sse_event(raw), 0.0)
            n += 1
    assert stats.token_events == tokens and len(sent) == tokens, (stats.token_events, len(sent))
    return n


def parse_only(events: list[bytes]) -> int:
    for raw in events:
        parse_sse_event(raw)
    return len(events)


def best_ns(fn: Callable[[], int], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter_ns()
        n = fn()
        best = min(best, (time.perf_counter_ns() - t0) / n)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    one = stream(args.events)
    burst = [b"".join(one[i:i + 16]) for i in range(0, len(one), 16)]
    split = [part for e in one for part in (e[:len(e) // 2], e[len(e) // 2:])]
    n = args.events
    rows = [
        ("relay, 1 event per read", lambda: relay_pass(one, n)),
        ("relay, 16 events per read", lambda: relay_pass(burst, n)),
        ("relay, each event in 2 reads", lambda: relay_pass(split, n)),
        ("relay fast path, 1 per read", lambda: relay_pass_plain(one, n)),
        ("relay fast path, 16 per read", lambda: relay_pass_plain(burst, n)),
        ("fast path + template, 1 per read", lambda: relay_pass_plain(one, n, PlainTokens().text)),
        ("fast path + template, 16 per read", lambda: relay_pass_plain(burst, n, PlainTokens().text)),
        ("parse_sse_event alone", lambda: parse_only(one)),
    ]
    for name, fn in rows:
        fn()  # warm-up
        print(f"{name:<34} {best_ns(fn, args.repeat):8.0f} ns/event")


if __name__ == "__main__":
    main()
