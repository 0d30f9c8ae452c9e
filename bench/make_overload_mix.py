"""Write the SLOMax overload mix as canonical JSONL: the same bytes for the same arguments.

    .venv/bin/python bench/make_overload_mix.py OUT.jsonl [--duration 600] [--seed 7]
    .venv/bin/python bench/make_overload_mix.py OUT.jsonl --noisy   # + a tenant flooding long prompts

Five tenants share bench/fleet_slomax.yaml (4 x Llama-3.1-8B on H100); at rate-scale 1
the mix is about 100% of the fleet's estimated capacity with an ideal prefix cache (the
larger of the two estimates `tokenfleet simulate --describe-capacity` prints), so
`--rate-scale 1.3` / `1.6` are at least 130% / 160% overload. Shares of that capacity:

| tenant | source                                               | class                   | share |
|--------|------------------------------------------------------|-------------------------|-------|
| chat   | Azure LLM inference trace 2023, conversation (x5.5)   | by length (interactive) | ~30%  |
| kimi   | Mooncake FAST'25 conversation trace (x0.75)           | by length (both)        | ~34%  |
| docs   | generator document_analysis (30k-token documents)    | long_context            | ~10%  |
| agents | generator agent_loops (6k-token tool prefix)          | by length (both)        | ~6%   |
| batch  | generator offline_batch (bursts, 600 s deadline)      | batch                   | ~16%  |

Each source is cut to the first `--duration` seconds; trace block ids keep their own
namespaces (Azure ids are generated per file, Mooncake's are below 2**18, generators
draw from their own), so no prefix is shared by accident across tenants. Every row
names its class (by length where the source left it open).

`--noisy` adds tenant `flood`: long prompts (24k tokens, every one a fresh document, so
nothing is cached) at a rate that alone would take about the fleet's whole prefill
capacity — the noisy neighbour. Its requests are long_context by length, like any
tenant's.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable from a checkout without installing

from workloads import (
    LengthDist,
    Workload,
    agent_loops,
    assign,
    document_analysis,
    load_trace,
    merge,
    offline_batch,
    scale_rate,
    window,
)

TRACES = REPO / "traces"
AZURE_CONV = "AzureLLMInferenceTrace_conv.csv"
MOONCAKE_CONV = "conversation_trace.jsonl.gz"


def tenant(w: Workload, name: str) -> Workload:
    return Workload(w.name, [replace(r, tenant=name) for r in w.requests], w.block_tokens, dict(w.metadata))


# Source rates at load 1.0: about 100% of bench/fleet_slomax.yaml's estimated capacity.
LOAD = 2.13


def build(duration_s: float = 600.0, seed: int = 7, noisy: bool = False, traces: Path = TRACES,
          load: float = LOAD) -> Workload:
    d, x = duration_s, load
    # Traces: cut the window at the original rate, then scale, so the window holds the same requests.
    chat = scale_rate(window(load_trace(traces / AZURE_CONV), 0, d * 2.6 * x), 2.6 * x)
    kimi = scale_rate(window(load_trace(traces / MOONCAKE_CONV), 0, d * 0.35 * x), 0.35 * x)
    docs = document_analysis(documents=round(25 * x * d / 600), rate=25 * x / 600, seed=seed)
    agents = agent_loops(agents=round(20 * x * d / 600), rate=20 * x / 600, seed=seed + 1)
    batch = offline_batch(bursts=max(1, round(6 * x * d / 600)), rate=6 * x / 600, seed=seed + 2,
                          burst_size=LengthDist(500, 0.3, 1, 2000))
    parts = [tenant(chat, "chat"), tenant(kimi, "kimi"), tenant(docs, "docs"), tenant(agents, "agents"),
             tenant(batch, "batch")]
    if noisy:
        # Fresh 24k-token documents, one question each: all prefill, nothing to reuse.
        flood = document_analysis(documents=round(0.9 * x * d), rate=0.9 * x, seed=seed + 3, name="flood",
                                  doc_tokens=LengthDist(24000, 0.1, 16384, 32000),
                                  questions=1, output_tokens=LengthDist(150, 0.5, 1, 600))
        parts.append(tenant(flood, "flood"))
    parts = [window(p, 0, d, rebase=False) for p in parts]  # generators may run past the window
    # Spell every class out (by length where a source left it open): the file says what it is.
    mix = assign(merge(*parts, name="slomax-overload" + ("-noisy" if noisy else "")))
    mix.metadata = {"generator": "bench/make_overload_mix.py", "duration_s": d, "seed": seed, "noisy": noisy,
                    "load": x, "parts": {p.name: len(p) for p in parts}}
    return mix


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="output file (.jsonl, or .jsonl.gz)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of each source (default 600)")
    p.add_argument("--seed", type=int, default=7, help="seed of the generators (default 7)")
    p.add_argument("--noisy", action="store_true", help="add tenant `flood` (the noisy neighbour)")
    p.add_argument("--load", type=float, default=LOAD, help=f"source rate multiplier (default {LOAD})")
    p.add_argument("--traces", default=str(TRACES), help="folder of the public traces (default traces/ in the repository)")
    a = p.parse_args(argv)
    mix = build(a.duration, a.seed, a.noisy, Path(a.traces), a.load)
    mix.to_jsonl(a.out)
    d = mix.describe()
    print(f"wrote {a.out}: {d['requests']} requests over {d['duration_s']:.0f} s, tenants {d['tenants']}, "
          f"classes {d['classes']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
