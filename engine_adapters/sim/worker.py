"""The live simulated worker: an OpenAI-compatible HTTP server in front of a SimEngine.

It looks like a vLLM (and, where peer routers probe, an SGLang) server: same
endpoints, JSON shapes, Prometheus names and KV event batches, so the gateway,
its adapters and peer routers cannot tell it from a real engine except by the
text it writes (deterministic pseudo-words). Timing comes from the engine's
roofline physics, played out in real time scaled by ``--time-scale``.

Run: ``python -m engine_adapters.sim.worker --served-model-name NAME --port 0``;
it prints one JSON line ``{"event": "ready", "url": ..., "port": ..., "instance_id": ...}``
on stdout once it listens, and exits cleanly on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from prometheus_client import disable_created_metrics

from fleetcore import hardware
from fleetcore.prefix import block_hashes

from .driver import DriverStopped, EngineDriver, RequestAborted, RequestStream
from .engine import EngineConfig, SimEngine
from .metrics import CONTENT_TYPE_LATEST, SimMetrics
from .openai_wire import (
    SSE_DONE,
    ApiError,
    ChatWire,
    CompletionWire,
    GenerateWire,
    GenRequest,
    bad_request,
    chat_prompt_ids,
    completion_prompt_ids,
    output_text,
    parse_generate,
    parse_json_object,
    parse_openai,
    sse,
    usage,
)

log = logging.getLogger(__name__)

VERSION = "0.1.0+tokenfleet.sim"
# How long SIGTERM waits for open connections after the engine has stopped.
_SHUTDOWN_TIMEOUT_S = 2.0
_KV_SUBSCRIBER_QUEUE = 1024


@dataclass(slots=True)
class WorkerConfig:
    served_model_name: str
    spec: str = "llama-3.1-8b"
    gpu: str = "H100"
    tp: int = 1
    block_size: int = 16
    max_model_len: int | None = None  # None: the model's, capped by KV capacity
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    time_scale: float = 1.0
    instance_id: str | None = None
    # Accepted for CLI compatibility and reserved: output text depends only on the prompt
    # (and the request's own `seed`), so every instance answers a prompt identically and
    # a retry on another instance writes the same words.
    seed: int = 0
    # Wall seconds after start during which the worker is "loading weights": it listens, but
    # health and generation answer 503, as a real engine that is still starting is not ready.
    startup_s: float = 0.0
    # An emulated network between gateway and worker: every request is served one round trip
    # late, so a local fleet can stand for sites far apart (TTFT grows by the RTT).
    network_rtt_ms: float = 0.0


class Wire(Protocol):
    def start(self) -> list[dict[str, Any]]: ...
    def delta(self, text: str, n_tokens: int = 1) -> dict[str, Any]: ...
    def finish(self, reason: str, cached: int = 0, e2e: float | None = None) -> dict[str, Any]: ...
    def usage_chunk(self, u: dict[str, Any]) -> dict[str, Any] | None: ...
    def full(self, text: str, reason: str, u: dict[str, Any], e2e: float | None = None) -> dict[str, Any]: ...


def _wire_for(req: GenRequest) -> Wire:
    if req.kind == "chat":
        return ChatWire(req)
    if req.kind == "completion":
        return CompletionWire(req)
    return GenerateWire(req)


def _error_response(err: ApiError, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=headers)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _api(handler: Handler) -> Handler:
    """Turn ApiError (and engine refusals) into OpenAI error bodies; never a bare 500 page."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as err:
            return _error_response(err)
        except DriverStopped as exc:
            return _error_response(ApiError(503, str(exc), "ServiceUnavailableError"))

    return wrapped


def _network_delay(rtt_s: float) -> Any:
    """Serve every request one emulated round trip late (see WorkerConfig.network_rtt_ms)."""

    @web.middleware
    async def delay(request: web.Request, handler: Handler) -> web.StreamResponse:
        await asyncio.sleep(rtt_s)
        return await handler(request)

    return delay


class SimWorker:
    """One simulated engine instance and its HTTP face."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.instance_id = config.instance_id or f"sim-{uuid.uuid4().hex[:8]}"
        ecfg = EngineConfig(
            model=hardware.model(config.spec), gpu=hardware.gpu(config.gpu), tp=config.tp,
            block_size=config.block_size, max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs, gpu_memory_utilization=config.gpu_memory_utilization,
            max_model_len=config.max_model_len, num_gpu_blocks_override=config.num_gpu_blocks_override)
        self.engine = SimEngine(ecfg)
        self.max_model_len = self.engine.max_model_len
        self.num_gpu_blocks = self.engine.num_gpu_blocks
        self.metrics = SimMetrics(config.served_model_name, config.block_size, self.num_gpu_blocks)
        self.driver = EngineDriver(self.engine, config.time_scale, observer=self.metrics)
        self.started = time.time()
        self.loaded_at = time.monotonic() + max(0.0, config.startup_s)

    @property
    def loading(self) -> bool:
        return time.monotonic() < self.loaded_at

    # -- app --------------------------------------------------------------------

    def make_app(self) -> web.Application:
        middlewares = [_network_delay(self.config.network_rtt_ms / 1000)] if self.config.network_rtt_ms > 0 else []
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=middlewares)
        app[WORKER_KEY] = self
        app.on_startup.append(self._on_startup)
        app.on_shutdown.append(self._on_shutdown)
        r = app.router
        r.add_post("/v1/completions", _api(self.completions))
        r.add_post("/v1/chat/completions", _api(self.chat_completions))
        r.add_post("/generate", _api(self.generate))
        r.add_get("/v1/models", self.models)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_get("/metrics", self.metrics_endpoint)
        r.add_get("/kv_events", self.kv_events)
        r.add_post("/abort_request", _api(self.abort_request))
        for path in ("/flush_cache", "/reset_prefix_cache"):
            r.add_post(path, self.reset_prefix_cache)
            r.add_get(path, self.reset_prefix_cache)  # SGLang accepts both methods
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        r.add_get("/get_load", self.get_load)
        r.add_get("/v1/loads", self.loads)
        r.add_get("/load", self.vllm_load)
        r.add_get("/version", self.version)
        r.add_post("/tokenize", _api(self.tokenize))
        r.add_post("/v1/completions/render", _api(self.render_completion))
        r.add_post("/v1/chat/completions/render", _api(self.render_chat))
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self.driver.start()

    async def _on_shutdown(self, app: web.Application) -> None:
        # Ends in-flight streams and KV feeds so the server can close connections fast.
        await self.driver.stop()

    # -- generation -------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = parse_json_object(await request.read())
        req = parse_openai("completion", body, self.config.served_model_name, self.max_model_len,
                           self._request_id(request))
        return await self._serve(request, req)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = parse_json_object(await request.read())
        req = parse_openai("chat", body, self.config.served_model_name, self.max_model_len,
                           self._request_id(request))
        return await self._serve(request, req)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = parse_json_object(await request.read())
        req = parse_generate(body, self.config.served_model_name, self.max_model_len,
                             self._request_id(request))
        return await self._serve(request, req)

    @staticmethod
    def _request_id(request: web.Request) -> str | None:
        rid = request.headers.get("X-Request-Id", "").strip()
        return rid or None

    def _submit(self, req: GenRequest) -> RequestStream:
        if self.loading:
            raise ApiError(503, "The engine is still loading its model.", "ServiceUnavailableError")
        hashes = block_hashes(req.prompt_ids, self.config.block_size)
        try:
            return self.driver.submit(req.request_id, len(req.prompt_ids), hashes, req.plan.output_len,
                                      req.plan.finish_reason)
        except ValueError as exc:  # duplicate id, or too long for this engine
            raise bad_request(str(exc)) from None

    async def _serve(self, request: web.Request, req: GenRequest) -> web.StreamResponse:
        stream = self._submit(req)
        headers = {"X-Request-Id": req.request_id}
        # `async with`: a cancelled handler (client gone) aborts the engine request.
        async with stream:
            if req.stream:
                return await self._serve_stream(request, req, stream, headers)
            return await self._serve_full(req, stream, headers)

    async def _serve_full(self, req: GenRequest, stream: RequestStream,
                          headers: dict[str, str]) -> web.Response:
        n = cached = 0
        last_t = stream.arrival
        reason = req.plan.finish_reason
        try:
            async for upd in stream:
                if upd.first_token:
                    cached = upd.cached_tokens
                n += upd.new_tokens
                last_t = upd.time
        except DriverStopped as exc:
            return _error_response(ApiError(503, str(exc), "ServiceUnavailableError"), headers)
        except RequestAborted:
            reason = "abort"  # aborted via /abort_request: answer what was generated so far
        u = usage(len(req.prompt_ids), n, cached)
        wire = _wire_for(req)
        text = output_text(req.plan.seed, 0, n, lstrip_first=req.kind == "chat")
        body = wire.full(text, reason, u, last_t - stream.arrival)
        return web.json_response(body, headers=headers)

    async def _serve_stream(self, request: web.Request, req: GenRequest, stream: RequestStream,
                            headers: dict[str, str]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        wire = _wire_for(req)
        buf = bytearray()
        for chunk in wire.start():
            buf += sse(chunk)
        if buf:
            await resp.write(bytes(buf))
        n = cached = 0
        seed = req.plan.seed
        chat = req.kind == "chat"
        last_t = stream.arrival
        try:
            async for upd in stream:
                buf = bytearray()
                # Drain whatever else is already delivered: one write per wake-up.
                for u in [upd, *stream.pending()]:
                    if u.first_token:
                        cached = u.cached_tokens
                    last_t = u.time
                    for _ in range(u.new_tokens):  # one chunk per token, as engines stream
                        buf += sse(wire.delta(output_text(seed, n, 1, lstrip_first=chat)))
                        n += 1
                    if u.finished:
                        buf += self._stream_tail(req, wire, req.plan.finish_reason, n, cached,
                                                 u.time - stream.arrival)
                await resp.write(bytes(buf))
        except RequestAborted:
            await resp.write(self._stream_tail(req, wire, "abort", n, cached, last_t - stream.arrival))
        except DriverStopped as exc:
            # Principle 5: a stream that cannot finish ends with an error event, not silence.
            await resp.write(sse(ApiError(503, str(exc), "ServiceUnavailableError").body()) + SSE_DONE)
        await resp.write_eof()
        return resp

    @staticmethod
    def _stream_tail(req: GenRequest, wire: Wire, reason: str, n: int, cached: int, e2e: float) -> bytes:
        """Finish chunk, usage chunk (when asked for) and [DONE]."""
        buf = bytearray(sse(wire.finish(reason, cached, e2e)))
        if req.include_usage:
            chunk = wire.usage_chunk(usage(len(req.prompt_ids), n, cached))
            if chunk is not None:
                buf += sse(chunk)
        buf += SSE_DONE
        return bytes(buf)

    # -- control ------------------------------------------------------------------

    async def abort_request(self, request: web.Request) -> web.Response:
        body = parse_json_object(await request.read())
        rid = body.get("rid") or body.get("request_id")
        if not isinstance(rid, str) or not rid:
            raise bad_request("`rid` is required", "rid")
        ok = self.driver.abort(rid)
        if not ok:
            # Accept the response id too (cmpl-/chatcmpl- prefix + engine id).
            for prefix in ("chatcmpl-", "cmpl-"):
                if rid.startswith(prefix):
                    ok = self.driver.abort(rid[len(prefix):])
                    break
        return web.json_response({"success": ok, "rid": rid})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        if self.driver.reset_prefix_cache():
            return web.json_response({"success": True, "message": "Cache flushed."})
        # vLLM and SGLang both refuse while requests hold blocks.
        err = ApiError(400, "Cache not flushed: requests are running.", param=None)
        return _error_response(err)

    # -- probes -------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if self.loading:
            return web.Response(status=503, text="loading model")
        if self.driver.alive:
            return web.Response(status=200)
        return web.Response(status=503, text="engine driver not running")

    async def models(self, request: web.Request) -> web.Response:
        name = self.config.served_model_name
        return web.json_response({"object": "list", "data": [{
            "id": name, "object": "model", "created": int(self.started), "owned_by": "tokenfleet",
            "root": self.config.spec, "parent": None, "max_model_len": self.max_model_len,
            "permission": []}]})

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        body = self.metrics.render(self.engine)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VERSION})

    def _model_info(self) -> dict[str, Any]:
        return {"model_path": self.config.served_model_name, "tokenizer_path": None, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": "default",
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": "llama", "architectures": ["LlamaForCausalLM"]}

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(self._model_info())

    async def server_info(self, request: web.Request) -> web.Response:
        c = self.config
        bs = c.block_size
        info: dict[str, Any] = {
            **self._model_info(),
            "served_model_name": c.served_model_name,
            "instance_id": self.instance_id,
            "engine": "tokenfleet-sim",
            "version": VERSION,
            "spec": c.spec, "gpu": c.gpu, "tp_size": c.tp, "dp_size": 1,
            "page_size": bs, "block_size": bs, "kv_block_size": bs,
            "num_gpu_blocks": self.num_gpu_blocks,
            "max_total_num_tokens": self.num_gpu_blocks * bs,
            "context_length": self.max_model_len, "max_model_len": self.max_model_len,
            "max_running_requests": c.max_num_seqs, "chunked_prefill_size": c.max_num_batched_tokens,
            "time_scale": c.time_scale,
            "internal_states": [{"last_gen_throughput": 0.0, "avg_spec_accept_length": None}],
            # vLLM's server_info nests the engine config; routers read the block size there.
            "vllm_config": {
                "model_config": {"model": c.served_model_name, "max_model_len": self.max_model_len},
                "cache_config": {"block_size": bs, "num_gpu_blocks": self.num_gpu_blocks,
                                 "enable_prefix_caching": True},
                "parallel_config": {"tensor_parallel_size": c.tp, "data_parallel_size": 1},
                "scheduler_config": {"max_num_seqs": c.max_num_seqs,
                                     "max_num_batched_tokens": c.max_num_batched_tokens},
            },
        }
        return web.json_response(info)

    def _load_numbers(self) -> tuple[int, int, int]:
        """(running, waiting, KV tokens in use)."""
        e = self.engine
        used = round(e.kv_usage * self.num_gpu_blocks * self.config.block_size)
        return e.num_running, e.num_waiting, used

    async def get_load(self, request: web.Request) -> web.Response:
        running, waiting, used = self._load_numbers()
        return web.json_response([{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting,
                                   "num_tokens": used}])

    async def loads(self, request: web.Request) -> web.Response:
        running, waiting, used = self._load_numbers()
        total = self.num_gpu_blocks * self.config.block_size
        return web.json_response({"timestamp": time.time(), "dp_rank_count": 1, "loads": [{
            "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
            "num_total_reqs": running + waiting, "num_used_tokens": used, "max_total_num_tokens": total,
            "token_usage": used / total if total else 0.0}]})

    async def vllm_load(self, request: web.Request) -> web.Response:
        running, waiting, _ = self._load_numbers()
        return web.json_response({"server_load": running + waiting})

    # -- tokenization ---------------------------------------------------------------

    def _render_ids(self, body: dict[str, Any]) -> list[int]:
        model = body.get("model")
        if model is not None and model != self.config.served_model_name:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model")
        if body.get("messages") is not None:
            return chat_prompt_ids(body)
        return completion_prompt_ids(body)

    async def tokenize(self, request: web.Request) -> web.Response:
        body = parse_json_object(await request.read())
        ids = self._render_ids(body)
        return web.json_response({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                                  "token_strs": None})

    def _render_result(self, kind: str, ids: list[int], body: dict[str, Any]) -> dict[str, Any]:
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        return {"request_id": prefix + uuid.uuid4().hex, "token_ids": ids, "features": None,
                "sampling_params": {"max_tokens": body.get("max_tokens")},
                "model": self.config.served_model_name, "stream": bool(body.get("stream", False)),
                "stream_options": body.get("stream_options"), "cache_salt": None, "priority": 0,
                "kv_transfer_params": None}

    async def render_completion(self, request: web.Request) -> web.Response:
        """vLLM /v1/completions/render: a list, one GenerateRequest per prompt."""
        body = parse_json_object(await request.read())
        ids = self._render_ids({k: v for k, v in body.items() if k != "messages"})
        return web.json_response([self._render_result("completion", ids, body)])

    async def render_chat(self, request: web.Request) -> web.Response:
        """vLLM /v1/chat/completions/render: one GenerateRequest."""
        body = parse_json_object(await request.read())
        if body.get("messages") is None:
            raise bad_request("`messages` is required", "messages")
        return web.json_response(self._render_result("chat", self._render_ids(body), body))

    # -- KV events --------------------------------------------------------------------

    async def kv_events(self, request: web.Request) -> web.StreamResponse:
        """NDJSON feed: one vLLM KVEventBatch per line, for as long as the client stays."""
        sub = self.driver.subscribe_kv(_KV_SUBSCRIBER_QUEUE)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache",
                                           "X-Instance-Id": self.instance_id})
        try:
            await resp.prepare(request)
            async for batch in sub:
                await resp.write(json.dumps(batch.to_json(), separators=(",", ":")).encode() + b"\n")
        finally:
            sub.close()
        await resp.write_eof()
        return resp


WORKER_KEY = web.AppKey("tokenfleet_sim_worker", SimWorker)


# -- running it -----------------------------------------------------------------------


async def start_worker(config: WorkerConfig | None = None, *, host: str = "127.0.0.1", port: int = 0,
                       access_log: bool = False, **overrides: Any) -> tuple[web.AppRunner, str]:
    """Start a worker on the running loop; returns (runner, base URL). Stop with ``runner.cleanup()``.

    Either pass a WorkerConfig or its fields as keywords (``served_model_name=...``).
    The SimWorker is ``runner.app[WORKER_KEY]``.
    """
    if config is None:
        config = WorkerConfig(**overrides)
    elif overrides:
        config = WorkerConfig(**{**asdict(config), **overrides})
    worker = SimWorker(config)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts
    # the engine request (aiohttp >= 3.9 no longer does this by default).
    runner = web.AppRunner(worker.make_app(), handler_cancellation=True,
                           access_log=logging.getLogger("aiohttp.access") if access_log else None,
                           shutdown_timeout=_SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound_port = runner.addresses[0][1]
    return runner, f"http://{host}:{bound_port}"


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine_adapters.sim.worker",
                                description="Simulated LLM engine behind an OpenAI-compatible server.")
    p.add_argument("--served-model-name", required=True)
    p.add_argument("--spec", default="llama-3.1-8b", help="model spec (fleetcore.hardware)")
    p.add_argument("--gpu", default="H100")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--time-scale", type=float, default=1.0, help="wall seconds per physical second")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--instance-id", default=None)
    p.add_argument("--startup-s", type=float, default=0.0,
                   help="seconds of 'loading weights' (503 on health and generation) after start")
    p.add_argument("--network-rtt-ms", type=float, default=0.0,
                   help="emulated round trip added to every request (a far-away site)")
    p.add_argument("--seed", type=int, default=0, help="reserved; output text does not depend on it")
    p.add_argument("--log-level", default="warning")
    return p


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig(
        served_model_name=args.served_model_name, spec=args.spec, gpu=args.gpu, tp=args.tp,
        block_size=args.block_size, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_gpu_blocks_override=args.num_gpu_blocks_override, time_scale=args.time_scale,
        instance_id=args.instance_id, seed=args.seed, startup_s=args.startup_s,
        network_rtt_ms=args.network_rtt_ms)


async def _serve_forever(config: WorkerConfig, host: str, port: int, access_log: bool) -> None:
    runner, url = await start_worker(config, host=host, port=port, access_log=access_log)
    worker = runner.app[WORKER_KEY]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    bound = int(url.rsplit(":", 1)[1])
    # The launcher reads exactly this one line to learn the port: nothing else goes to stdout.
    sys.stdout.write(json.dumps({"event": "ready", "url": url, "port": bound,
                                 "instance_id": worker.instance_id}) + "\n")
    sys.stdout.flush()
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


class _DropMalformedRequests(logging.Filter):
    """Peer routers probe for gRPC (an HTTP/2 preface) before falling back to HTTP/1;
    aiohttp answers 400 and logs each probe as an ERROR with a traceback. Not our error."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, BadHttpMessage)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.server").addFilter(_DropMalformedRequests())
    # vLLM exports no `_created` series; process-wide, so only done in the standalone worker.
    disable_created_metrics()
    try:
        config = config_from_args(args)
        # Access lines (stderr) only when asked for: a fleet of workers would drown in them.
        access_log = logging.getLogger().isEnabledFor(logging.INFO)
        asyncio.run(_serve_forever(config, args.host, args.port, access_log))
    except ValueError as exc:  # unknown model/GPU, model does not fit: a usage error
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
