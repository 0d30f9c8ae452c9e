"""The built-in tokenizer and the per-request histograms, in CPU time (timeit, one process).

    .venv/bin/python bench/cuts_cost.py [--baseline-ref REF --rounds 3]

Times, on whatever code `sys.path` finds first (with `--baseline-ref`, REF's tree and this
checkout alternately, `decision_replay.run_alternately`), in us of thread CPU time, the best
of 7 repeats:

- `tokenize <texts>`: `fleetcore.tokens.encode_upto(render_chat(...), limit)` per chat prompt,
  the gateway's parse of a prompt far below the context, on 200 prompts of four kinds:
  `bench` - 64 tokens of `workloads.prompts.prompt_text` (" word" from 256 words: what
  `bench/peers.py --parts overhead` sends), caches warm; `place_cost` - 28 words with a number
  each from 23 words (`bench/place_cost.py`'s parse), warm; `new pieces` - 40 random 6-letter
  words with a 0-999,999 number each, every cache emptied before each prompt (no piece seen
  before); `docs once` - the first 200 paragraphs (41-4,000 chars) of README.md, bench/README.md
  and gateway/*.py beside this script (the same files for both sides of `--baseline-ref`), each
  tokenized once after the caches are emptied: new prose and code, the piece cache warming;
- `histograms`: one request's five histogram observations (`GatewayMetrics.record_outcome`: TTFT
  and e2e, with its three counters; `ClassHistograms.observe`: TTFT, TPOT, queue wait);
- `render`: one public `/metrics` page (`GatewayMetrics.render()`) with 4 site series and 12
  class series per histogram, in ms (once per scrape, not per request).

Generated texts from seed 0; `docs once` reads the checkout's files and prints the sha256 of the
paragraphs it took (joined with NUL), first 16 hex digits.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import time
import timeit
from pathlib import Path


def _best_us(fn, number: int, per: int, repeat: int = 7) -> float:  # type: ignore[no-untyped-def]
    return min(timeit.Timer(fn, timer=time.thread_time).repeat(number=number, repeat=repeat)) / (number * per) * 1e6


def measure(quick: bool = False) -> str:
    """The line of figures; `quick` (the test's): one run of each, 10 prompts a kind."""
    from fleetcore import tokens
    from fleetcore.types import RequestOutcome
    from gateway.metrics import GatewayMetrics
    from gateway.telemetry import ClassHistograms
    from workloads.prompts import prompt_text

    rng = random.Random(0)
    n = 10 if quick else 200
    reps = {"repeat": 1} if quick else {}
    chat = tokens.render_chat
    words = "the of and to in is that for it as with was on be by at this from or an are not fleet token".split()
    texts = {
        "bench": [chat([{"role": "user", "content": prompt_text((4 * i + 1, 4 * i + 2, 4 * i + 3, 4 * i + 4), 64, 16)}])
                  for i in range(n)],
        "place_cost": [chat([{"role": "user", "content": " ".join(rng.choice(words) + str(rng.randrange(100))
                                                                  for _ in range(28))}]) for _ in range(n)],
        "new pieces": [chat([{"role": "user", "content": " ".join(
            "".join(rng.choice("abcdefghij") for _ in range(6)) + str(rng.randrange(10 ** 6)) for _ in range(40))}])
            for _ in range(n)],
    }
    root = Path(__file__).resolve().parent.parent
    paragraphs = [para for f in [root / "README.md", root / "bench" / "README.md", *sorted((root / "gateway").glob("*.py"))]
                  for para in f.read_text(encoding="utf-8").split("\n\n") if 40 < len(para) <= 4000]
    docs = [chat([{"role": "user", "content": para}]) for para in paragraphs[:n]]
    caches = [c for c in (getattr(tokens, "_ID_CACHE", None), getattr(tokens, "_CHUNK_IDS", None)) if c is not None]
    out = []
    for name, batch in texts.items():
        if name == "new pieces":
            def cold(batch: list[str] = batch) -> None:
                for t in batch:
                    for c in caches:
                        c.clear()
                    tokens.encode_upto(t, 4000)

            def clearing(batch: list[str] = batch) -> None:
                for t in batch:
                    for c in caches:
                        c.clear()

            us = _best_us(cold, 5, len(batch), **reps) - _best_us(clearing, 5, len(batch), **reps)
        else:
            for t in batch:
                tokens.encode_upto(t, 4000)  # (warm)
            us = _best_us(lambda batch=batch: [tokens.encode_upto(t, 4000) for t in batch], 20, len(batch), **reps)
        out.append(f"tokenize {name} {us:6.2f}")

    def docs_once() -> None:
        for c in caches:
            c.clear()
        for t in docs:
            tokens.encode_upto(t, 10 ** 6)

    digest = hashlib.sha256("\x00".join(paragraphs[:n]).encode()).hexdigest()[:16]
    out.append(f"tokenize docs once {_best_us(docs_once, 1, len(docs), **reps):6.2f} (sha256 {digest})")

    metrics = GatewayMetrics()
    classes = ClassHistograms(metrics.registry)
    outcome = RequestOutcome("r", "e0", "use1", True, 64, 0, 4, 0.002, 0.0005, 0.004)
    key = ("m1", "interactive", "anonymous")

    def request() -> None:
        metrics.record_outcome("m1", outcome)
        classes.observe(key, 0.002, 0.0005, 0.0)

    out.append(f"histograms {_best_us(request, 100 if quick else 20000, 1, **reps):5.2f}")
    page = GatewayMetrics()
    page_classes = ClassHistograms(page.registry)
    for model in ("m1", "m2"):
        for site in ("use1", "euw1"):
            page.record_outcome(model, RequestOutcome("r", "e0", site, True, 64, 0, 4, 0.002, 0.0005, 0.004))
        for cls in ("interactive", "batch"):
            for tenant in ("a", "b", "c"):
                page_classes.observe((model, cls, tenant), 0.02, 0.004, 0.0)
    out.append(f"render {_best_us(page.render, 1 if quick else 100, 1, **reps) / 1000:5.2f} ms")
    return "  ".join(out) + "  (CPU us per request unless said)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-ref", metavar="REF", help="also measure that commit's code, in alternate rounds")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per side with --baseline-ref")
    args = ap.parse_args()
    if args.baseline_ref:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from decision_replay import run_alternately

        run_alternately(Path(__file__).resolve(), [], args.baseline_ref, args.rounds)
        return
    print(measure())


if __name__ == "__main__":
    main()
