"""Ops admin API for FleetMind's region policies, behind an admin key.

    GET    /admin/v1/region-policies                      {version, policies}
    GET    /admin/v1/region-policies/{tenant}/{model}     one policy (`*` for any)
    PUT    /admin/v1/region-policies/{tenant}/{model}     create or replace (validated)
    DELETE /admin/v1/region-policies/{tenant}/{model}
    GET    /admin/v1/audit?limit=N                        who changed what, newest first
    POST   /admin/v1/dry-run                              where a sample request would go and why
    GET    /admin/v1/planner?limit=N                      the placement planner: plans, applies, rollbacks,
                                                          the adapter actions carrying them out, placement
    PUT    /admin/v1/planner                              {"mode": "auto" | "advise" | "off"}: carry plans
                                                          out, only log them, or stop planning
    GET    /admin/v1/fleet                                per site: region, jurisdiction, RTTs (configured
                                                          and probed), egress cost; per model and version:
                                                          replicas ready / starting / draining, in flight,
                                                          queued, KV use, predicted TTFT, cache blocks

Writes take `If-Match: <version>` for optimistic concurrency (412 when stale) and take
effect on the next request, in every gateway replica sharing the store, without a
restart. A tenant key gets 403, no key 401. Bodies are pydantic models (`RegionPolicy`,
`DryRunBody`, `PlannerModeBody`, also in the OpenAPI document): a wrong field is a 400
naming it. Calls that need the policy store answer 503 `policy_store_unavailable` with
`Retry-After` within `gateway.store_timeout_s` when it is down or hung.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import asdict
from collections.abc import Awaitable, Mapping
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fleetcore.fleet_config import FleetConfig
from fleetcore.policies import SiteChooser
from fleetcore.region_policy import PolicySet, RegionPolicy, check_policy
from fleetcore.types import FleetView, RequestProfile
from gateway.auth import bearer_token
from gateway.logs import emit
from gateway.errors import GatewayError, bad_request, invalid_api_key
from gateway.placement import Mode
from gateway.policy_store import AuditEntry, Snapshot, StoreUnavailable, VersionConflict, now_unix
from gateway.policy_sync import PolicySync, policy_store_unavailable

_T = TypeVar("_T")
_B = TypeVar("_B", bound=BaseModel)


# --- request bodies: validated here (a wrong type is a 400 naming the field) and described in
# the OpenAPI document. The region policy body is `fleetcore.region_policy.RegionPolicy`.

class DryRunBody(BaseModel):
    """A sample request for `POST /admin/v1/dry-run`."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, description="model name, or `name@version`")
    tenant: str = Field(default="anonymous", min_length=1)
    region: str | None = Field(default=None, description="client entry region (default: the fleet's entry region)")
    prompt_tokens: int = Field(default=1000, ge=0, le=100_000_000)
    request_class: str | None = Field(default=None, description="SLO class (default: by prompt length)")
    proposed: RegionPolicy | None = Field(
        default=None, description="a region policy to try: the answer shows where the request would go with "
                                  "it (replacing the policy of the same tenant and model) next to today, "
                                  "and what would change; nothing is stored")


class PlannerModeBody(BaseModel):
    """`PUT /admin/v1/planner`."""

    model_config = ConfigDict(extra="forbid")

    mode: Mode = Field(description="auto: carry plans out; advise: only log them; off: stop planning")


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` declaring a JSON body of `model` (the handler validates it: `read_body`)."""
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": model.model_json_schema()}}}}


async def read_body(request: Request, model: type[_B]) -> _B:
    """The body as `model`; a 400 naming the first bad field otherwise (invalid JSON included)."""
    raw = await request.body()
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        if first["type"] == "json_invalid":
            raise bad_request(f"The body is not valid JSON: {first['msg']}.") from None
        loc = ".".join(str(p) for p in first["loc"]) or None
        if loc is None and first["type"] in ("model_type", "model_attributes_type"):
            raise bad_request("The body must be a JSON object.") from None
        raise bad_request(f"{loc}: {first['msg'].removeprefix('Value error, ')}" if loc else first["msg"],
                          param=loc) from None


async def _bounded(op: Awaitable[_T], retry_after_s: int) -> _T:
    """A policy-store call: 503 with Retry-After when the store is down (never a 500 or a hang:
    the store bounds every call by `gateway.store_timeout_s`)."""
    try:
        return await op
    except StoreUnavailable as e:
        raise policy_store_unavailable(str(e), retry_after_s) from None


# Admin changes, at info: who changed what (the durable record is the store's audit log).
audit_log = logging.getLogger("tokenfleet.audit")


def _forbidden() -> GatewayError:
    return GatewayError(403, "This endpoint needs an admin key.", type="permission_error", code="forbidden")


class AdminAuth:
    def __init__(self, config: FleetConfig, keys: Any = None) -> None:
        self._hashes = set(config.admin_key_hashes())
        self._tenant_hashes = {h for t in config.tenants for h in t.key_hashes()}
        self._keys = keys  # tenant keys created by API (gateway.keys.KeyStore): valid, not admin

    def require(self, headers: Mapping[str, str]) -> str:
        """The admin's fingerprint (for the audit log); 401 without a key, 403 for a non-admin key."""
        key = bearer_token(headers.get("authorization"))
        if key is None:
            raise invalid_api_key("Missing API key. Send `Authorization: Bearer <admin key>`.")
        digest = hashlib.sha256(key.encode()).hexdigest()
        if digest in self._hashes:
            return f"admin:{digest[:12]}"
        if digest in self._tenant_hashes:
            raise _forbidden()
        rec = self._keys.lookup(digest) if self._keys is not None else None
        if rec is not None and rec.usable(time.time()):
            raise _forbidden()
        raise invalid_api_key("Incorrect API key provided.")


class RegionPolicyAdmin:
    """Validates and commits policy changes; each new version reaches the site chooser (and the
    durable snapshot) through the gateway's `PolicySync` before the call answers."""

    def __init__(self, config: FleetConfig, sync: PolicySync) -> None:
        self.config = config
        self.sync = sync
        self.store = sync.store

    def validate(self, tenant: str, model: str, body: RegionPolicy) -> RegionPolicy:
        extra = [k for k in ("tenant", "model") if k in body.model_fields_set
                 and getattr(body, k) != {"tenant": tenant, "model": model}[k]]
        if extra:
            raise bad_request(f"{extra} in the body disagree with the URL", param=extra[0])
        policy = body.model_copy(update={"tenant": tenant, "model": model})
        errors = check_policy(policy, self.config.sites, {m.name for m in self.config.models},
                              {t.name for t in self.config.tenants})
        if errors:
            raise bad_request("; ".join(errors), param=errors[0].split(":")[0])
        return policy

    async def load(self) -> Snapshot:
        return await _bounded(self.store.load(), self.sync.retry_after_s)

    async def change(self, actor: str, tenant: str, model: str, new: RegionPolicy | None,
                     if_match: int | None) -> tuple[int, RegionPolicy | None]:
        snap = await self.load()
        expected = snap.version if if_match is None else if_match
        before = next((p for p in snap.policies if p.key == (tenant, model)), None)
        if new is None and before is None:
            raise GatewayError(404, f"No region policy for tenant {tenant!r} and model {model!r}.",
                               code="policy_not_found")
        policies = [p for p in snap.policies if p.key != (tenant, model)] + ([new] if new else [])
        action = "delete" if new is None else ("update" if before else "create")
        entry = AuditEntry(expected + 1, now_unix(), actor, action, tenant, model,
                           before.model_dump() if before else None, new.model_dump() if new else None)
        try:
            version = await _bounded(self.store.commit(policies, entry, expected), self.sync.retry_after_s)
        except VersionConflict as e:
            raise GatewayError(412, f"{e}; re-read and retry.", code="version_conflict") from None
        await self.sync.accept(Snapshot(version, tuple(policies)))
        emit(audit_log, logging.INFO, {"event": "region_policy", "action": action, "actor": actor,
                                       "tenant": tenant, "model": model, "version": version})
        return version, before


def _where(chooser: SiteChooser, profile: RequestProfile, view: FleetView, now: float) -> dict[str, Any]:
    """Where `chooser` would send `profile`, and what its region policies allow (admin dry-run)."""
    try:
        decision = chooser.choose(profile, view, now)
    except GatewayError as e:  # e.g. no policy known yet: the dry-run says so instead of failing
        return {"site": None, "reason": e.message, "allowed_sites": None, "home_site": None, "spill": None,
                "policies_applied": [], "candidates": []}
    res = chooser.residency(profile, view)  # None: the chooser applies no region policy
    return {
        "site": decision.site, "reason": decision.reason,
        "allowed_sites": sorted(res.allowed) if res else None,
        "home_site": res.home if res else None, "spill": res.spill if res else None,
        "policies_applied": list(res.policies) if res else [],
        "candidates": [{"site": c.name, "score_s": c.score, **dict(c.detail)} for c in decision.candidates],
    }


def install_admin_routes(app: FastAPI, config: FleetConfig, admin: RegionPolicyAdmin, relay: Any,
                         placement: Any = None, keys: Any = None) -> None:
    """`keys`: the API-created tenant keys (`gateway.keys`; they get 403 here, not 401). `placement`: the planner the admin API talks to (`gateway.replica_state.PlannerAdmin` over the gateway's
    `PlacementLoop`: its mode durable, the lease holder's log on any replica), or None when it is off."""
    auth = AdminAuth(config, keys)
    tenant_names = {t.name for t in config.tenants}

    def if_match(request: Request) -> int | None:
        raw = request.headers.get("if-match")
        if raw is None:
            return None
        try:
            return int(raw.strip('"'))
        except ValueError:
            raise bad_request("If-Match must be a policy version number.", param="If-Match") from None

    @app.get("/admin/v1/region-policies")
    async def list_policies(request: Request) -> JSONResponse:
        auth.require(request.headers)
        snap = await admin.load()
        return JSONResponse({"version": snap.version, "policies": [p.model_dump() for p in snap.policies]},
                            headers={"ETag": str(snap.version)})

    @app.get("/admin/v1/region-policies/{tenant}/{model}")
    async def get_policy(tenant: str, model: str, request: Request) -> JSONResponse:
        auth.require(request.headers)
        snap = await admin.load()
        for p in snap.policies:
            if p.key == (tenant, model):
                return JSONResponse({"version": snap.version, "policy": p.model_dump()},
                                    headers={"ETag": str(snap.version)})
        raise GatewayError(404, f"No region policy for tenant {tenant!r} and model {model!r}.",
                           code="policy_not_found")

    @app.put("/admin/v1/region-policies/{tenant}/{model}", openapi_extra=openapi_body(RegionPolicy))
    async def put_policy(tenant: str, model: str, request: Request) -> JSONResponse:
        actor = auth.require(request.headers)
        policy = admin.validate(tenant, model, await read_body(request, RegionPolicy))
        version, before = await admin.change(actor, tenant, model, policy, if_match(request))
        return JSONResponse({"version": version, "policy": policy.model_dump()},
                            status_code=200 if before else 201, headers={"ETag": str(version)})

    @app.delete("/admin/v1/region-policies/{tenant}/{model}")
    async def delete_policy(tenant: str, model: str, request: Request) -> JSONResponse:
        actor = auth.require(request.headers)
        version, _ = await admin.change(actor, tenant, model, None, if_match(request))
        return JSONResponse({"version": version, "deleted": {"tenant": tenant, "model": model}},
                            headers={"ETag": str(version)})

    @app.get("/admin/v1/audit")
    async def audit(request: Request, limit: int = 100) -> JSONResponse:
        auth.require(request.headers)
        entries = await _bounded(admin.store.audit(max(1, min(limit, 1000))), admin.sync.retry_after_s)
        return JSONResponse({"entries": [asdict(e) for e in entries]})

    @app.post("/admin/v1/dry-run", openapi_extra=openapi_body(DryRunBody))
    async def dry_run(request: Request) -> JSONResponse:
        auth.require(request.headers)
        body = await read_body(request, DryRunBody)
        model, _, version = body.model.partition("@")
        profile = RequestProfile(
            request_id="dry-run", model=model, model_version=version or None,
            prompt_tokens=body.prompt_tokens, tenant=body.tenant,
            request_class=body.request_class, client_region=body.region or config.entry_region)
        view = relay.state.view()
        now = relay.clock()
        answer = _where(relay.site_chooser, profile, view, now)
        warnings = [] if not config.tenants or body.tenant in tenant_names else [
            f"unknown tenant {body.tenant!r}: no key of this fleet maps to it (known: {', '.join(sorted(tenant_names))})"]
        if body.proposed is not None:
            p = body.proposed
            proposal = admin.validate(p.tenant, p.model, p)  # 400 naming the field (unknown tenant too), as a PUT
            snap = await admin.load()
            policies = [q for q in snap.policies if q.key != proposal.key] + [proposal]
            chooser = relay.site_chooser.with_policies(PolicySet(policies, version=snap.version + 1))
            answer["proposed"] = with_it = _where(chooser, profile, view, now)
            answer["changes"] = [k for k in ("site", "allowed_sites", "home_site", "spill", "policies_applied")
                                 if with_it[k] != answer[k]]
        answer["warnings"] = warnings
        return JSONResponse(answer)

    @app.get("/admin/v1/planner")
    async def planner(request: Request, limit: int = 200) -> JSONResponse:
        auth.require(request.headers)
        if placement is None:
            return JSONResponse({"enabled": False, "placement": [], "entries": [], "actions": []})
        return JSONResponse(placement.report(max(1, min(limit, 1000))))

    @app.put("/admin/v1/planner", openapi_extra=openapi_body(PlannerModeBody))
    async def set_planner(request: Request) -> JSONResponse:
        actor = auth.require(request.headers)
        body = await read_body(request, PlannerModeBody)
        if placement is None:
            raise GatewayError(409, "The placement planner is not enabled in this gateway (fleet file "
                                    "`planner.enabled`, or `tokenfleet up --planner`).", code="planner_disabled")
        before = placement.mode
        result = placement.set_mode(body.mode, actor)
        if asyncio.iscoroutine(result):  # gateway.replica_state.PlannerAdmin: kept in the durable admin store
            try:
                await result
            except StoreUnavailable as e:  # Redis (or the sqlite store) down or hung: a 503, not a 500
                raise GatewayError(503, f"The admin store is unavailable: {e}", type="server_error",
                                   code="admin_store_unavailable", headers={"Retry-After": "1"}) from None
        emit(audit_log, logging.INFO, {"event": "planner_mode", "actor": actor, "before": before,
                                       "mode": placement.mode})
        return JSONResponse({"mode": placement.mode})

    @app.get("/admin/v1/fleet")
    async def fleet(request: Request) -> JSONResponse:
        auth.require(request.headers)
        return JSONResponse({"entry_region": config.entry_region, "sites": fleet_view(config, relay)})


# The request the fleet view prices each pool with: a fresh 1,000-token prompt (no cache hit).
_PROBE_PROMPT_TOKENS = 1000


def fleet_view(config: FleetConfig, relay: Any) -> list[dict[str, Any]]:
    """What FleetMind sees of each site, for operators (see the module doc). Per pool, next to
    the replica counts: the TTFT the router predicts there now for a fresh 1,000-token prompt
    (queueing included) and how many prefix blocks its cache index holds for the pool."""
    state = relay.state
    probed = state.probe_rtt_ms()
    view = state.view()
    now = relay.clock()
    router = relay.router
    counts = sorted(state.pools().items())
    out = []
    for s in config.sites:
        pools = []
        snap = view.site(s.name)
        for (site, model, version), c in counts:
            if site != s.name:
                continue
            ready = snap.pool(model, version)
            row: dict[str, Any] = {"model": model, "version": version, **asdict(c)}
            if ready:
                profile = RequestProfile(request_id="fleet-view", model=model, model_version=version,
                                         prompt_tokens=_PROBE_PROMPT_TOKENS)
                guess = router.predict(profile, ready, now)  # None: no cost model, or none eligible
                row["predicted_ttft_s"] = round(guess[0], 4) if guess is not None else None
            ids = [i.instance_id for i in snap.instances if i.model == model and i.version == version]
            blocks = [router.cache_blocks(i) for i in ids]
            if all(b is not None for b in blocks):  # a router with an index it can report
                row["cache_blocks"] = sum(b for b in blocks if b is not None)
                row["cache_exact_instances"] = sum(1 for i in ids if router.cache_exact(i, now))
            pools.append(row)
        out.append({"site": s.name, "region": s.region, "jurisdiction": s.jurisdiction, "gpus": s.gpus,
                    "rtt_ms": dict(s.rtt_ms), "probe_rtt_ms": probed.get(s.name),
                    "egress_cost_per_gb": s.egress_cost_per_gb, "pools": pools})
    return out
