"""The FastAPI app: composition root of the serving path.

`create_app` wires config, adapters (already launched by the CLI), fleet state,
policies and the relay. The lifespan owns only what the app itself creates:
the fleet-state pollers and the relay's pooled upstream client (`gateway.upstream_http`); the adapters' engines
belong to whoever launched them.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engine_adapters.base import EngineAdapter
from fleetcore.fleet_config import FleetConfig, GatewaySettings
from fleetcore.policies import InstanceRouter, SiteChooser
from fleetcore.model_tokenizer import PromptTokenizer, model_tokenizers
from gateway.admin import AdminAuth, RegionPolicyAdmin, install_admin_routes
from gateway.admission import AdmissionGate, AdmissionPolicy
from gateway.admission_metrics import AdmissionCollector
from gateway.aliases import alias_entries
from gateway.auth import Authenticator, Caller
from gateway import dashboard
from gateway.router_refit import RouterRefit
from gateway.errors import install_handlers, model_not_found
from gateway.body_limit import BodySizeLimit
from gateway.fast_path import FastLane, GatewayApp
from gateway.fleet_metrics import FleetCollector
from gateway.fleet_state import FleetState
from gateway.goodput_report import ReportAccess, install_report_routes
from gateway.kv_feed import KVEventFeed
from gateway.loop_monitor import IDLE_INTERVAL_S, LoopLagCollector, LoopMonitor
from gateway.metrics import GatewayMetrics
from gateway.overload import Backlog, OverloadLimit
from gateway.placement import PlacementLoop
from gateway.policy_store import PolicyStore
from gateway.policy_sync import GuardedSiteChooser, build_policy_sync
from gateway.embeddings import serve_embeddings
from gateway.admin_store import SqliteKV
from gateway.key_budgets import KeyBudgets
from gateway.keys import KeyStore, KVKeyStore, install_key_routes
from gateway.policy_snapshot import state_dir
from gateway.pd_flow import PDFlow
from gateway.relay import DecisionLog, Relay
from gateway.responses_api import serve_responses
from gateway.replica_state import Replicas
from gateway.telemetry import Telemetry
from gateway.routing import DEFAULT_ROUTER, build_router, build_site_chooser, reset_instances
from gateway.requests import Kind, ParsedRequest, parse_request
from gateway.serving import parse_off_loop, parser_args, serve_endpoint
from gateway.openapi import chat_body, completion_body, embeddings_body, responses_body
from gateway.tokenize_pool import TokenizePool
from gateway.upstream_http import UpstreamClient
from fleetmind.demand import DemandModel
from fleetmind.placement_cycle import placement_cycle_for
from slomax import from_fleet as slomax_config
from slomax import make_admission

# The collector's generation thresholds once start-up is frozen. CPython's default: a young
# collection every ~6 streamed requests, ~0.5 ms each. Raising the first threshold to 10,000
# made them 14x rarer but 3-35 ms each, the same total and a worse tail (bench/README.md,
# "GC discipline"), so the default stays, set here explicitly: the one place to tune it.
GC_THRESHOLDS: tuple[int, int, int] = (700, 10, 10)
# How long a thread may hold the GIL while another waits (CPython's default is 5 ms). The
# tokenizer pool's threads parse and hash in Python (the built-in tokenizer's long prompts go to
# helper processes since) or call into Rust; the event loop re-takes the GIL after every poll and
# every socket call, and at 5 ms it waited that long each time: a burst of 16 prompts of 32k
# tokens held the loop ~50 ms, at 1 ms ~7-19 ms, with helpers ~2-9 ms
# (tests/test_tokenize_stall.py; bench/README.md, "Tokenization off the loop").
SWITCH_INTERVAL_S = 0.001


@dataclass(frozen=True, slots=True)
class GatewayContext:
    """What the app holds; reachable as `app.state.tokenfleet` (CLI, admin tools, tests)."""

    config: FleetConfig
    state: FleetState
    relay: Relay
    metrics: GatewayMetrics
    decisions: DecisionLog
    auth: Authenticator
    # model name -> its real tokenizer (exact token ids and cache keys); others estimate
    tokenizers: Mapping[str, PromptTokenizer] = field(default_factory=dict)
    admission: AdmissionGate | None = None  # SLOMax (or FCFS), its ledger and live state
    placement: PlacementLoop | None = None  # FleetMind's replica planner, when the fleet file enables it
    loop_monitor: LoopMonitor | None = None  # event-loop stalls (/metrics; health checks count only responsive time)
    telemetry: Telemetry | None = None  # traces, OTel metrics, access log, SLO misses (gateway.telemetry)

    @property
    def tokenize_pool(self) -> TokenizePool:
        """Parses large bodies (and continuations' prompts) off the event loop, bounded: the relay's."""
        return self.relay.tokenize_pool


def _client_session(settings: GatewaySettings) -> UpstreamClient:
    # Only the connect has a deadline of its own: a long generation is not a failure. Reads are
    # bounded per phase (first byte from the predicted TTFT, then idle between reads) by the relay
    # (`gateway.deadlines`). Active connections are not capped (one per stream); idle ones are.
    return UpstreamClient(settings.connect_timeout_s)


def create_app(config: FleetConfig, adapters: Sequence[EngineAdapter],
               router: InstanceRouter | None = None, site_chooser: SiteChooser | None = None,
               poll_interval_s: float | None = None, *, max_body_bytes: int | None = None,
               decision_log_size: int = 256,
               clock: Callable[[], float] = time.monotonic, policy_store: PolicyStore | None = None,
               tokenizers: Mapping[str, PromptTokenizer] | None = None,
               admission: AdmissionPolicy | None = None, planner: bool | None = None,
               dashboard_sample_s: float | None = None,
               telemetry_env: Mapping[str, str] | None = None, key_store: KeyStore | None = None) -> FastAPI:
    """The gateway app over adapters that are already launched (the caller stops them).

    `tokenizers` defaults to the models' own tokenizers found via the fleet file
    (`fleetcore.model_tokenizer.model_tokenizers`). `admission` defaults to the fleet
    file's `admission.policy` (SLOMax unless it says fcfs) with its classes and tenants.
    `planner` turns FleetMind's replica planner on or off (default: the fleet file's
    `planner.enabled`); it moves replicas through the adapters (`gateway.placement`).
    `max_body_bytes` defaults to the fleet file's `gateway.max_body_bytes`.
    `dashboard_sample_s`: how often /dashboard's time series is sampled (`gateway.dashboard`, 5 s).
    `telemetry_env` (default: the process environment) holds the `OTEL_*` variables that
    turn traces and OTLP metrics on (`gateway.telemetry`).
    """
    if max_body_bytes is None:
        max_body_bytes = config.gateway.max_body_bytes
    # Ticks every 10 ms while the loop has work, every 250 ms while it is idle (gateway.loop_monitor).
    loop_monitor = LoopMonitor(idle_interval_s=IDLE_INTERVAL_S)
    state = FleetState(config, adapters, poll_interval_s, clock=clock, loop_monitor=loop_monitor)
    metrics = GatewayMetrics()
    metrics.registry.register(LoopLagCollector(loop_monitor))
    decisions = DecisionLog(decision_log_size)
    if router is None:
        router = build_router(DEFAULT_ROUTER, [i for a in adapters for i in a.instances])
    if admission is None:
        admission = make_admission(config.admission.policy, slomax_config(config))
    gate = AdmissionGate(admission, state, clock)
    slo_config = getattr(admission, "config", None)  # SLOMax and FCFS: the classes' SLOs per tenant
    telemetry = Telemetry.from_env(os.environ if telemetry_env is None else telemetry_env, metrics.registry,
                                   clock=clock, slo_of=slo_config.slo if slo_config is not None else None)
    metrics.registry.register(AdmissionCollector(admission, clock))
    chooser = site_chooser if site_chooser is not None else build_site_chooser(config, router)
    # Region policies: newest version from the store, durable on disk; no known policies, no routing.
    policy_sync = build_policy_sync(config, policy_store, chooser)
    g = config.gateway
    # Prompts (large bodies) and continuations' prompts are tokenized here, off the event loop.
    pool = TokenizePool(g.tokenize_workers, g.tokenize_queue, g.tokenize_timeout_s, helper=g.tokenize_helper)
    relay = Relay(config, state, router, GuardedSiteChooser(chooser, policy_sync),
                  metrics, decisions, pool, clock=clock, retry_after_s=max(1, round(2 * state.poll_interval_s)),
                  admission=gate)
    relay.pd = PDFlow.for_relay(relay)  # P/D fleets: TokenPilot's split decision and both legs' flow
    # A restarted engine's cache is cold: the router forgets what it indexed there.
    state.on_restart.append(lambda inst: reset_instances(relay.router, [inst]))
    placement = None
    if config.planner.enabled if planner is None else planner:
        core = placement_cycle_for(config, DemandModel(config, wall_clock=True))
        placement = PlacementLoop(core, state, relay.router, admission.ledger, clock)
        relay.listeners.append(placement)
        placement.on_removed.append(metrics.forget_instance)
        gate.on_released.append(placement.released)  # the ledger's verdict per site (settled_met_share)
    metrics.registry.register(FleetCollector(state, placement))
    # Several replicas: budgets, ledger, lease and admin state shared through Redis (gateway.replica_state).
    replicas = Replicas(config, gate, placement, metrics.registry, clock, policy_store or policy_sync.store,
                        getattr(policy_sync.store, "kv", None), state, relay)
    dash_recorder, dash_sampler = dashboard.wire(admission.ledger, dashboard_sample_s)
    relay.listeners.append(dash_recorder)
    gate.on_released.append(dash_recorder.released)  # per-site goodput: class and outcome meet there
    if key_store is None:  # tenant keys created by API (`gateway.keys`), in the durable admin store
        kv = replicas.kv or SqliteKV(state_dir(g.state_dir) / "admin-keys.sqlite3", timeout_s=g.store_timeout_s)
        key_store = KVKeyStore(kv)
    gate.key_budgets = KeyBudgets(key_store)  # a key's own budgets, on top of its tenant's
    ctx = GatewayContext(config, state, relay, metrics, decisions, Authenticator.from_config(config, key_store),
                         model_tokenizers(config) if tokenizers is None else tokenizers, gate, placement,
                         loop_monitor, telemetry)
    relay.tokenizers = ctx.tokenizers  # continuations rebuild the engine's prompt ids with them

    backlog = Backlog(g.max_inflight_requests, g.max_pending_requests, g.overload_retry_after_s)
    metrics.watch_backlog(lambda: backlog.pending, lambda: backlog.inflight)
    metrics.watch_kv_drops(lambda: _summed_drops(adapters))

    kv_feed = KVEventFeed(state, relay.router, clock, metrics=metrics) if relay.router.follows_kv_events else None
    # the router's learned latency model, fitted off the request path
    refit = RouterRefit(relay.router, results=metrics.router_refits)
    policy_admin = RegionPolicyAdmin(config, policy_sync)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop_monitor.start()
        relay.session = _client_session(config.gateway)
        await policy_sync.start()
        await replicas.start()
        if isinstance(key_store, KVKeyStore):
            await key_store.start()
        switch_interval = sys.getswitchinterval()  # a process-wide setting: given back at the end
        try:
            await state.start()
            if kv_feed is not None:
                await kv_feed.start()
            if placement is not None:
                placement.start()
            dash_sampler.start()
            if config.gateway.learned_latency:  # off: the router's prior only, nothing fitted
                await refit.prepare()  # (before the freeze below: what it imports lives as long)
                refit.start()
            # Everything built so far (config, tokenizers, indexes, the app) lives as long as the
            # process: moved out of the collector's reach, a full collection scans only what
            # requests allocate (its pause drops from ~100 ms to ~10 ms; bench/README.md, "Soak").
            gc.collect()
            gc.freeze()
            gc.set_threshold(*GC_THRESHOLDS)
            sys.setswitchinterval(SWITCH_INTERVAL_S)
            # The stall maxima describe serving: the collection just above held the loop before
            # anyone was served (0.1-0.2 s), and every start would raise the stall alert.
            loop_monitor.forget_peaks()
            yield
        finally:
            sys.setswitchinterval(switch_interval)
            await refit.stop()
            await dash_sampler.stop()
            if placement is not None:
                await placement.stop()
            gate.close()
            if isinstance(key_store, KVKeyStore):
                await key_store.stop()
            await replicas.stop()
            await policy_sync.stop()
            if kv_feed is not None:
                await kv_feed.stop()
            await state.stop()
            relay.shutdown.close()
            if relay.pd is not None:  # prefill legs still running past their decode's start (SGLang)
                await relay.pd.close()
            await relay.session.close()
            relay.session = None
            pool.close()
            loop_monitor.stop()
            await telemetry.shutdown()

    # The contract for clients and fuzzers: /openapi.json, /docs (Swagger UI), /redoc.
    app = GatewayApp(title="TokenFleet gateway", lifespan=lifespan, version="1",
                  description="OpenAI-compatible gateway: /v1 for tenants (API key), /admin/v1 for "
                              "operators (admin key); errors are OpenAI-shaped `{\"error\": {...}}`.")
    app.state.tokenfleet = ctx
    app.state.replicas = replicas  # shared state of several replicas (gateway.replica_state): tests, tools
    app.state.backlog = backlog  # the overload bounds' counts (gateway.overload)
    install_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    # Added last, so outermost of ours: an overloaded gateway refuses before reading a body.
    app.add_middleware(OverloadLimit, backlog=backlog, on_refused=metrics.refused_overload)
    _add_openai_routes(app, ctx)
    # The /v1 endpoints' lean path (gateway.fast_path): the same two limits and the handler, one layer.
    app.fast_stack = FastLane(app, app.fast_routes, backlog, metrics.refused_overload, max_body_bytes)
    _add_ops_routes(app, ctx)
    install_admin_routes(app, config, policy_admin, relay, replicas.planner, key_store)
    install_key_routes(app, config, key_store, AdminAuth(config, key_store).require)
    install_report_routes(app, config, gate, clock, telemetry.slo_log, keys=key_store)
    dashboard.install_dashboard_routes(app, config, dash_sampler, admission, placement)
    return app


def _add_openai_routes(app: GatewayApp, ctx: GatewayContext) -> None:
    created = int(time.time())

    # The bodies are parsed by `gateway.requests` (raw, forwarded with unknown fields intact);
    # their schemas are declared for the OpenAPI document only.
    @app.post("/v1/chat/completions", openapi_extra=chat_body(ctx.config.models[0].name))
    async def chat_completions(request: Request) -> Response:
        return await _serve(ctx, request, "chat", "/v1/chat/completions")

    @app.post("/v1/completions", openapi_extra=completion_body(ctx.config.models[0].name))
    async def completions(request: Request) -> Response:
        return await _serve(ctx, request, "completion", "/v1/completions")

    @app.post("/v1/embeddings", openapi_extra=embeddings_body(ctx.config.models[0].name))
    async def embeddings(request: Request) -> Response:
        return await serve_embeddings(ctx, request)  # models of kind `embedding` only

    @app.post("/v1/responses", openapi_extra=responses_body(ctx.config.models[0].name))
    async def responses(request: Request) -> Response:
        return await serve_responses(ctx, request)  # stateless Responses API over the chat path

    # POST /v1/...: served by the lean path; the declarations above are for the OpenAPI document
    # (and serve the same handlers should the lean path be bypassed).
    app.fast_routes = {"/v1/chat/completions": chat_completions, "/v1/completions": completions,
                       "/v1/embeddings": embeddings, "/v1/responses": responses}

    def model_entries() -> list[dict[str, Any]]:
        """The models (and aliases) that some ready instance serves now."""
        ready: dict[str, set[str]] = {}
        for inst in ctx.state.view().instances():
            if inst.ready and not inst.draining:
                ready.setdefault(inst.model, set()).add(inst.version)
        data = [{"id": m.name, "object": "model", "created": created, "owned_by": "tokenfleet",
                 "versions": sorted(ready[m.name]), "max_model_len": m.engine.max_model_len}
                for m in ctx.config.models if m.name in ready]
        return data + alias_entries(ctx.config, ready, created)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        ctx.auth.authenticate(request.headers)
        return JSONResponse({"object": "list", "data": model_entries()})

    # OpenAI's "retrieve model" (`client.models.retrieve(id)`); `:path`: ids may hold a slash
    # (`meta-llama/Llama-3.1-8B`). A model the list would not show (unknown, or nothing serves it
    # now) is a 404 `model_not_found`, as OpenAI answers.
    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> JSONResponse:
        ctx.auth.authenticate(request.headers)
        for entry in model_entries():
            if entry["id"] == model_id:
                return JSONResponse(entry)
        raise model_not_found(model_id)


def _add_ops_routes(app: FastAPI, ctx: GatewayContext) -> None:
    access = ReportAccess(ctx.config, ctx.auth.keys)  # tenant or admin, as for the goodput report

    @app.get("/health")
    async def health() -> JSONResponse:
        # "degraded" (still 200: the gateway serves its other models; see README) when a model
        # has no serving instance; `models` counts serving instances per model.
        c = ctx.state.counts()
        draining = ctx.relay.shutdown.draining  # SIGTERM: readiness off while streams finish
        # "degraded" (a configured model has no serving instance) stays HTTP 200: every replica sees
        # the same fleet, so failing readiness would pull all of them out of the load balancer.
        status = "shutting_down" if draining else ("degraded" if c.degraded else "ok")
        return JSONResponse({"status": status, "ready_instances": c.ready,
                             "instances": c.total, "models": c.by_model, "sites": c.by_site,
                             "unserved_models": c.unserved_models},
                            status_code=503 if draining else 200)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        # Without a key (scrapers): no per-tenant series. An admin key: all of them.
        admin = access.open or ("authorization" in request.headers and access.principal(request.headers)[1])
        return Response(ctx.metrics.render(per_tenant=admin), media_type=ctx.metrics.content_type)

    @app.get("/debug/decisions")
    async def debug_decisions(request: Request, limit: int = 50) -> JSONResponse:
        tenant, admin = access.principal(request.headers)  # a tenant sees only its own requests
        n = max(0, min(limit, 1000))
        return JSONResponse({"decisions": ctx.decisions.last(n, None if admin else tenant)})


async def _serve(ctx: GatewayContext, request: Request, kind: Kind, path: str) -> Response:
    async def parse(caller: Caller, rid: str, model: str | None) -> ParsedRequest:
        raw = await request.body()
        return await parse_off_loop(ctx, parse_request, raw, kind, **parser_args(ctx, request, caller, rid, model))
    return await serve_endpoint(ctx, request, kind, path, parse)


def _summed_drops(adapters: Sequence[EngineAdapter]) -> dict[tuple[str, str], int]:
    """Every adapter's `kv_event_drops`, summed (two deployments' subscribers may both count the
    unattributable reasons)."""
    total: dict[tuple[str, str], int] = {}
    for a in adapters:
        for key, n in a.kv_event_drops().items():
            total[key] = total.get(key, 0) + n
    return total
