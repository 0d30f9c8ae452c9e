"""SLOMax in the real gateway, over real sockets: 429/503 shapes, the queue and disconnects, classes,
the goodput report's access control, Prometheus figures."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest

from fleetcore.fleet_config import FleetConfig, parse_fleet
from gateway.app import create_app
from slomax import LedgeredAdmission, SLOMax, from_fleet
from slomax.config import Knobs
from tests.waits import wait_until

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "tell me a story"}]
KEY_A, KEY_B, ADMIN = "sk-tenant-a", "sk-tenant-b", "sk-admin"


def fleet(tenant_a: dict[str, Any] | None = None, admission: dict[str, Any] | None = None) -> FleetConfig:
    return parse_fleet({
        "sites": [{"name": "use1", "region": "us-east", "jurisdiction": "us"}],
        "models": [{"name": "m1", "versions": ["v1"], "engine": {"spec": "llama-3.1-8b", "max_model_len": 4096}}],
        "tenants": [{"name": "a", "api_keys": [KEY_A], **(tenant_a or {})},
                    {"name": "b", "api_keys": [KEY_B]}],
        "admin_api_keys": [ADMIN],
        **({"admission": admission} if admission else {}),
    })


@dataclass
class Gw:
    url: str
    app: Any
    stub: Any = None  # conftest's StubUpstream behind the one instance

    @property
    def gate(self) -> Any:
        return self.app.state.tokenfleet.admission

    async def post(self, key: str | None, body: dict[str, Any] | None = None,
                   headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
        h = {"Authorization": f"Bearer {key}"} if key else {}
        payload = body or {"model": "m1", "messages": MSGS, "max_tokens": 4}
        async with aiohttp.ClientSession() as s, s.post(self.url + CHAT, json=payload,
                                                        headers={**h, **(headers or {})}) as r:
            data = await r.json(content_type=None) if r.content_type == "application/json" else await r.text()
            return r.status, {k.lower(): v for k, v in r.headers.items()}, data

    async def get(self, path: str, key: str | None, headers: dict[str, str] | None = None) -> tuple[int, str, Any]:
        h = {"Authorization": f"Bearer {key}"} if key else {}
        async with aiohttp.ClientSession() as s, s.get(self.url + path, headers={**h, **(headers or {})}) as r:
            data = await r.json() if r.content_type == "application/json" else await r.text()
            return r.status, r.content_type, data


@pytest.fixture
def start(gateway_server: Callable[[Any], Awaitable[str]], stub_upstream: Any, fake_adapter: Any,
          instance_factory: Any) -> Callable[..., Awaitable[Gw]]:
    async def go(config: FleetConfig, admission: Any = None, **stub: Any) -> Gw:
        up = await stub_upstream(**stub)
        adapter = fake_adapter([instance_factory("i0", up.url)])
        app = create_app(config, [adapter], poll_interval_s=60, admission=admission)
        return Gw(await gateway_server(app), app, up)
    return go


async def test_over_budget_is_a_429_with_retry_after_and_openai_body(start) -> None:
    gw = await start(fleet({"budgets": {"requests_per_minute": 1}}))
    status, _, _ = await gw.post(KEY_A)
    assert status == 200
    status, headers, body = await gw.post(KEY_A)
    assert status == 429
    assert 1 <= int(headers["retry-after"]) <= 60 and headers["x-request-id"]
    err = body["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests" and err["param"] is None
    assert "requests per minute limit reached" in err["message"] and "try again in" in err["message"]
    assert (await gw.post(KEY_B))[0] == 200  # another tenant's budget is its own
    # The openai SDK sees its RateLimitError, with the same body.
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=KEY_A, max_retries=0)
    with pytest.raises(openai.RateLimitError) as e:
        await client.chat.completions.create(model="m1", messages=MSGS, max_tokens=4)
    assert e.value.code == "rate_limit_exceeded"
    cell = gw.gate.policy.ledger.totals[("a", "interactive")]
    assert (cell.arrived, cell.completed, cell.rejected, cell.rejected_by) == (3, 1, 2, {"budget_requests": 2})


async def test_tokens_per_minute_429_says_tokens(start) -> None:
    gw = await start(fleet({"budgets": {"tokens_per_minute": 100}}))
    status, headers, body = await gw.post(KEY_A, {"model": "m1", "messages": MSGS, "max_tokens": 500})
    assert status == 429 and body["error"]["type"] == "tokens" and "too large" in body["error"]["message"]
    assert headers["retry-after"] == "60"


async def test_early_rejection_is_a_503_with_the_reason_and_nothing_reaches_the_engine(start) -> None:
    # A prefill budget of 5 tokens/s: the first request runs (the pool was idle), the second
    # takes what the budget holds and leaves it in debt; the third would wait seconds for its
    # prefill budget — over its 1 s TTFT SLO, so it is refused at once.
    cfg = fleet()
    policy = SLOMax(from_fleet(cfg, knobs=Knobs(prefill_rate=5.0)))
    gw = await start(cfg, policy, chunks=20, delay_s=0.05)
    stream = {"model": "m1", "messages": MSGS, "max_tokens": 4, "stream": True}
    first = asyncio.create_task(gw.post(KEY_A, stream))
    await wait_until(lambda: len(gw.stub.requests), 5, "the first request to reach the engine", ok=lambda n: n == 1)
    second = asyncio.create_task(gw.post(KEY_A, stream))
    await wait_until(lambda: len(gw.stub.requests), 5, "the second request to reach the engine", ok=lambda n: n == 2)
    status, headers, body = await gw.post(KEY_B)
    assert status == 503 and int(headers["retry-after"]) >= 1
    err = body["error"]
    assert err["code"] == "slo_unattainable" and err["type"] == "server_error"
    assert "interactive" in err["message"] and "exceeds the interactive SLO of 1 s" in err["message"]
    assert (await first)[0] == 200 and (await second)[0] == 200
    assert gw.gate.policy.ledger.totals[("b", "interactive")].rejected_by == {"slo_unattainable": 1}


async def test_a_queued_request_leaves_the_queue_the_moment_its_client_goes(start) -> None:
    # One long-context request at a time on this one-instance pool (cap 0.5 per instance → 1).
    gw = await start(fleet(admission={"classes": {"long_context": {"max_concurrency": 0.5}}}),
                     chunks=20, delay_s=0.05)
    lc = {"x-tokenfleet-class": "long_context"}
    body = {"model": "m1", "messages": MSGS, "max_tokens": 4, "stream": True}
    first = asyncio.create_task(gw.post(KEY_A, body, lc))
    await wait_until(lambda: gw.gate._admitted, 5, "the first long-context request to be admitted")
    second = asyncio.create_task(gw.post(KEY_B, body, lc))
    await wait_until(lambda: gw.gate.waiting, 5, "the second one to wait in the queue")
    second.cancel()  # the client hangs up while it waits
    with pytest.raises(asyncio.CancelledError):
        await second
    # the moment its client goes: well within the first one's 1 s stream (20 chunks x 0.05 s)
    await wait_until(lambda: gw.gate.waiting, 1.0, "the queued request to leave the queue", ok=lambda n: n == 0)
    pool = gw.gate.policy.snapshot(time.monotonic())["pools"]["m1"]["classes"]["long_context"]
    assert pool["queued"] == 0 and pool["in_flight"] == 1
    status, _, text = await first
    assert status == 200 and "[DONE]" in text
    b = gw.gate.policy.ledger.totals[("b", "long_context")]
    assert (b.arrived, b.queued, b.cancelled, b.admitted) == (1, 1, 1, 0)
    assert gw.gate.policy.snapshot(time.monotonic())["pools"]["m1"]["in_flight"] == 0


async def test_class_from_header_metadata_and_unknown_class_is_a_400(start) -> None:
    gw = await start(fleet())
    status, _, body = await gw.post(KEY_A, headers={"x-tokenfleet-class": "gold"})
    assert status == 400 and body["error"]["code"] == "unknown_class"
    assert body["error"]["param"] == "x-tokenfleet-class" and "batch, interactive, long_context" in body["error"]["message"]
    status, _, _ = await gw.post(KEY_A, {"model": "m1", "messages": MSGS, "max_tokens": 4,
                                         "metadata": {"tokenfleet_class": "batch"}})
    assert status == 200
    assert gw.gate.policy.ledger.totals[("a", "batch")].met_slo == 1
    status, _, _ = await gw.post(KEY_A, headers={"x-tokenfleet-task-type": "rag"})
    assert status == 200 and gw.gate.policy.ledger.totals[("a", "long_context")].completed == 1


async def test_goodput_report_access_control_json_and_csv(start) -> None:
    gw = await start(fleet())
    for key in (KEY_A, KEY_A, KEY_B):
        assert (await gw.post(key))[0] == 200
    path = "/v1/reports/goodput"
    status, _, body = await gw.get(path, None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert (await gw.get(path, "sk-nobody"))[0] == 401
    status, _, body = await gw.get(path, KEY_A)
    assert status == 200 and {r["tenant"] for r in body["rows"]} == {"a"}
    (row,) = body["rows"]
    assert (row["class"], row["arrived"], row["completed"], row["met_slo"], row["attainment"]) == (
        "interactive", 2, 2, 2, 1.0)
    assert row["output_tokens"] == 8 and row["goodput_tokens"] == 8 and row["window_start"].endswith("Z")
    assert body["totals"]["arrived"] == 2
    status, _, body = await gw.get(path + "?tenant=b", KEY_A)  # tenant A cannot read tenant B
    assert status == 403 and body["error"]["type"] == "permission_error"
    status, _, body = await gw.get(path, ADMIN)
    assert status == 200 and {r["tenant"] for r in body["rows"]} == {"a", "b"}
    status, _, body = await gw.get(path + "?tenant=b&class=interactive&window=15m&per_window=true", ADMIN)
    assert status == 200 and [r["tenant"] for r in body["rows"]] == ["b"] and body["window_s"] == 900
    status, ctype, text = await gw.get(path + "?format=csv", KEY_B)
    assert status == 200 and ctype == "text/csv"
    lines = text.strip().splitlines()
    assert lines[0].startswith("tenant,class,window_start,window_end,arrived") and lines[0].endswith("attainment")
    assert len(lines) == 2 and lines[1].startswith("b,interactive,")
    status, ctype, _ = await gw.get(path, ADMIN, {"Accept": "text/csv"})
    assert ctype == "text/csv"
    assert (await gw.get(path + "?class=gold", ADMIN))[0] == 400
    assert (await gw.get(path + "?window=soon", ADMIN))[0] == 400
    # The admin-only view: a tenant key is refused, an admin key sees the policy's state.
    status, _, body = await gw.get("/admin/v1/admission", KEY_A)
    assert status == 403
    status, _, body = await gw.get("/admin/v1/admission", ADMIN)
    assert status == 200 and body["policy"] == "slomax" and "m1" in body["pools"]


async def test_admission_figures_on_metrics(start) -> None:
    gw = await start(fleet({"budgets": {"requests_per_minute": 1}}))
    await gw.post(KEY_A)
    await gw.post(KEY_A)
    _, _, text = await gw.get("/metrics", ADMIN)  # per-tenant series: for the admin only
    assert 'tokenfleet_goodput_requests_total{class="interactive",result="met_slo",tenant="a"} 1.0' in text
    assert 'tokenfleet_admission_rejected_total{class="interactive",reason="budget_requests",tenant="a"} 1.0' in text
    assert 'tokenfleet_goodput_tokens_total{class="interactive",tenant="a"} 4.0' in text
    assert 'tokenfleet_slo_attainment{class="interactive",tenant="a"} 0.5' in text
    assert 'tokenfleet_admission_in_flight{class="interactive",model="m1"} 0.0' in text
    assert "tokenfleet_admission_engine_wait_target_seconds" in text


async def test_fcfs_in_the_fleet_file_admits_everything_and_still_reports(start) -> None:
    gw = await start(fleet({"budgets": {"requests_per_minute": 1}}, admission={"policy": "fcfs"}))
    assert [(await gw.post(KEY_A))[0] for _ in range(3)] == [200, 200, 200]  # FCFS: no budgets
    status, _, body = await gw.get("/v1/reports/goodput", KEY_A)
    assert status == 200 and body["policy"] == "fcfs" and body["rows"][0]["completed"] == 3


class _Avoiding(LedgeredAdmission):
    """A stand-in policy: admits everything, asking to avoid instance i0."""

    name = "avoiding"

    def __init__(self, avoid: tuple[str, ...]) -> None:
        from slomax import GoodputLedger

        self.avoid = avoid
        self.ledger = GoodputLedger()

    def admit(self, profile: Any, view: Any, now: float) -> Any:
        from fleetcore.types import AdmissionDecision

        return AdmissionDecision("admit", request_class="interactive", avoid_instances=self.avoid)

    def snapshot(self, now: float) -> dict[str, Any]:
        return {"policy": self.name, "pools": {}}


@pytest.mark.slow
async def test_routing_skips_the_instances_admission_says_to_avoid(gateway_server, stub_upstream, fake_adapter,
                                                                    instance_factory) -> None:
    ups = [await stub_upstream() for _ in range(2)]
    adapter = fake_adapter([instance_factory(f"i{k}", u.url) for k, u in enumerate(ups)])
    for avoid, allowed in ((("i0",), {"i1"}), (("i0", "i1"), {"i0", "i1"})):  # all avoided: the hint gives way
        app = create_app(fleet(), [adapter], poll_interval_s=60, admission=_Avoiding(avoid))
        gw = Gw(await gateway_server(app), app)
        seen = {(await gw.post(KEY_A))[1]["x-tokenfleet-instance"] for _ in range(4)}
        assert seen <= allowed and seen
