"""Live P/D benchmark: our gateway vs the real SGLang router in PD mode, on the same sim workers.

    .venv/bin/python bench/pd_live.py [--trace FILE] [--window S] [--start S] [--rate-scale X]
        [--prefill N] [--decode M] [--spec M --gpu G --tp T] [--sglang-policy cache_aware]
        [--json OUT.json]

N prefill + M decode simulated workers (`python -m engine_adapters.sim.worker --pd-role ...`,
issue 17's P/D protocols, `engine_adapters.sim.pd`), then in turn

* our gateway: `tokenfleet up` over a fleet file that attaches to them (`adapter: sim` with
  `urls`, `roles`, `pd_protocol: sglang`): TokenPilot decides per request whether to split
  (`tokenpilot.disagg`) and which P and D instances; `gateway.pd_flow` runs the SGLang
  bootstrap flow for split requests;
* the SGLang router: `sglang_router.launch_router --pd-disaggregation --prefill URL PORT ...
  --decode URL ...` (every request split, its `--policy` picks the pair).

The same trace window is replayed through each with `fleetsim.live.replay` (what `tokenfleet
bench live` and `bench/peers.py` use); every worker's prefix cache is flushed between runs. The
workers' KV transfers are modelled on the sim link (`--kv-link-gb-s`, 50 GB/s by default).
The SGLang router is installed into the peers venv as `bench/peers.py` does. Every process is
stopped by its PID on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.peers import (  # noqa: E402  (one set of process/replay helpers for both live benchmarks)
    API_KEY, DEFAULT_TRACE, MODEL, PY, Processes, _replay_through, _wait_for_log, _wait_http, ensure_sglang_router,
    flush_caches, free_port)
from fleetsim.live import prepare_workload  # noqa: E402
from fleetsim.report import format_table, write_json  # noqa: E402


async def start_pd_worker(procs: Processes, args: argparse.Namespace, role: str, i: int) -> Any:
    argv = [PY, "-m", "engine_adapters.sim.worker", "--served-model-name", MODEL, "--spec", args.spec,
            "--gpu", args.gpu, "--tp", str(args.tp), "--max-model-len", str(args.max_model_len),
            "--port", "0", "--instance-id", f"{role}{i}", "--pd-role", role,
            "--kv-link-gb-s", str(args.kv_link_gb_s),
            # Deployments raise SGLang's KV waiting/bootstrap timeouts well past their defaults;
            # a prefill queue of tens of seconds must not fail the peer's requests here.
            "--pd-wait-timeout-s", str(args.pd_timeout_s), "--pd-hold-timeout-s", str(args.pd_timeout_s)]
    proc = procs.spawn(f"{role}{i}", argv)
    m = await _wait_for_log(proc, r'^\{"event": "ready".*$')
    proc.url = json.loads(m.group(0))["url"]
    return proc


def pd_fleet(args: argparse.Namespace, prefill: Sequence[str], decode: Sequence[str]) -> dict[str, Any]:
    """Our gateway's fleet file: one site attached to the running workers, prefill ones first."""
    return {"regions": ["local"], "default_region": "local",
            "sites": [{"name": "bench", "region": "local", "jurisdiction": "local", "rtt_ms": {"local": 0},
                       "interconnect": {"bandwidth_gb_s": args.kv_link_gb_s, "latency_ms": 0.01}}],
            "models": [{"name": MODEL, "versions": ["v1"],
                        "engine": {"spec": args.spec, "max_model_len": args.max_model_len, "block_size": 16}}],
            "deployments": [{"site": "bench", "model": MODEL, "gpu": args.gpu, "tp": args.tp, "adapter": "sim",
                             "instances": len(prefill) + len(decode),
                             "roles": {"prefill": len(prefill), "decode": len(decode)},
                             "options": {"urls": [*prefill, *decode], "pd_protocol": "sglang"}}],
            "tenants": [{"name": "bench", "api_keys": [API_KEY], "region": "local"}],
            "admission": {"policy": "fcfs"}}


async def start_ours(procs: Processes, args: argparse.Namespace, prefill: Sequence[str],
                     decode: Sequence[str]) -> Any:
    path = procs.workdir / "pd-fleet.yaml"
    path.write_text(yaml.safe_dump(pd_fleet(args, prefill, decode), sort_keys=False))
    proc = procs.spawn("gateway", [PY, "-m", "tokenfleet.cli", "up", "--fleet", str(path), "--port", "0",
                                   "--router", "tokenpilot"])
    proc.url = (await _wait_for_log(proc, r"gateway\s+(http://\S+)")).group(1)
    n = len(prefill) + len(decode)
    await _wait_http(proc.url.removesuffix("/v1") + "/health", lambda j: j.get("ready_instances") == n)
    return proc


async def start_sglang_pd(procs: Processes, py: Path, prefill: Sequence[str], decode: Sequence[str],
                          policy: str) -> Any:
    port, prom = free_port(), free_port()
    argv = [str(py), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--pd-disaggregation", "--policy", policy, "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(prom), "--log-level", "warn"]
    for url in prefill:  # a sim prefill worker's bootstrap port is its HTTP port
        argv += ["--prefill", url, url.rsplit(":", 1)[1]]
    for url in decode:
        argv += ["--decode", url]
    proc = procs.spawn("sglang-router-pd", argv)
    proc.url = f"http://127.0.0.1:{port}/v1"
    await _wait_http(f"http://127.0.0.1:{port}/v1/models", lambda j: bool(j.get("data")))
    await asyncio.sleep(1.0)
    return proc


async def pd_counts(urls: Sequence[str]) -> dict[str, int]:
    """KV transfers the prefill workers made (each split request makes one)."""
    import aiohttp
    out = {}
    async with aiohttp.ClientSession() as s:
        for u in urls:
            async with s.get(u + "/pd/state") as r:
                out[u] = int((await r.json())["transfers"])
    return out


async def amain(args: argparse.Namespace) -> int:
    wl = prepare_workload(args.trace, rate_scale=args.rate_scale, window_s=args.window, start_s=args.start)
    d = wl.describe()
    print(f"machine   {os.cpu_count()} CPU cores; python {sys.version.split()[0]}")
    print(f"workload  {d['name']} x{args.rate_scale:g}, {args.window:g} s from {args.start:g} s: {d['requests']} "
          f"requests ({d['mean_rate_rps']:.2f} req/s), input mean {d['input_mean']:.0f}, "
          f"output mean {d['output_mean']:.0f}", flush=True)
    sglang_py = ensure_sglang_router(not args.no_install)
    rows: list[dict[str, Any]] = []
    splits: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="tokenfleet-pd-live-") as tmp:
        procs = Processes(Path(tmp))
        try:
            pre = await asyncio.gather(*(start_pd_worker(procs, args, "prefill", i) for i in range(args.prefill)))
            dec = await asyncio.gather(*(start_pd_worker(procs, args, "decode", i) for i in range(args.decode)))
            pu, du = [p.url for p in pre], [p.url for p in dec]
            workers = [*pre, *dec]
            print(f"workers   {len(pu)} prefill + {len(du)} decode x {args.spec} on {args.tp}x{args.gpu}", flush=True)
            for label in ("tokenfleet/tokenpilot", f"sglang-router-pd/{args.sglang_policy}"):
                await flush_caches([*pu, *du])
                before = sum((await pd_counts(pu)).values())
                front = (await start_ours(procs, args, pu, du) if label.startswith("tokenfleet")
                         else await start_sglang_pd(procs, sglang_py, pu, du, args.sglang_policy))
                key = API_KEY if label.startswith("tokenfleet") else None
                row, _, _ = await _replay_through(label, front.url, key, wl, args.concurrency, args.timeout,
                                                  [*workers, front], False, 1.0)
                procs.stop(front)
                splits[label] = sum((await pd_counts(pu)).values()) - before
                row["kv_transfers"] = splits[label]
                rows.append(row)
        finally:
            procs.stop_all()
    print()
    print(format_table(rows))
    ours, peer = rows[0], rows[1]
    p95 = (ours["ttft_ms"]["p95"] or 0) / max(peer["ttft_ms"]["p95"] or 1e-9, 1e-9)
    good = ours["goodput_tok_s"] / max(peer["goodput_tok_s"], 1e-9)
    print(f"\nsplit requests (KV transfers): {splits}")
    print(f"TTFT p95 ours / sglang-router-pd = {p95:.2f}x (target <= 0.85x); "
          f"goodput = {good:.2f}x (target >= 1x)")
    if args.json:
        write_json({"workload": d, "results": rows, "kv_transfers": splits,
                    "ratios": {"ttft_p95": round(p95, 3), "goodput": round(good, 3)}}, args.json)
        print(f"wrote {args.json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--window", type=float, default=60.0, help="seconds of the (rate-scaled) trace to replay")
    p.add_argument("--start", type=float, default=0.0)
    p.add_argument("--rate-scale", type=float, default=1.0)
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--spec", default="llama-3.1-70b")
    p.add_argument("--gpu", default="H200")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=131072)
    p.add_argument("--kv-link-gb-s", type=float, default=50.0)
    p.add_argument("--pd-timeout-s", type=float, default=300.0,
                   help="the workers' KV wait (decode) and hold (prefill) timeouts")
    p.add_argument("--sglang-policy", default="cache_aware")
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--no-install", action="store_true")
    p.add_argument("--json", default=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return asyncio.run(amain(build_parser().parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
