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
import contextlib
import json
import logging
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from prometheus_client import disable_created_metrics

from fleetcore import hardware
from fleetcore.interconnect import Link
from fleetcore.prefix import block_hashes

from .driver import DriverStopped, EngineDriver, RequestAborted, RequestStream, TokenUpdate
from .engine import EngineConfig, SimEngine
from .metrics import CONTENT_TYPE_LATEST, SimMetrics
from .pd import PD_ROLES, PDLeg, PDPeer, parse_pd
from .openai_wire import (
    SSE_DONE,
    ApiError,
    ChatWire,
    ChoiceOut,
    CompletionWire,
    GenerateWire,
    GenRequest,
    bad_request,
    chat_prompt_ids,
    completion_prompt_ids,
    embeddings_body,
    output_text,
    parse_generate,
    parse_embeddings,
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
    # Set: an embedding model of this size, serving /v1/embeddings only (as vLLM's pooling runner).
    embedding_dim: int | None = None
    # Prefill/decode disaggregation (engine_adapters.sim.pd): SGLang's `--disaggregation-mode`
    # / vLLM's kv_role; the link KV leaves this worker by (the site's `interconnect`); how long
    # a decode leg waits for its KV and a prefilled KV waits to be pulled (wall seconds).
    pd_role: str = "mixed"
    kv_link_gb_s: float = 50.0
    kv_link_latency_ms: float = 0.01
    pd_wait_timeout_s: float = 30.0
    pd_hold_timeout_s: float = 30.0


class Wire(Protocol):
    def start(self) -> list[dict[str, Any]]: ...
    def delta(self, text: str, n_tokens: int = 1, index: int = 0) -> dict[str, Any]: ...
    def finish(self, reason: str, cached: int = 0, e2e: float | None = None, index: int = 0) -> dict[str, Any]: ...
    def usage_chunk(self, u: dict[str, Any]) -> dict[str, Any] | None: ...
    def full(self, choices: list[ChoiceOut], u: dict[str, Any], e2e: float | None = None) -> dict[str, Any]: ...


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
        if config.pd_role not in PD_ROLES:
            raise ValueError(f"pd_role must be one of {', '.join(PD_ROLES)}, not {config.pd_role!r}")
        self.pd = PDPeer(self.driver, ecfg.model, Link(config.kv_link_gb_s * 1e9, config.kv_link_latency_ms / 1000),
                         config.time_scale, self.instance_id, wait_timeout_s=config.pd_wait_timeout_s,
                         hold_timeout_s=config.pd_hold_timeout_s, tp=config.tp)
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
        r.add_post("/v1/embeddings", _api(self.embeddings))
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
        r.add_post("/pd/kv_pull", _api(self.pd_pull))
        r.add_get("/pd/state", self.pd_state)
        r.add_post("/tokenize", _api(self.tokenize))
        r.add_post("/v1/completions/render", _api(self.render_completion))
        r.add_post("/v1/chat/completions/render", _api(self.render_chat))
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self.driver.start()

    async def _on_shutdown(self, app: web.Application) -> None:
        # Ends in-flight streams and KV feeds so the server can close connections fast.
        try:
            await self.driver.stop()
        finally:
            await self.pd.close()  # its pull session (decode side) and hold timers

    # -- generation -------------------------------------------------------------

    def _generative(self, api: str) -> None:
        if self.config.embedding_dim is not None:
            raise bad_request(f"The model does not support the {api} API: it is an embedding model", "model")

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        """One engine request per input, prefill only (output_len 1: the first token comes out of
        the prefill step), so embedding time is the roofline's prefill of the input."""
        if self.config.embedding_dim is None:
            raise bad_request("The model does not support the Embeddings API", "model")
        body = parse_json_object(await request.read())
        req = parse_embeddings(body, self.config.served_model_name, self.max_model_len,
                               self.config.embedding_dim, self._request_id(request))
        if self.loading:
            raise ApiError(503, "The engine is still loading its model.", "ServiceUnavailableError")
        streams: list[RequestStream] = []
        headers = {"X-Request-Id": req.request_id}
        async with contextlib.AsyncExitStack() as stack:
            try:
                for i, ids in enumerate(req.inputs):
                    st = self.driver.submit(req.request_id if i == 0 else f"{req.request_id}.{i}", len(ids),
                                            block_hashes(ids, self.config.block_size), 1, "stop")
                    streams.append(await stack.enter_async_context(st))
            except ValueError as exc:
                raise bad_request(str(exc)) from None
            try:
                async for _ in _merged(streams):
                    pass
            except DriverStopped as exc:
                return _error_response(ApiError(503, str(exc), "ServiceUnavailableError"), headers)
        return web.json_response(embeddings_body(req), headers=headers)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self._generative("Completions")
        body = parse_json_object(await request.read())
        req = parse_openai("completion", body, self.config.served_model_name, self.max_model_len,
                           self._request_id(request))
        return await self._serve(request, req, parse_pd(body, self.config.pd_role))  # type: ignore[arg-type]

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        self._generative("Chat Completions")
        body = parse_json_object(await request.read())
        req = parse_openai("chat", body, self.config.served_model_name, self.max_model_len,
                           self._request_id(request))
        return await self._serve(request, req, parse_pd(body, self.config.pd_role))  # type: ignore[arg-type]

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = parse_json_object(await request.read())
        req = parse_generate(body, self.config.served_model_name, self.max_model_len,
                             self._request_id(request))
        return await self._serve(request, req, parse_pd(body, self.config.pd_role))  # type: ignore[arg-type]

    @staticmethod
    def _request_id(request: web.Request) -> str | None:
        rid = request.headers.get("X-Request-Id", "").strip()
        return rid or None

    def _submit(self, req: GenRequest) -> list[RequestStream]:
        """One engine sequence per choice (as vLLM runs `n`): they share the prompt, so the
        prefix cache serves the copies; choice 0 keeps the request id (abort, tracing)."""
        if self.loading:
            raise ApiError(503, "The engine is still loading its model.", "ServiceUnavailableError")
        hashes = block_hashes(req.prompt_ids, self.config.block_size)
        streams: list[RequestStream] = []
        try:
            for i, plan in enumerate(req.choice_plans()):
                rid = req.request_id if i == 0 else f"{req.request_id}.{i}"
                streams.append(self.driver.submit(rid, len(req.prompt_ids), hashes, plan.output_len,
                                                  plan.finish_reason))
        except ValueError as exc:  # duplicate id, or too long for this engine
            for st in streams:
                self.driver.abort(st.request_id)
            raise bad_request(str(exc)) from None
        return streams

    async def _serve(self, request: web.Request, req: GenRequest, pd: PDLeg | None = None) -> web.StreamResponse:
        if pd is not None:
            return await self._serve_pd(request, req, pd)
        streams = self._submit(req)
        headers = {"X-Request-Id": req.request_id}
        # The exit stack closes every choice's stream: a cancelled handler (client gone)
        # aborts all of them in the engine.
        async with contextlib.AsyncExitStack() as stack:
            for st in streams:
                await stack.enter_async_context(st)
            if req.stream:
                return await self._serve_stream(request, req, streams, headers)
            return await self._serve_full(req, streams, headers)

    async def _serve_pd(self, request: web.Request, req: GenRequest, pd: PDLeg) -> web.StreamResponse:
        """One leg of a disaggregated request (engine_adapters.sim.pd). Prefill: prefill-only, one
        token out, the KV held for the decode side's pull. Decode: the KV pulled before the
        response starts (a failed transfer is an HTTP error, not a broken stream), then decoding."""
        if self.loading:
            raise ApiError(503, "The engine is still loading its model.", "ServiceUnavailableError")
        if req.n > 1:
            raise bad_request("`n` > 1 is not supported on a disaggregated request", "n")
        headers = {"X-Request-Id": req.request_id}
        hashes = block_hashes(req.prompt_ids, self.config.block_size)
        if pd.side == "decode":
            stream = await self.pd.receive(pd, req.request_id, len(req.prompt_ids), hashes, req.plan.output_len,
                                           req.plan.finish_reason)
            async with stream:
                if req.stream:
                    return await self._serve_stream(request, req, [stream], headers)
                return await self._serve_full(req, [stream], headers)
        plan = replace(req.plan, output_len=1, finish_reason="length")  # the prefill leg makes one token
        req = replace(req, plan=plan, plans=(plan,))
        key = pd.key or req.request_id
        try:
            stream = self.driver.submit(req.request_id, len(req.prompt_ids), hashes, 1, "length", mode="prefill")
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        self.pd.start_prefill(key, stream)
        try:
            async with stream:
                if req.stream:
                    return await self._serve_stream(request, req, [stream], headers)
                rid = req.request_id
                extra = (lambda: self.pd.transfer_params(rid)) if pd.protocol == "vllm" else None
                return await self._serve_full(req, [stream], headers, extra)
        finally:
            self.pd.prefill_ended(key, aborted=stream.aborted)

    async def pd_pull(self, request: web.Request) -> web.Response:
        body = parse_json_object(await request.read())
        key, tokens = body.get("key"), body.get("tokens")
        if not isinstance(key, str) or not key:
            raise bad_request("`key` is required", "key")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise bad_request("`tokens` must be an integer >= 0", "tokens")
        return web.json_response(await self.pd.serve_pull(key, tokens))

    async def pd_state(self, request: web.Request) -> web.Response:
        return web.json_response({"role": self.config.pd_role, **self.pd.state()})

    async def _serve_full(self, req: GenRequest, streams: list[RequestStream],
                          headers: dict[str, str], extra: Callable[[], dict[str, Any]] | None = None) -> web.Response:
        plans = req.choice_plans()
        counts = [0] * len(streams)
        reasons = [p.finish_reason for p in plans]
        cached = 0
        last_t = streams[0].arrival
        try:
            async for i, upd in _merged(streams):
                if isinstance(upd, RequestAborted):
                    reasons[i] = "abort"  # aborted via /abort_request: answer what was generated so far
                    continue
                if upd.first_token and i == 0:
                    cached = upd.cached_tokens
                counts[i] += upd.new_tokens
                last_t = max(last_t, upd.time)
        except DriverStopped as exc:
            return _error_response(ApiError(503, str(exc), "ServiceUnavailableError"), headers)
        u = usage(len(req.prompt_ids), sum(counts), cached)
        wire = _wire_for(req)
        chat = req.kind == "chat"
        choices = [ChoiceOut(output_text(p.seed, 0, c, lstrip_first=chat), r, p.seed, c)
                   for p, c, r in zip(plans, counts, reasons)]
        body = wire.full(choices, u, last_t - streams[0].arrival)
        if extra is not None:  # vLLM's P/D prefill answer: where the decode side reads the KV
            body["kv_transfer_params"] = extra()  # after the prefill: its blocks are known now
        return web.json_response(body, headers=headers)

    async def _serve_stream(self, request: web.Request, req: GenRequest, streams: list[RequestStream],
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
        plans = req.choice_plans()
        counts = [0] * len(streams)
        cached = 0
        chat = req.kind == "chat"
        arrival = streams[0].arrival
        last_t = arrival
        try:
            async for batch in _merged_batches(streams):
                buf = bytearray()
                # Whatever is already delivered goes out in one write per wake-up.
                for i, u in batch:
                    if isinstance(u, RequestAborted):
                        buf += sse(wire.finish("abort", cached, last_t - arrival, index=i))
                        continue
                    if u.first_token and i == 0:
                        cached = u.cached_tokens
                    last_t = max(last_t, u.time)
                    for _ in range(u.new_tokens):  # one chunk per token, as engines stream
                        buf += sse(wire.delta(output_text(plans[i].seed, counts[i], 1, lstrip_first=chat),
                                              index=i))
                        counts[i] += 1
                    if u.finished:
                        buf += sse(wire.finish(plans[i].finish_reason, cached, u.time - arrival, index=i))
                await resp.write(bytes(buf))
            await resp.write(self._stream_tail(req, wire, sum(counts), cached))
        except DriverStopped as exc:
            # Principle 5: a stream that cannot finish ends with an error event, not silence.
            await resp.write(sse(ApiError(503, str(exc), "ServiceUnavailableError").body()) + SSE_DONE)
        await resp.write_eof()
        return resp

    @staticmethod
    def _stream_tail(req: GenRequest, wire: Wire, n: int, cached: int) -> bytes:
        """Usage chunk (when asked for) and [DONE], after every choice's finish chunk."""
        buf = bytearray()
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
        # The request's other choices (n > 1) run as `rid.1`, `rid.2`...: they end with it.
        for other in self.driver.in_flight():
            if other.startswith(rid + "."):
                ok = self.driver.abort(other) or ok
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
        self.metrics.refresh_driver(self.driver.stats)
        body = self.metrics.render(self.engine)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VERSION})

    def _model_info(self) -> dict[str, Any]:
        return {"model_path": self.config.served_model_name, "tokenizer_path": None,
                "is_generation": self.config.embedding_dim is None,
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
            "disaggregation_mode": "null" if c.pd_role == "mixed" else c.pd_role,
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

Update = TokenUpdate | RequestAborted


async def _merged_batches(streams: list[RequestStream]) -> AsyncIterator[list[tuple[int, Update]]]:
    """The choices' updates as they come, batched per wake-up: (choice index, update), where an
    update is a RequestAborted when that choice was aborted (it ends that choice only).
    DriverStopped ends everything. One stream (n=1) is read directly: no task per request."""
    if len(streams) == 1:
        st = streams[0]
        try:
            async for upd in st:
                yield [(0, u) for u in [upd, *st.pending()]]
        except RequestAborted as exc:
            yield [(0, exc)]
        return
    queue: asyncio.Queue[tuple[int, Update | DriverStopped | None]] = asyncio.Queue()

    async def pump(i: int, st: RequestStream) -> None:
        try:
            async for upd in st:
                for u in [upd, *st.pending()]:
                    queue.put_nowait((i, u))
        except (RequestAborted, DriverStopped) as exc:
            queue.put_nowait((i, exc))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(streams)]
    open_ = len(streams)
    try:
        while open_:
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            batch: list[tuple[int, Update]] = []
            for i, item in items:
                if item is None:
                    open_ -= 1
                elif isinstance(item, DriverStopped):
                    raise item
                else:
                    batch.append((i, item))
            if batch:
                yield batch
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Update]]:
    async for batch in _merged_batches(streams):
        for item in batch:
            yield item


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
    worker.pd.side_channel = (host, bound_port)  # vLLM's remote_host/port, SGLang's bootstrap port
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
    p.add_argument("--embedding-dim", type=int, default=None,
                   help="serve as an embedding model of this size (/v1/embeddings only)")
    p.add_argument("--seed", type=int, default=0, help="reserved; output text does not depend on it")
    p.add_argument("--pd-role", choices=PD_ROLES, default="mixed",
                   help="prefill/decode disaggregation role (SGLang --disaggregation-mode, vLLM kv_role)")
    p.add_argument("--kv-link-gb-s", type=float, default=50.0, help="bandwidth KV leaves this worker by")
    p.add_argument("--kv-link-latency-ms", type=float, default=0.01, help="set-up latency of a KV transfer")
    p.add_argument("--pd-wait-timeout-s", type=float, default=30.0,
                   help="wall seconds a decode leg waits for its KV before giving up on the room")
    p.add_argument("--pd-hold-timeout-s", type=float, default=30.0,
                   help="wall seconds a prefilled KV waits to be pulled before it is freed")
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
        network_rtt_ms=args.network_rtt_ms, embedding_dim=args.embedding_dim, pd_role=args.pd_role,
        kv_link_gb_s=args.kv_link_gb_s, kv_link_latency_ms=args.kv_link_latency_ms,
        pd_wait_timeout_s=args.pd_wait_timeout_s, pd_hold_timeout_s=args.pd_hold_timeout_s)


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
