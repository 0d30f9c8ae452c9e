"""Where the gateway's CPU goes: the gateway under cProfile, self time split by package.

    .venv/bin/python bench/profile_gateway.py [--requests 2200] [--concurrency 8] [--chunks 16]

One gateway process (the same one `bench/otel_overhead.py` starts: `gateway.app.create_app`
over one static instance, TokenPilot routing, the fleet file's default admission, SLOMax,
served by uvicorn with its default stack; `--admission fcfs` runs FCFS, what
`bench/peers.py --parts overhead` runs) runs under `cProfile` in front of a stub engine in this process that streams
`--chunks` SSE chunks per answer as fast as it can; the client sends `--requests` streamed
chat completions at `--concurrency`. On SIGTERM the gateway writes its profile; this script
then sums each function's *self* time (tottime) by where its code lives (gateway/,
tokenpilot/, h11, aiohttp, asyncio, ...) and prints the shares, largest first, plus the
top functions. Only the event-loop thread is profiled (cProfile is per thread): work in the
tokenizer pool's threads is not in the split. cProfile's own overhead inflates small,
frequently called functions, so read shares, not absolute times. `--stats FILE` keeps the
raw pstats file. It also prints every garbage collection's pause by generation while serving
(the first full one is the gateway's own `gc.collect()` before `gc.freeze()` at start-up);
`--gc-thresholds A,B,C` runs the gateway with other thresholds. Linux only (as otel_overhead.py).

bench/README.md quotes a split of this kind (2,200 requests, "no single hotspot").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import otel_overhead as oo  # noqa: E402  (bench/ is not a package)

ROOT = oo.ROOT

# (label, substrings of a function's file path); first match wins
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("gateway code", ("/gateway/",)),
    ("TokenPilot", ("/tokenpilot/",)),
    ("SLOMax", ("/slomax/",)),
    ("fleetcore", ("/fleetcore/",)),
    ("engine adapters", ("/engine_adapters/",)),
    ("h11", ("/h11/",)),
    ("httptools", ("/httptools/",)),
    ("uvloop", ("/uvloop/",)),
    ("aiohttp", ("/aiohttp/", "/multidict/", "/yarl/")),
    ("starlette + fastapi + uvicorn", ("/starlette/", "/fastapi/", "/uvicorn/")),
    ("pydantic", ("/pydantic", )),
    ("prometheus", ("/prometheus_client/",)),
    ("opentelemetry", ("/opentelemetry/",)),
    ("tokenizer", ("/tokenizers/", "/transformers/", "/tiktoken")),
    ("asyncio", ("/asyncio/", "selectors.py")),
    ("json", ("/json/",)),
)


# Stages of a request's way, as cumulative time (callees included) of the function that does
# each, per request: (label, path suffix, function name). They nest (the ASGI stack holds the
# rest), so they do not sum to 100%; "ASGI stack" is everything under the outermost app.
STAGES: tuple[tuple[str, str, str], ...] = (
    ("ASGI stack (middlewares + routing + handler)", "uvicorn/middleware/proxy_headers.py", "__call__"),
    ("  endpoint handler (starlette routing.handle)", "starlette/routing.py", "handle"),
    ("    parse + tokenize (gateway.requests)", "gateway/requests.py", "parse_request"),
    ("    admission enter (gateway.admission)", "gateway/admission.py", "enter"),
    ("    place: site + instance (fleetmind.place)", "fleetmind/place.py", "place"),
    ("      site choice (FleetMind.choose)", "fleetmind/site_choice.py", "choose"),
    ("        TokenPilot.predict (site scoring)", "tokenpilot/router.py", "predict"),
    ("      TokenPilot.route", "tokenpilot/router.py", "route"),
    ("    upstream send (aiohttp post)", "gateway/relay.py", "_send"),
    ("    SSE event processing (RelayStream._process)", "gateway/relay.py", "_process"),
    ("    attempt bookkeeping (Dispatch.finish)", "gateway/relay.py", "finish"),
    ("    admission release", "gateway/admission.py", "release"),
    ("  fleet view builds (FleetState.build_view)", "gateway/fleet_state.py", "build_view"),
    ("  Prometheus .labels() lookups", "prometheus_client/metrics.py", "labels"),
    ("loop monitor ticks (process_time)", "gateway/loop_monitor.py", "_arm"),
)


def group_of(filename: str) -> str:
    if filename.startswith("~") or filename == "":
        return "builtins (C calls)"
    for label, keys in GROUPS:
        if any(k in filename for k in keys):
            return label
    return "other stdlib / libraries"


def child(port: int, engine_url: str, stats_path: str) -> None:
    import cProfile

    # uvicorn restores the handler it found and re-raises the signal after its shutdown:
    # make that handler end the process normally, so the profile below is written
    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _exit)
    # import before profiling, so the split is serving, not start-up (lazy imports still show)
    sys.path.insert(0, str(ROOT))
    import uvicorn  # noqa: F401

    import gateway.app
    if os.environ.get("PROFILE_ADMISSION"):  # FCFS, as bench/peers.py runs it; default: the fleet file's (SLOMax)
        import slomax

        name, make = os.environ["PROFILE_ADMISSION"], slomax.make_admission
        gateway.app.make_admission = lambda _policy, cfg=None: make(name, cfg)  # type: ignore[assignment]
    if os.environ.get("PROFILE_GC_THRESHOLDS"):  # an experiment: thresholds other than the gateway's
        gateway.app.GC_THRESHOLDS = tuple(int(x) for x in os.environ["PROFILE_GC_THRESHOLDS"].split(","))  # type: ignore[assignment]
    pauses = _watch_gc()
    prof = cProfile.Profile()
    prof.enable()
    try:
        oo.child(port, engine_url)  # returns when uvicorn handles SIGTERM
    finally:
        prof.disable()
        prof.dump_stats(stats_path)
        _print_gc(pauses)


def _watch_gc() -> dict[int, list[float]]:
    """Every collection's pause, by generation (gc.callbacks), from here to the end."""
    import gc
    import time

    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    started: list[float] = [0.0]

    def cb(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses[info["generation"]].append(time.perf_counter() - started[0])

    gc.callbacks.append(cb)
    return pauses


def _print_gc(pauses: dict[int, list[float]]) -> None:
    import gc

    print(f"gc (threshold {gc.get_threshold()}, frozen {gc.get_freeze_count()} objects):", flush=True)
    for gen, ps in pauses.items():
        if ps:
            print(f"  gen {gen}: {len(ps):6d} collections, total {1e3 * sum(ps):8.1f} ms, "
                  f"max {1e3 * max(ps):6.2f} ms", flush=True)


def report(stats_path: str, top: int, requests: int) -> None:
    st = pstats.Stats(stats_path)
    by_group: dict[str, float] = {}
    funcs = []
    total = 0.0
    for (filename, line, name), (cc, nc, tt, ct, callers) in st.stats.items():  # type: ignore[attr-defined]
        g = group_of(filename)
        by_group[g] = by_group.get(g, 0.0) + tt
        total += tt
        funcs.append((tt, f"{Path(filename).name}:{line}({name})", g))
    print(f"profiled self time: {total:.2f} s")
    for g, t in sorted(by_group.items(), key=lambda kv: -kv[1]):
        print(f"  {g:<32} {100 * t / total:5.1f}%  {t:7.2f} s")
    print(f"stages, cumulative time per request (of {requests}; share of profiled self time):")
    for label, suffix, name in STAGES:
        ct = sum(v[3] for (f, _, n), v in st.stats.items()  # type: ignore[attr-defined]
                 if n == name and f.endswith(suffix))
        print(f"  {label:<50} {1e6 * ct / requests:8.1f} us  {100 * ct / total:5.1f}%")
    print(f"top {top} functions by self time:")
    for tt, fn, g in sorted(funcs, reverse=True)[:top]:
        print(f"  {100 * tt / total:5.1f}%  {fn}  [{g}]")


async def run(args: argparse.Namespace, stats_path: str) -> None:
    engine_runner, engine_url = await oo.serve(oo.engine_app(args.chunks))
    port = oo.free_port()
    env = dict(os.environ)
    if args.gc_thresholds:
        env["PROFILE_GC_THRESHOLDS"] = args.gc_thresholds
    if args.admission:
        env["PROFILE_ADMISSION"] = args.admission
    proc = subprocess.Popen([sys.executable, __file__, "--child", str(port), engine_url, stats_path], cwd=ROOT,
                            env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        await oo.wait_ready(url, proc)
        async with aiohttp.ClientSession() as session:
            await oo.round_of(session, url, args.requests, args.concurrency)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        await engine_runner.cleanup()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Profile the gateway (cProfile) under streamed load; print the CPU split.")
    p.add_argument("--requests", type=int, default=2200)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--chunks", type=int, default=16, help="SSE chunks per answer from the stub engine")
    p.add_argument("--top", type=int, default=15, help="functions to list")
    p.add_argument("--stats", metavar="FILE", help="keep the raw pstats file here")
    p.add_argument("--gc-thresholds", metavar="A,B,C",
                   help="run the gateway with these gc thresholds instead of gateway.app.GC_THRESHOLDS")
    p.add_argument("--admission", choices=("fcfs", "slomax"),
                   help="the gateway's admission policy (default: the fleet file's, SLOMax; bench/peers.py runs fcfs)")
    p.add_argument("--child", nargs=3, metavar=("PORT", "ENGINE_URL", "STATS"), help=argparse.SUPPRESS)
    return p


def main() -> int:
    args = build_parser().parse_args()
    if args.child:
        child(int(args.child[0]), args.child[1], args.child[2])
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stats_path = args.stats or os.path.join(tmp, "gateway.pstats")
        asyncio.run(run(args, stats_path))
        report(stats_path, args.top, args.requests)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
