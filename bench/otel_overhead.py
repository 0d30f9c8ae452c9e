"""Gateway CPU per relayed request with tracing off vs on (and traces + OTLP metrics), in one run.

    .venv/bin/python bench/otel_overhead.py [--requests 400] [--rounds 5] [--concurrency 8]

One gateway process per mode, all in front of the same stub engine (aiohttp in this process,
streaming `--chunks` SSE chunks as fast as it can) and, for the modes that export, the same
OTLP/HTTP sink (also here; it answers every export at once and keeps nothing). Rounds are
interleaved across the modes (off, traces, traces+metrics, off, ...), so a neighbour's load
hits all of them alike. CPU is the gateway process's own user + system time (/proc/<pid>/stat)
over the round, exporter threads included, divided by the requests of the round. `traces 10%`
samples one trace in ten (OTEL_TRACES_SAMPLER=traceidratio). Printed:
median CPU per request per mode, the added CPU versus `off`, and the ratio. Linux only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
MODES = ("off", "traces", "traces 10%", "traces+metrics")
TICKS = os.sysconf("SC_CLK_TCK")


# --- the gateway child -------------------------------------------------------------------

def child(port: int, engine_url: str) -> None:
    """Serve the gateway on `port` in front of one static instance at `engine_url`."""
    sys.path.insert(0, str(ROOT))
    import uvicorn

    from engine_adapters.base import EngineAdapter, Instance, LoadSnapshot
    from fleetcore.fleet_config import parse_fleet
    from gateway.app import create_app

    class Static(EngineAdapter):
        name = "static"

        def __init__(self, inst: Instance) -> None:
            self._inst = inst

        @property
        def instances(self) -> list[Instance]:
            return [self._inst]

        async def launch(self) -> list[Instance]:
            return [self._inst]

        async def stop(self) -> None:
            return None

        async def health(self, instance: Instance) -> bool:
            return True

        async def snapshot(self, instance: Instance) -> LoadSnapshot:
            return LoadSnapshot(ready=True)

    config = parse_fleet({"sites": [{"name": "use1", "region": "us-east", "jurisdiction": "us"}],
                          "models": [{"name": "m1", "engine": {"spec": "llama-3.1-8b", "max_model_len": 4096}}]})
    inst = Instance(instance_id="e0", site="use1", model="m1", version="v1", url=engine_url, adapter="static")
    app = create_app(config, [Static(inst)], poll_interval_s=60)  # OTEL_* from this process's environment
    # keep-alive longer than the other modes' rounds, as `tokenfleet up` does (gateway.keep_alive_timeout_s):
    # uvicorn's 5 s default would close idle pooled connections under the client's next request
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                timeout_keep_alive=config.gateway.keep_alive_timeout_s)


# --- the stub engine and the OTLP sink -----------------------------------------------------

def engine_app(chunks: int) -> web.Application:
    async def generate(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(chunks):
            chunk = {"id": "c", "object": "chat.completion.chunk",
                     "choices": [{"index": 0, "delta": {"content": f" t{i}"},
                                  "finish_reason": "length" if i == chunks - 1 else None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"prompt_tokens": 64, "completion_tokens": chunks, "total_tokens": 64 + chunks}
        await resp.write(f"data: {json.dumps({'id': 'c', 'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_get("/health", health)
    return app


def sink_app() -> web.Application:
    async def accept(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", accept)
    app.router.add_post("/v1/metrics", accept)
    return app


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


async def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"gateway for {url} exited with {proc.returncode}")
            try:
                async with s.get(url + "/health", timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status == 200 and (await r.json())["ready_instances"] == 1:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"gateway at {url} not ready within {timeout_s} s")


async def round_of(session: aiohttp.ClientSession, url: str, n: int, concurrency: int) -> None:
    body = {"model": "m1", "messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 16,
            "stream": True}
    todo = iter(range(n))

    async def worker() -> None:
        for _ in todo:
            async with session.post(url + "/v1/chat/completions", json=body,
                                    timeout=aiohttp.ClientTimeout(total=30)) as r:
                text = await r.text()
                if r.status != 200 or "[DONE]" not in text:
                    raise RuntimeError(f"request failed: {r.status} {text[:200]}")

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def main(args: argparse.Namespace) -> None:
    engine_runner, engine_url = await serve(engine_app(args.chunks))
    sink_runner, sink_url = await serve(sink_app())
    procs: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    envs = {"off": {},
            "traces": {"OTEL_EXPORTER_OTLP_ENDPOINT": sink_url, "OTEL_METRICS_EXPORTER": "none"},
            "traces 10%": {"OTEL_EXPORTER_OTLP_ENDPOINT": sink_url, "OTEL_METRICS_EXPORTER": "none",
                           "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"},
            "traces+metrics": {"OTEL_EXPORTER_OTLP_ENDPOINT": sink_url, "OTEL_METRIC_EXPORT_INTERVAL": "1000"}}
    try:
        for mode in MODES:
            port = free_port()
            proc = subprocess.Popen([sys.executable, __file__, "--child", str(port), engine_url],
                                    env={**base_env, **envs[mode]}, cwd=ROOT)
            procs[mode] = (proc, f"http://127.0.0.1:{port}")
        for proc, url in procs.values():
            await wait_ready(url, proc)
        per_req: dict[str, list[float]] = {m: [] for m in MODES}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            for mode, (_, url) in procs.items():  # warm-up: imports, JIT-free but caches and pools
                await round_of(session, url, max(50, args.requests // 10), args.concurrency)
            for r in range(args.rounds):
                for mode, (proc, url) in procs.items():
                    before = cpu_s(proc.pid)
                    await round_of(session, url, args.requests, args.concurrency)
                    await asyncio.sleep(0.3)  # let the batch exporter's thread catch up inside the round
                    per_req[mode].append((cpu_s(proc.pid) - before) / args.requests)
                print(f"round {r + 1}: " + ", ".join(f"{m} {per_req[m][-1] * 1e6:.0f} us" for m in MODES), flush=True)
        off = statistics.median(per_req["off"])
        print(f"\n{args.requests} streamed requests x {args.rounds} rounds, concurrency {args.concurrency}, "
              f"{args.chunks} chunks each; gateway process CPU per request (median over rounds):")
        print(f"{'mode':<16}{'cpu/req':>12}{'added':>12}{'ratio':>8}")
        for mode in MODES:
            med = statistics.median(per_req[mode])
            print(f"{mode:<16}{med * 1e6:>10.0f}us{(med - off) * 1e6:>10.0f}us{med / off:>8.3f}")
    finally:
        for proc, _ in procs.values():
            proc.terminate()
        for proc, _ in procs.values():
            try:  # in a thread: the sink here must keep answering the gateways' last exports
                await asyncio.to_thread(proc.wait, 10)
            except subprocess.TimeoutExpired:
                proc.kill()
        await engine_runner.cleanup()
        await sink_runner.cleanup()


def parse_args(argv: list[str] | None = None) -> Any:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=400, help="requests per mode per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--chunks", type=int, default=16, help="SSE chunks per streamed answer")
    p.add_argument("--child", nargs=2, metavar=("PORT", "ENGINE_URL"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    a = parse_args()
    if a.child:
        child(int(a.child[0]), a.child[1])
    else:
        asyncio.run(main(a))
