"""The fleet file: sites, model pools, deployments and tenants, validated with clear errors.

Example (the embedded default is `deploy/local/fleet.yaml`)::

    regions: [us-east, eu-west]          # client entry regions (default: the sites' regions)
    default_region: us-east              # entry region of clients that do not say
    sites:
      - {name: use1, region: us-east, jurisdiction: us, rtt_ms: {us-east: 1, eu-west: 80}}
    models:
      - name: llama-3.1-8b
        versions: ["2024-07"]            # the first is the default
        engine: {spec: llama-3.1-8b, max_model_len: 32768, block_size: 16}
    deployments:
      - {site: use1, model: llama-3.1-8b, instances: 2, gpu: H100, adapter: sim}
      - {site: use1, model: llama-3.1-8b, adapter: static, urls: ["http://10.0.0.5:8000"]}
    tenants:
      - {name: dev, api_keys: [sk-dev], default_class: interactive, region: us-east}
"""

from __future__ import annotations

import difflib
import hashlib
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fleetcore.continuation import ContinuationLimits
from fleetcore.admission_config import AdmissionConfig, BudgetConfig, ClassSLOConfig, check_tenant_classes
from fleetcore.region_policy import RegionPolicy, check_policy
from fleetcore.roofline import validate_efficiency_curve
from fleetcore.types import ROLES, Role


class FleetConfigError(ValueError):
    """A fleet file that cannot be used; the message names the file and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InterconnectConfig(_Strict):
    """The link a prefilled request's KV crosses between two instances of one site.

    Defaults: one 400 Gb/s RDMA NIC per instance (50 GB/s), 10 us to set a transfer up.
    """

    bandwidth_gb_s: float = Field(default=50.0, gt=0, description="KV transfer bandwidth, GB/s (10^9 bytes)")
    latency_ms: float = Field(default=0.01, ge=0, description="set-up latency of one transfer, ms")


class WanConfig(_Strict):
    """Links between sites: latency is half the sites' round trip (their `rtt_ms`), bandwidth this."""

    bandwidth_gb_s: float = Field(default=1.25, gt=0, description="KV transfer bandwidth between sites, GB/s")




class SiteConfig(_Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    region: str = Field(min_length=1)
    jurisdiction: str = Field(min_length=1)
    rtt_ms: dict[str, float] = Field(default_factory=dict)
    egress_cost_per_gb: float = Field(default=0.0, ge=0)
    gpus: int | None = Field(default=None, ge=0,
                             description="GPUs the planner may fill with replicas (default: those deployed)")
    # KV transfer between two instances of this site (prefill -> decode); see fleetcore.interconnect.
    interconnect: InterconnectConfig = Field(default_factory=lambda: InterconnectConfig())

    @model_validator(mode="after")
    def _rtt_non_negative(self) -> SiteConfig:
        for region, rtt in self.rtt_ms.items():
            if rtt < 0:
                raise ValueError(f"rtt_ms[{region}] must be >= 0, got {rtt}")
        return self


class EngineConfigSpec(_Strict):
    spec: str = Field(description="model architecture in the simulated engine's table, e.g. llama-3.1-8b")
    max_model_len: int = Field(default=32768, gt=0)
    block_size: int = Field(default=16, gt=0)
    max_num_batched_tokens: int = Field(default=8192, gt=0)
    # The per-step token budget of this model's engines when the fleet runs prefill/decode
    # (`tokenfleet simulate --disagg` other than `off`, which ignores roles and this): a decode
    # instance then admits a local prefill's chunks within it, so every step its running streams
    # share stays short (a step with an 8,192-token chunk of Llama-3.1-70B on 2 x H200 takes ~1 s,
    # one with 2,048 ~0.25 s, a decode step ~25 ms). Real engines set it at launch: vLLM
    # `--max-num-batched-tokens` (running requests first, in arrival order: the streams already
    # there decode, a running prefill's chunk fills the rest, and waiting requests, KV-arrived
    # ones included, join only in a step with budget left; bench/DISAGG.md "TPOT by role"),
    # SGLang `--chunked-prefill-size`; the live adapters launch at `step_budget`. Static per
    # instance, so a role flip keeps it. None: `max_num_batched_tokens` (bench/DISAGG.md
    # "Decode-side chunk budget").
    pd_max_num_batched_tokens: int | None = Field(default=None, gt=0)
    max_num_seqs: int = Field(default=256, gt=0)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    # `tokenfleet simulate`'s engines only (live sim workers keep the constant; nothing real reads
    # it): [[tokens per step, compute efficiency], ...]
    # in place of the roofline's constant 0.66, interpolated in tokens and held flat outside the
    # points (real GEMMs reach a smaller fraction of the peak at small token counts). None (the
    # default): the constant, every step time as before. bench/DISAGG.md "Small-chunk kernel
    # efficiency" derives one from a Vidur profile (bench/kernel_eff_curve.py).
    compute_efficiency_curve: list[tuple[int, float]] | None = None

    @model_validator(mode="after")
    def _curve_valid(self) -> EngineConfigSpec:
        validate_efficiency_curve(self.compute_efficiency_curve)
        return self

    def step_budget(self, roles: Sequence[Role]) -> int:
        """The per-step token budget the engines of a deployment with these instance `roles` launch
        at (vLLM `--max-num-batched-tokens`, SGLang `--chunked-prefill-size`, the sim worker's
        `--max-num-batched-tokens`): `pd_max_num_batched_tokens` where the deployment runs P/D (a
        role other than `mixed`) and it is set, else `max_num_batched_tokens`. Every instance of
        a P/D deployment gets it, whatever its role, as in the simulator
        (`fleetsim.disagg.pd_fleet`): a decode or mixed instance admits local prefills' chunks
        within it, and a role flip keeps it."""
        if self.pd_max_num_batched_tokens is not None and any(r != "mixed" for r in roles):
            return self.pd_max_num_batched_tokens
        return self.max_num_batched_tokens


class ModelConfig(_Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.:/-]+$")
    versions: list[str] = Field(default_factory=lambda: ["v1"], min_length=1)
    engine: EngineConfigSpec
    # A Hugging Face model directory whose tokenizer the gateway uses for exact prompt
    # token ids and KV-event cache keys (see fleetcore.model_tokenizer); default: the
    # local `options.model` of the model's vllm/sglang deployment, if any.
    tokenizer: str | None = None
    # Models (or aliases) tried in order when this one has no ready instance or admission
    # refuses it for capacity (503 no_ready_instance / slo_unattainable); never for budgets.
    fallbacks: list[str] = Field(default_factory=list)
    # `embedding`: served on /v1/embeddings only (and chat/completions never reach it).
    kind: Literal["chat", "embedding"] = "chat"
    dimensions: int | None = Field(default=None, gt=0, le=65536, description="embedding size (default 1024)")

    @model_validator(mode="after")
    def _dimensions_for_embeddings(self) -> ModelConfig:
        if self.dimensions is not None and self.kind != "embedding":
            raise ValueError(f"model {self.name!r}: `dimensions` is only for `kind: embedding`")
        return self

    @property
    def embedding_dim(self) -> int:
        return self.dimensions or 1024

    @property
    def default_version(self) -> str:
        return self.versions[0]


class DeploymentConfig(_Strict):
    site: str
    model: str
    version: str | None = None
    adapter: Literal["sim", "static", "vllm", "sglang"] = "sim"
    instances: int | None = Field(default=None, ge=0)
    gpu: str = "H100"
    tp: int = Field(default=1, ge=1)
    urls: list[str] = Field(default_factory=list)
    options: dict[str, Any] = Field(default_factory=dict)
    # Prefill/decode split: instances per role, e.g. {prefill: 4, decode: 12} (default: all mixed).
    # The counts must add up to the deployment's instances; instances take roles in the order
    # mixed, prefill, decode (instance 0 first).
    roles: dict[Role, int] | None = None

    @model_validator(mode="after")
    def _roles_add_up(self) -> DeploymentConfig:
        if self.roles is None:
            return self
        bad = sorted(r for r, n in self.roles.items() if n < 0)
        if bad:
            raise ValueError(f"roles: counts must be >= 0 (negative: {bad})")
        total = sum(self.roles.values())
        if total != self.instance_count:
            raise ValueError(f"roles: counts add up to {total} but the deployment has {self.instance_count} "
                             f"instance(s) ({dict(self.roles)})")
        return self

    def instance_roles(self) -> list[Role]:
        """The role of each instance, in instance order (all `mixed` without `roles`)."""
        if self.roles is None:
            return ["mixed"] * self.instance_count
        return [r for r in ROLES for _ in range(self.roles.get(r, 0))]

    @model_validator(mode="after")
    def _instances_match_adapter(self) -> DeploymentConfig:
        if self.adapter == "static":
            if not self.urls:
                raise ValueError("a static deployment needs `urls`")
            if self.instances is not None and self.instances != len(self.urls):
                raise ValueError(f"instances={self.instances} but {len(self.urls)} urls given")
        elif self.urls:
            raise ValueError(f"`urls` is only for the static adapter, not {self.adapter!r}")
        return self

    @property
    def instance_count(self) -> int:
        if self.adapter == "static":
            return len(self.urls)
        return 1 if self.instances is None else self.instances


class TenantConfig(_Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    api_keys: list[str] = Field(default_factory=list, description="plain keys (dev only)")
    api_key_sha256: list[str] = Field(default_factory=list, description="hex SHA-256 of keys")
    default_class: str = "interactive"
    region: str | None = None
    # Admission (SLOMax); see fleetcore.admission_config.
    priority: int = Field(default=0, description="higher is served first inside a class queue")
    budgets: BudgetConfig | None = None
    slos: dict[str, ClassSLOConfig] = Field(default_factory=dict, description="per-class SLO overrides")
    class_shares: dict[str, float] = Field(default_factory=dict, description="weight among tenants in a class")

    def key_hashes(self) -> list[str]:
        return [hash_api_key(k) for k in self.api_keys] + [h.lower() for h in self.api_key_sha256]


class PlannerSettings(_Strict):
    """The `planner:` block: FleetMind's long cycle (replica placement) in the live gateway.

    Off unless `enabled`. Tuning fields left out keep `fleetmind.planner.PlannerConfig`'s
    defaults (see there for what each means); the simulator's `fleetmind+planner` placement
    reads the same fields.
    """

    enabled: bool = False
    mode: Literal["auto", "advise"] = Field(default="auto",
                                           description="advise: plans are logged for operators, not carried out")
    cycle_s: float = Field(default=30.0, gt=0, description="how often the planner runs")
    drain_timeout_s: float = Field(default=600.0, gt=0,
                                   description="a replica leaving a site is stopped after this even if busy")
    ready_timeout_s: float = Field(default=900.0, gt=0,
                                   description="a new replica not ready by then is given up")
    window_s: float | None = Field(default=None, gt=0)
    lead_s: float | None = Field(default=None, ge=0)
    target_utilisation: float | None = Field(default=None, gt=0, le=1)
    cooldown_s: float | None = Field(default=None, ge=0)
    watch_s: float | None = Field(default=None, gt=0)
    rollback_drop: float | None = Field(default=None, gt=0, lt=1)
    block_s: float | None = Field(default=None, ge=0)
    min_replicas: int | None = Field(default=None, ge=0)
    keep_fraction: float | None = Field(default=None, ge=0, le=1)
    max_batch: int | None = Field(default=None, ge=1)
    demand_tolerance: float | None = Field(default=None, gt=0)
    min_speed_ratio: float | None = Field(default=None, ge=0)
    settled_met_share: float | None = Field(default=None, gt=0, le=1)

    def tuning(self) -> dict[str, float | int]:
        """The planner tuning fields the file sets (for `PlannerConfig(**...)`)."""
        runtime = {"enabled", "mode", "cycle_s", "drain_timeout_s", "ready_timeout_s"}
        return {k: v for k, v in self.model_dump().items() if k not in runtime and v is not None}


class ContinuationSettings(_Strict):
    """`gateway.continuation`: continuing a stream on another instance when its engine dies,
    stalls or is drained after the first byte (`fleetcore.continuation`, README "Streams that
    survive their engine")."""

    enabled: bool = Field(default=True, description="continue a failed stream elsewhere (off: an error event)")
    max_continuations: int = Field(default=2, ge=0, le=16,
                                   description="continuations per request; one more failure ends it with an error event")
    max_reprefill_tokens: int = Field(default=32768, ge=1,
                                      description="prompt + generated tokens a continuation may re-prefill")

    def limits(self) -> ContinuationLimits:
        return ContinuationLimits(self.enabled, self.max_continuations, self.max_reprefill_tokens)


class HedgeSettings(_Strict):
    """`gateway.hedge`: hedged prefill (off by default: README "Hedged prefill" says what it costs).

    A streamed request of one of `classes` that has sent no event after
    `max(min_delay_s, delay_factor x predicted TTFT)` is sent to a second instance too; the first
    stream to produce an event is kept, the other aborted."""

    enabled: bool = False
    classes: list[str] = Field(default_factory=lambda: ["interactive"])
    delay_factor: float = Field(default=3.0, ge=1, description="hedge after this many predicted TTFTs")
    min_delay_s: float = Field(default=0.1, gt=0, description="never hedge sooner than this")


class GatewaySettings(_Strict):
    """The `gateway:` block: every timeout and limit of the serving path, in one place.

    Defaults suit a fleet on one network; each field says what it bounds. Nothing the
    gateway waits on is unbounded: engines (connect, first byte, idle stream), clients
    (headers, body, idle keep-alive), the policy store, tokenization, health checks and
    shutdown each have their deadline here.
    """

    # --- engines ---
    connect_timeout_s: float = Field(default=5.0, gt=0, description="TCP connect to an engine")
    first_byte_timeout_floor_s: float = Field(
        default=30.0, gt=0, description="least time an engine gets to send its first byte")
    first_byte_timeout_factor: float = Field(
        default=10.0, ge=1, description="first-byte deadline = max(floor, factor x predicted TTFT)")
    whole_answer_timeout_s: float = Field(
        default=600.0, gt=0, le=86400,
        description="a non-streamed request's answer: past its first-byte deadline the gateway waits on while "
                    "the engine passes its health checks, but no longer than this from the request's arrival "
                    "(600 s: the OpenAI SDK's own timeout)")
    stream_idle_timeout_s: float = Field(
        default=30.0, gt=0, le=3600,
        description="no bytes from an engine for this long mid-response: it has stalled")
    continuation: ContinuationSettings = Field(default_factory=ContinuationSettings)
    hedge: HedgeSettings = Field(default_factory=HedgeSettings)
    # --- clients ---
    header_timeout_s: float = Field(default=10.0, gt=0, description="a request's headers must arrive within this")
    body_timeout_s: float = Field(default=30.0, gt=0, description="a request's body must arrive within this")
    send_timeout_s: float = Field(
        default=30.0, gt=0, le=3600,
        description="a client that takes no bytes of a response for this long is gone: its connection is "
                    "closed and its request aborted on the engine (nginx's send_timeout)")
    keep_alive_timeout_s: float = Field(
        default=75.0, gt=0, description="idle client connection kept open (longer than clients' pools: 5 s for the OpenAI SDK)")
    max_connections: int = Field(default=8192, ge=1, description="client connections open at once")
    max_connections_per_client: int = Field(default=512, ge=1, description="per client IP address")
    max_header_count: int = Field(default=100, ge=1)
    max_header_bytes: int = Field(default=64 * 1024, ge=1024, description="request line plus headers")
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    ops_port: int | None = Field(
        default=None, ge=0, le=65535,
        description="a second listener serving only /health, /metrics, /admin and /debug, with connection "
                    "caps of its own, so a flood on the public port cannot starve them (none: no ops "
                    "listener; `tokenfleet up --ops-port` overrides)")
    max_json_depth: int = Field(default=64, ge=4, description="nesting of a request body")
    log_format: Literal["text", "json"] = Field(
        default="text", description="gateway log lines: text, or one JSON object per line "
                                    "(`tokenfleet up --log-format` overrides)")
    # --- overload: refused, not queued without bound (gateway.overload) ---
    max_inflight_requests: int = Field(
        default=8192, ge=1, description="/v1 requests in progress at once (parsing, queued, streaming); more: 503")
    max_pending_requests: int = Field(
        default=512, ge=1, description="/v1 requests accepted whose response has not started yet (parsing, "
                                       "admission queue, routing, waiting for the first byte); more: 503")
    overload_retry_after_s: int = Field(default=1, ge=1, description="Retry-After of an overload 503")
    # --- work before routing ---
    tokenize_workers: int = Field(
        default=1, ge=1, description="threads that tokenize prompts off the event loop (models' own Rust "
                                     "tokenizers release the GIL; the built-in one tokenizes long prompts in a "
                                     "helper process per thread, see tokenize_helper)")
    tokenize_helper: bool = Field(
        default=True, description="long prompts (16k+ characters) of the built-in tokenizer are tokenized in a "
                                  "helper process per tokenizer thread, not on the thread, whose Python holds the "
                                  "GIL the event loop needs (gateway.tokenize_pool); false: on the threads")
    tokenize_queue: int = Field(default=256, ge=1, description="prompts waiting for a tokenizer thread; more: 503")
    tokenize_timeout_s: float = Field(default=5.0, gt=0)
    # --- routing ---
    learned_latency: bool = Field(
        default=True, description="fit the router's learned latency model in the background (TokenPilot, "
                                  "gateway.router_refit); false: never fitted, its predictions stay the "
                                  "prior with its online speed factors (bench/latency_live.py's `prior`)")
    # --- shared state ---
    store_timeout_s: float = Field(default=1.0, gt=0, description="one policy-store (Redis) operation")
    state_dir: str | None = Field(
        default=None, description="where last-known-good admin state is kept on local disk "
                                  "(default: $TOKENFLEET_STATE_DIR, else ~/.local/state/tokenfleet)")
    # --- several replicas (README "Several replicas"); all of it off without a Redis URL ---
    redis_url: str | None = Field(
        default=None, description="Redis shared by the gateway replicas of one fleet: budgets, goodput ledger, "
                                  "admin state, planner lease (`tokenfleet up --redis-url` also sets the policy "
                                  "store; none: one replica, admin state in SQLite under state_dir)")
    redis_prefix: str = Field(default="tokenfleet", min_length=1, description="key prefix of the shared state")
    shared_budgets: bool = Field(default=True, description="tenant budgets exact fleet-wide in Redis (off: each "
                                                          "replica enforces the whole budget on its own)")
    replica_heartbeat_s: float = Field(default=1.0, gt=0, description="how often a replica announces itself")
    replica_ttl_s: float = Field(default=3.0, gt=0, description="a replica not heard of for this long is gone "
                                                                "(budget shares and stream counts drop it)")
    ledger_push_s: float = Field(default=0.5, gt=0, le=10, description="how often a replica pushes its goodput "
                                                                       "ledger deltas to Redis")
    load_sync_s: float = Field(default=0.1, gt=0, le=10, description="how often replicas exchange their "
                                                                     "per-instance in-flight counts")
    route_share_s: float = Field(default=0.1, gt=0, le=10, description="how often replicas exchange their routes "
                                                                       "(history-mode prefix index)")
    lease_ttl_s: float = Field(default=5.0, gt=0, description="the planner leader lease; a holder that cannot "
                                                              "renew stops acting before it runs out")
    lease_renew_s: float = Field(default=1.0, gt=0, description="how often the holder renews (at most a third "
                                                                "of lease_ttl_s)")
    # --- health ---
    health_interval_s: float = Field(default=0.5, gt=0, description="how often each engine is checked")
    health_timeout_s: float = Field(default=2.0, gt=0, description="a check slower than this is a miss")
    health_misses_to_unready: int = Field(
        default=3, ge=1, description="consecutive missed checks before an engine is taken out (a refused "
                                     "connection takes it out at once)")
    # --- lifecycle ---
    shutdown_grace_s: float = Field(
        default=120.0, ge=0, description="on SIGTERM, how long streams in flight may finish before they are "
                                         "ended with an error event")
    engine_restart_backoff_s: float = Field(default=1.0, gt=0, description="first wait before restarting a dead engine")
    engine_restart_backoff_max_s: float = Field(default=60.0, gt=0)
    liveness_timeout_s: float | None = Field(
        default=30.0, ge=1, le=3600,
        description="`up --workers` / `--replicas`: a gateway process whose event loop sent no heartbeat for "
                    "this long (blocked, stopped, stuck) is killed and restarted with the restart backoff "
                    "above; far above any legitimate stall (default: gunicorn's worker timeout). null: no "
                    "heartbeat, no such kill (a debugger paused in a member, say); members that exit are "
                    "still restarted")

    @model_validator(mode="after")
    def _check_lease(self) -> GatewaySettings:
        # Three renewals per lease: one lost or slow renewal never costs the lease.
        if self.lease_renew_s * 3 > self.lease_ttl_s * (1 + 1e-9):
            raise ValueError("gateway.lease_renew_s must be at most a third of gateway.lease_ttl_s")
        if self.replica_heartbeat_s * 2 > self.replica_ttl_s * (1 + 1e-9):
            raise ValueError("gateway.replica_heartbeat_s must be at most half of gateway.replica_ttl_s")
        return self


class FleetConfig(_Strict):
    regions: list[str] = Field(default_factory=list)
    default_region: str | None = None
    sites: list[SiteConfig] = Field(min_length=1)
    models: list[ModelConfig] = Field(min_length=1)
    deployments: list[DeploymentConfig] = Field(default_factory=list)
    tenants: list[TenantConfig] = Field(default_factory=list)
    region_policies: list[RegionPolicy] = Field(default_factory=list)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    planner: PlannerSettings = Field(default_factory=PlannerSettings)
    wan: WanConfig = Field(default_factory=WanConfig)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    admin_api_keys: list[str] = Field(default_factory=list, description="plain admin keys (dev only)")
    admin_api_key_sha256: list[str] = Field(default_factory=list, description="hex SHA-256 of admin keys")
    # Client-facing names: `{alias: model}` (or another alias, or `model@version`).
    aliases: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _validate(self) -> FleetConfig:
        """Every cross-field problem at once (one per line), not only the first: `tokenfleet
        check` shows them all, each located in the file (`fleetcore.fleet_check`)."""
        errors = [*self._reference_errors(), *self._admission_errors(), *self._region_policy_errors(),
                  *self._alias_errors()]
        if errors:
            raise ValueError("\n".join(errors))
        return self

    def _alias_errors(self) -> list[str]:
        errors = check_aliases(self.aliases, {m.name: m.versions for m in self.models})
        names = {x.name for x in self.models}
        for m in self.models:
            for fb in m.fallbacks:
                target = self.resolve_alias(fb) if fb in self.aliases and not errors else fb
                name = target.partition("@")[0]
                if name not in names:
                    errors.append(f"model {m.name!r}: fallback {fb!r} is not a model or alias"
                                  + did_you_mean(fb, [*names, *self.aliases]))
                elif name == m.name:
                    errors.append(f"model {m.name!r}: falls back to itself ({fb!r})")
                elif self.model(name).kind != m.kind:
                    errors.append(f"model {m.name!r}: fallback {fb!r} is a {self.model(name).kind} model, "
                                  f"not {m.kind}")
        return errors

    def resolve_alias(self, name: str) -> str:
        """`name` followed through aliases to `model` or `model@version` (itself when no alias)."""
        seen: set[str] = set()
        while name in self.aliases and name not in seen:
            seen.add(name)
            name = self.aliases[name]
        return name

    def _admission_errors(self) -> list[str]:
        errors = list(check_tenant_classes(self.admission, self.tenants))
        tenant_keys = {h for t in self.tenants for h in t.key_hashes()}
        if tenant_keys & set(self.admin_key_hashes()):
            errors.append("admin_api_keys: an admin key is also a tenant's API key")
        return errors

    def admin_key_hashes(self) -> list[str]:
        return [hash_api_key(k) for k in self.admin_api_keys] + [h.lower() for h in self.admin_api_key_sha256]

    def _region_policy_errors(self) -> list[str]:
        errors: list[str] = []
        models, tenants = {m.name for m in self.models}, {t.name for t in self.tenants}
        for i, p in enumerate(self.region_policies):
            found = check_policy(p, self.sites, models, tenants)
            if found:
                errors.append(f"region_policies[{i}]: " + "; ".join(found))
        keys = [p.key for p in self.region_policies]
        if len(keys) != len(set(keys)):
            errors.append("region_policies: more than one policy for the same (tenant, model)")
        return errors

    def _reference_errors(self) -> list[str]:
        errors = [e for e in (_unique("sites", [s.name for s in self.sites]),
                              _unique("models", [m.name for m in self.models]),
                              _unique("tenants", [t.name for t in self.tenants])) if e]
        keys = [h for t in self.tenants for h in t.key_hashes()]
        if len(keys) != len(set(keys)):
            errors.append("tenants: the same API key is given to more than one tenant")
        regions = set(self.client_regions)
        for s in self.sites:
            missing = sorted(regions - set(s.rtt_ms) - {s.region})
            if missing:
                errors.append(f"site {s.name!r}: rtt_ms lacks client region(s) {missing}")
        if self.default_region is not None and self.default_region not in regions:
            errors.append(f"default_region {self.default_region!r} is not one of {sorted(regions)}"
                          + did_you_mean(self.default_region, regions))
        sites = {s.name for s in self.sites}
        models = {m.name: m for m in self.models}
        for i, d in enumerate(self.deployments):
            where = f"deployments[{i}]"
            if d.site not in sites:
                errors.append(f"{where}: unknown site {d.site!r} (known: {sorted(sites)})"
                              + did_you_mean(d.site, sites))
            if d.model not in models:
                errors.append(f"{where}: unknown model {d.model!r} (known: {sorted(models)})"
                              + did_you_mean(d.model, models))
                continue
            versions = models[d.model].versions
            if d.version is not None and d.version not in versions:
                errors.append(f"{where}: model {d.model!r} has no version {d.version!r} (known: {versions})"
                              + did_you_mean(d.version, versions))
        errors += self._role_errors()
        for t in self.tenants:
            if t.region is not None and t.region not in regions:
                errors.append(f"tenant {t.name!r}: region {t.region!r} is not one of {sorted(regions)}"
                              + did_you_mean(t.region, regions))
        return errors

    def _role_errors(self) -> list[str]:
        """A site's prefill instances of a model need somewhere in that site to hand their KV to."""
        errors: list[str] = []
        takers: dict[tuple[str, str], int] = {}
        for d in self.deployments:
            roles = d.instance_roles()
            key = (d.site, d.model)
            takers[key] = takers.get(key, 0) + sum(1 for r in roles if r != "prefill")
        for i, d in enumerate(self.deployments):
            if (d.roles or {}).get("prefill", 0) and not takers.get((d.site, d.model), 0):
                errors.append(f"deployments[{i}]: prefill instances of {d.model!r} at {d.site!r} need a decode "
                              f"or mixed instance of it in that site to hand their KV to")
        return errors

    @property
    def client_regions(self) -> list[str]:
        return self.regions or sorted({s.region for s in self.sites})

    @property
    def entry_region(self) -> str:
        return self.default_region or self.client_regions[0]

    def model(self, name: str) -> ModelConfig:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    def site(self, name: str) -> SiteConfig:
        for s in self.sites:
            if s.name == name:
                return s
        raise KeyError(name)

    def deployment_version(self, d: DeploymentConfig) -> str:
        return d.version or self.model(d.model).default_version


_ALIAS_NAME = re.compile(r"^[A-Za-z0-9_.:/-]+$")


def check_aliases(aliases: dict[str, str], models: dict[str, list[str]]) -> list[str]:
    """Every problem with `aliases` (name -> model, model@version or another alias): a name that
    shadows a model, a target that is neither, a cycle."""
    errors: list[str] = []
    for alias, target in aliases.items():
        if not _ALIAS_NAME.match(alias) or "@" in alias:
            errors.append(f"aliases: {alias!r} is not a valid model name")
        if alias in models:
            errors.append(f"aliases: {alias!r} shadows the model of the same name")
        if target in aliases:
            continue  # a chain; checked for cycles below
        name, sep, version = target.partition("@")
        if name not in models:
            errors.append(f"aliases: {alias!r} -> unknown model {target!r} (known: {sorted(models)})")
        elif sep and version not in models[name]:
            errors.append(f"aliases: {alias!r} -> model {name!r} has no version {version!r}")
    for alias in aliases:
        chain, name = [alias], aliases[alias]
        while name in aliases:
            if name in chain:
                if name == alias and alias == min(chain):  # each cycle once, from its least member
                    errors.append(f"aliases: cycle {' -> '.join([*chain, name])}")
                break
            chain.append(name)
            name = aliases[name]
    return errors


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def _unique(what: str, names: list[str]) -> str | None:
    dupes = sorted({n for n in names if names.count(n) > 1})
    return f"{what}: duplicate name(s) {dupes}" if dupes else None


def did_you_mean(name: str, options: Iterable[str]) -> str:
    """` (did you mean 'x'?)` for the closest known name, or nothing when none is close."""
    close = difflib.get_close_matches(name, sorted(options), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _format_errors(source: str, err: ValidationError) -> str:
    lines = [f"{source}: invalid fleet file"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        for msg in e["msg"].removeprefix("Value error, ").split("\n"):  # cross-field checks: one per line
            lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def parse_fleet(data: Any, source: str = "<fleet>") -> FleetConfig:
    if not isinstance(data, dict):
        raise FleetConfigError(f"{source}: the fleet file must be a mapping at top level")
    try:
        return FleetConfig.model_validate(data)
    except ValidationError as e:
        raise FleetConfigError(_format_errors(source, e)) from None


def load_fleet_file(path: str | Path) -> FleetConfig:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise FleetConfigError(f"{p}: cannot read fleet file: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise FleetConfigError(f"{p}: not valid YAML: {e}") from None
    return parse_fleet(data, str(p))


DEFAULT_FLEET_FILE = Path(__file__).resolve().parent.parent / "deploy" / "local" / "fleet.yaml"
