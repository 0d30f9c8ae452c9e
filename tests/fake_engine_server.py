"""A stand-in for a vLLM/SGLang server process, for adapter tests without the real engine.

Launched through the adapters exactly like the real thing (`python -m
vllm.entrypoints.openai.api_server ...`, via a shim package the tests put on
PYTHONPATH). It records its argv and environment, forks a helper process the way
vLLM forks its engine core, serves /health, /metrics and a minimal
/v1/completions, and publishes one `BlockStored` KV event per completion to the
`--kv-events-config` endpoint, in vLLM's wire format. FAKE_ENGINE_MODE:
"crash" exits at once, "ignore_term" ignores SIGTERM (to test the kill after the grace period),
"hang" never answers (to test the readiness timeout).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import msgpack
import zmq
from aiohttp import web

METRICS = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="{model}"}} {running}
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="{model}"}} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="{model}"}} 0.25
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",model_name="{model}"}} {hits}
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="{block_size}",enable_prefix_caching="True",engine="0"}} 1.0
"""


def main() -> None:
    mode = os.environ.get("FAKE_ENGINE_MODE", "")
    if mode == "crash":
        print("fake engine: CUDA out of memory (pretend)", flush=True)
        sys.exit(3)
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--served-model-name", default="m")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-events-config")
    args, _ = p.parse_known_args()
    record = os.environ.get("FAKE_ENGINE_RECORD")
    # A helper in our process group, like vLLM's engine core; it must die with the group.
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    if record:
        with open(record, "w") as f:
            json.dump({"argv": sys.argv[1:], "pid": os.getpid(), "helper_pid": helper.pid,
                       "pgid": os.getpgid(0),
                       "env": {k: v for k, v in os.environ.items()
                               if k.startswith(("HF_", "VLLM_", "TRANSFORMERS_", "FAKE_"))}},
                      f)
    if mode == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "hang":
        time.sleep(600)
    asyncio.run(serve(args))


async def serve(args: argparse.Namespace) -> None:
    pub = None
    topic = b""
    if args.kv_events_config:
        cfg = json.loads(args.kv_events_config)
        pub = zmq.Context.instance().socket(zmq.PUB)
        pub.connect(cfg["endpoint"])  # vLLM connects to a host:port endpoint
        topic = cfg.get("topic", "").encode()
    state = {"seq": 0, "hits": 0.0}

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=METRICS.format(model=args.served_model_name, running=0,
                                                hits=state["hits"], block_size=args.block_size))

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        ids = [int(t) for t in body.get("prompt_token_ids", [])]
        bs = args.block_size
        full = len(ids) - len(ids) % bs
        if pub is not None and full:
            hashes = [10_000 + state["seq"] * 1000 + i for i in range(full // bs)]
            ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                  "token_ids": ids[:full], "block_size": bs, "lora_id": None, "medium": "GPU"}
            payload = msgpack.packb([time.time(), [ev], 0])
            pub.send_multipart([topic, state["seq"].to_bytes(8, "big"), payload])
            state["seq"] += 1
        return web.json_response({"id": "x", "object": "text_completion", "choices": [
            {"index": 0, "text": "ok", "finish_reason": "length"}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1}})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    main()
