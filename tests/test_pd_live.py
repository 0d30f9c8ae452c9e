"""Prefill/decode disaggregation live: the gateway's P -> D flow over real sim worker processes.

The gateway runs in-process (`gateway.embedded.serve_fleet`, what `tokenfleet up` composes) over
real simulated worker processes on loopback, with a P/D fleet: site `east` speaks SGLang's PD
protocol (bootstrap fields, both legs at once), site `west` vLLM's (kv_transfer_params, prefill
then decode). A long uncached prompt goes split and streams right with the right usage; a short
one stays local; a prefill worker killed or SIGSTOPped mid-prefill leaves the request retried
locally (or ended with an error), and the decode worker holds nothing afterwards (its
`/pd/state`); a client that leaves releases both legs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import pytest_asyncio

from engine_adapters.base import Instance
from engine_adapters.sim.launcher import SimAdapter
from fleetcore.fleet_config import FleetConfig
from gateway.embedded import ServedFleet, serve_fleet
from tests.waits import wait_until

MODEL = "llama-3.1-70b"
EAST_KEY = "sk-test-east"
WEST_KEY = "sk-test-west"
FIRST_BYTE_FLOOR_S = 3.0

FLEET: dict[str, Any] = {
    "regions": ["us-east", "eu-west"],
    "default_region": "us-east",
    "sites": [{"name": "east", "region": "us-east", "jurisdiction": "us", "rtt_ms": {"us-east": 1, "eu-west": 70},
               "interconnect": {"bandwidth_gb_s": 50, "latency_ms": 0.01}},
              {"name": "west", "region": "eu-west", "jurisdiction": "eu", "rtt_ms": {"us-east": 70, "eu-west": 1}}],
    "models": [{"name": MODEL, "versions": ["v1"],
                "engine": {"spec": "llama-3.1-70b", "max_model_len": 16384, "block_size": 16}}],
    "deployments": [{"site": "east", "model": MODEL, "instances": 3, "gpu": "H200", "tp": 2, "adapter": "sim",
                     "roles": {"prefill": 1, "decode": 2}, "options": {"time_scale": 1.0, "pd_protocol": "sglang"}},
                    {"site": "west", "model": MODEL, "instances": 3, "gpu": "H200", "tp": 2, "adapter": "sim",
                     "roles": {"prefill": 1, "decode": 2}, "options": {"time_scale": 1.0, "pd_protocol": "vllm"}}],
    "tenants": [{"name": "east", "api_keys": [EAST_KEY], "region": "us-east"},
                {"name": "west", "api_keys": [WEST_KEY], "region": "eu-west"}],
    "region_policies": [{"tenant": "east", "allowed_jurisdictions": ["us"]},
                        {"tenant": "west", "allowed_jurisdictions": ["eu"]}],
    "gateway": {"first_byte_timeout_floor_s": FIRST_BYTE_FLOOR_S, "stream_idle_timeout_s": 5.0,
                "engine_restart_backoff_s": 0.2, "engine_restart_backoff_max_s": 1.0},
}

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]


@dataclass
class Fleet:
    served: ServedFleet
    stopped: set[int] = field(default_factory=set)

    @property
    def url(self) -> str:
        return self.served.url

    @property
    def ctx(self) -> Any:
        return self.served.app.state.tokenfleet

    def instances(self, site: str, role: str | None = None) -> list[Instance]:
        return [i for a in self.served.adapters for i in a.instances
                if i.site == site and (role is None or i.role == role)]

    def proc_pid(self, inst: Instance) -> int:
        for a in self.served.adapters:
            if isinstance(a, SimAdapter) and inst in a.instances:
                proc = a.process(inst)
                assert proc is not None
                return proc.pid
        raise KeyError(inst.instance_id)

    def stop(self, inst: Instance) -> None:
        pid = self.proc_pid(inst)
        os.kill(pid, signal.SIGSTOP)
        self.stopped.add(pid)

    def cont_all(self) -> None:
        for pid in list(self.stopped):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.stopped.clear()

    def metric(self, name: str, **labels: str) -> float:
        text = self.ctx.metrics.render(per_tenant=True).decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def decision(self, request_id: str) -> dict[str, Any]:
        found = [d for d in self.ctx.relay.decisions.last(256) if d["request_id"] == request_id]
        assert found, request_id
        return found[0]


def _ready(f: Fleet) -> int:
    return sum(1 for st in f.ctx.state.states() if st.up)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def fleet() -> AsyncIterator[Fleet]:
    async with serve_fleet(FleetConfig.model_validate(FLEET), poll_interval_s=0.1) as served:
        f = Fleet(served)
        await wait_until(lambda: _ready(f), 30, "every instance ready", ok=lambda n: n == 6)
        yield f
        f.cont_all()


@pytest_asyncio.fixture(loop_scope="module")
async def healthy(fleet: Fleet) -> AsyncIterator[Fleet]:
    fleet.cont_all()
    await wait_until(lambda: _ready(fleet), 60, "every instance ready", ok=lambda n: n == 6)
    yield fleet
    fleet.cont_all()


_PROMPTS = iter(range(10**6))


def long_prompt(words: int = 1500) -> str:
    """A prompt nobody has cached (a fresh number in every word)."""
    n = next(_PROMPTS)
    return " ".join(f"doc{n}-w{i}" for i in range(words))


async def pd_state(inst: Instance) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=5) as c:
        r = await c.get(inst.url + "/pd/state")
        r.raise_for_status()
        return r.json()


def holds_nothing(state: dict[str, Any]) -> bool:
    return state["rooms"] == 0 and state["engine_held"] == 0 and state["engine_receiving"] == 0 \
        and state["kv_usage"] == 0.0


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    events: list[Any]
    request_id: str

    @property
    def text(self) -> str:
        return "".join((ch.get("text") or "") for e in self.events if isinstance(e, dict)
                       for ch in e.get("choices") or ())

    @property
    def tokens(self) -> int:
        return sum(1 for e in self.events if isinstance(e, dict) for ch in e.get("choices") or () if ch.get("text"))

    @property
    def usage(self) -> dict[str, Any] | None:
        found = [e["usage"] for e in self.events if isinstance(e, dict) and e.get("usage")]
        assert len(found) <= 1, found
        return found[0] if found else None

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [e["error"] for e in self.events if isinstance(e, dict) and "error" in e]


async def stream(f: Fleet, key: str, prompt: str, max_tokens: int, rid: str) -> Answer:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    events: list[Any] = []
    async with httpx.AsyncClient(base_url=f.url, timeout=60,
                                 headers={"Authorization": f"Bearer {key}", "X-Request-Id": rid}) as c:
        async with c.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return Answer(r.status_code, dict(r.headers), [r.json()], rid)
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
            return Answer(r.status_code, dict(r.headers), events, rid)


async def expected_text(f: Fleet, site: str, prompt: str, max_tokens: int, avoid: str = "") -> str:
    """What a mixed engine writes for this prompt (the text depends only on the prompt): asked of a
    decode worker directly (not `avoid`, one just killed), as an ordinary request."""
    inst = next(i for i in f.instances(site, "decode") if i.instance_id != avoid)
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(inst.url + "/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                             "max_tokens": max_tokens, "ignore_eos": True})
        r.raise_for_status()
        return r.json()["choices"][0]["text"]


@contextlib.asynccontextmanager
async def decoding(f: Fleet, key: str, site: str, n: int = 8) -> AsyncIterator[None]:
    """Streams decoding on the site's decode instances (short prompts: local), so that a long
    prefill there would stall them: what makes splitting worth its transfer. Over on exit."""
    tasks = [asyncio.create_task(stream(f, key, f"background {site} {next(_PROMPTS)}", 600, f"bg-{site}-{i}-"
                                        f"{next(_PROMPTS)}")) for i in range(n)]
    try:
        decode_ids = {i.instance_id for i in f.instances(site, "decode")}
        await wait_until(lambda: sum(st.inflight for st in f.ctx.state.states()
                                     if st.instance.instance_id in decode_ids), 10,
                         "background streams running", ok=lambda k: k >= n)
        await asyncio.sleep(0.3)  # their first tokens are out: they decode now
        yield
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize("site,key", [("east", EAST_KEY), ("west", WEST_KEY)])
async def test_long_uncached_prompt_goes_split_and_streams_right(healthy: Fleet, site: str, key: str) -> None:
    f = healthy
    prompt = long_prompt()
    ok_before = f.metric("tokenfleet_pd_legs_total", leg="prefill", outcome="ok")
    pre = f.instances(site, "prefill")[0]
    transfers_before = (await pd_state(pre))["transfers"]
    async with decoding(f, key, site):
        a = await stream(f, key, prompt, 24, f"pd-long-{site}")
    assert a.status == 200, a.events
    d = f.decision(a.request_id)
    assert d["reason"].startswith("split"), (d["reason"], d["candidates"])
    dec = a.headers["x-tokenfleet-instance"]
    assert f"prefill {pre.instance_id} -> decode {dec}" in d["reason"]
    assert dec in {i.instance_id for i in f.instances(site, "decode")}
    assert a.errors == [] and a.events[-1] == "[DONE]"
    assert a.tokens == 24
    u = a.usage
    assert u is not None and u["completion_tokens"] == 24 and u["prompt_tokens"] > 4000
    assert u["prompt_tokens_details"]["cached_tokens"] == 0  # uncached on the prefill side
    assert a.text == await expected_text(f, site, prompt, 24)
    # the prefill leg is counted, its KV crossed the link and was freed on both ends
    await wait_until(lambda: f.metric("tokenfleet_pd_legs_total", leg="prefill", outcome="ok"), 10,
                     "prefill leg counted", ok=lambda n: n >= ok_before + 1)
    assert (await pd_state(pre))["transfers"] > transfers_before
    await all_released(f, site)


async def all_released(f: Fleet, site: str) -> None:
    """Every worker of the site holds no room, no held or incoming KV, no blocks (the engine's KV
    usage counts only running requests' blocks)."""
    for inst in f.instances(site):
        await wait_until(lambda inst=inst: pd_state(inst), 10, f"{inst.instance_id} holds nothing",  # type: ignore[misc]
                         ok=holds_nothing)


async def test_short_prompt_stays_local(healthy: Fleet) -> None:
    f = healthy
    a = await stream(f, EAST_KEY, "Hello, fleet!", 8, "pd-short")
    assert a.status == 200 and a.tokens == 8 and a.errors == []
    d = f.decision(a.request_id)
    assert d["reason"].startswith("local"), d
    assert a.headers["x-tokenfleet-instance"] in {i.instance_id for i in f.instances("east", "decode")}


async def prefilling(f: Fleet, pre: Instance) -> None:
    """Until the prefill worker has a room it is prefilling (the split request reached it)."""
    await wait_until(lambda: pd_state(pre), 10, "a prefill leg in progress", ok=lambda s: s["rooms"] >= 1)


def kill(f: Fleet, inst: Instance) -> None:
    os.kill(f.proc_pid(inst), signal.SIGKILL)  # its supervisor starts it again (cold)


@pytest.mark.parametrize("site,key,how", [("east", EAST_KEY, "kill"), ("west", WEST_KEY, "kill"),
                                          ("east", EAST_KEY, "stop"), ("west", WEST_KEY, "stop")])
async def test_prefill_leg_dies_or_stalls_mid_prefill_retried_locally(healthy: Fleet, site: str, key: str,
                                                                     how: str) -> None:
    f = healthy
    pre = f.instances(site, "prefill")[0]
    rid = f"pd-{how}-{site}"
    prompt = long_prompt()
    async with decoding(f, key, site):
        req = asyncio.create_task(stream(f, key, prompt, 24, rid))
        await prefilling(f, pre)
        kill(f, pre) if how == "kill" else f.stop(pre)
        a = await req
    assert f.decision(rid)["reason"].startswith("split")
    # retried once, locally: a decode instance prefilled it itself, and the client saw one whole stream
    assert a.status == 200, a.events
    assert a.errors == [] and a.events[-1] == "[DONE]" and a.tokens == 24
    assert a.headers["x-tokenfleet-instance"] in {i.instance_id for i in f.instances(site, "decode")}
    assert a.text == await expected_text(f, site, prompt, 24)
    retry = [d for d in f.ctx.relay.decisions.last(256) if d["request_id"] == rid and d["attempt"] == 1]
    assert retry and retry[0]["reason"].startswith("local"), retry
    outcome = "failed" if how == "kill" else "stalled"
    assert f.metric("tokenfleet_pd_legs_total", leg="prefill", outcome=outcome) >= 1
    # the decode side gave up the room: nothing reserved, nothing held (the prefill worker is
    # dead or stopped; the decode workers must not wait for it)
    for inst in f.instances(site, "decode"):
        await wait_until(lambda inst=inst: pd_state(inst), 10, f"{inst.instance_id} holds nothing",  # type: ignore[misc]
                         ok=holds_nothing)
    f.cont_all()


async def test_client_disconnect_releases_both_legs(healthy: Fleet) -> None:
    f = healthy
    pre = f.instances("east", "prefill")[0]
    rid = "pd-gone"
    async with decoding(f, EAST_KEY, "east"):
        gone_before = f.metric("tokenfleet_requests_total", status="499")
        req = asyncio.create_task(stream(f, EAST_KEY, long_prompt(), 24, rid))
        await prefilling(f, pre)
        req.cancel()  # the client goes away while the prefill runs and the decode waits for its KV
        with contextlib.suppress(asyncio.CancelledError):
            await req
        # counted as gone exactly once (the decode leg waits in its own task: its 499, no other);
        # within the block, before the background streams are cut (their clients leave too)
        await wait_until(lambda: f.metric("tokenfleet_requests_total", status="499"), 10, "the 499 counted",
                         ok=lambda n: n == gone_before + 1)
    assert f.decision(rid)["reason"].startswith("split")
    await all_released(f, "east")
    await wait_until(lambda: sum(st.inflight for st in f.ctx.state.states()), 10, "nothing in flight",
                     ok=lambda n: n == 0)


async def test_decode_dying_mid_stream_is_continued_without_the_pd_fields(healthy: Fleet) -> None:
    """A split request whose decode worker dies after its first tokens is continued elsewhere
    (re-prefilled: the continuation body drops the bootstrap fields, whose room is gone)."""
    f = healthy
    rid = "pd-decode-dies"
    prompt = long_prompt()
    seen: dict[str, Any] = {}

    async def read() -> Answer:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 200, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        events: list[Any] = []
        async with httpx.AsyncClient(base_url=f.url, timeout=60,
                                     headers={"Authorization": f"Bearer {EAST_KEY}", "X-Request-Id": rid}) as c:
            async with c.stream("POST", "/v1/completions", json=body) as r:
                dec = next(i for i in f.instances("east") if i.instance_id == r.headers["x-tokenfleet-instance"])
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
                    if len(events) == 20 and "killed" not in seen:
                        seen["killed"] = dec.instance_id
                        kill(f, dec)
                return Answer(r.status_code, dict(r.headers), events, rid)
    async with decoding(f, EAST_KEY, "east"):
        a = await read()
    assert f.decision(rid)["reason"].startswith("split")
    assert seen["killed"] in {i.instance_id for i in f.instances("east", "decode")}
    assert a.status == 200 and a.errors == [] and a.events[-1] == "[DONE]"
    assert a.tokens == 200 and a.usage is not None and a.usage["completion_tokens"] == 200
    # what was relayed before the kill is the engine's text; the continuation writes on from there
    # (its words come from its own prompt: prompt + what was generated)
    whole = await expected_text(f, "east", prompt, 200, avoid=seen["killed"])
    assert a.text[:40] == whole[:40]
    conts = [d for d in f.ctx.relay.decisions.last(256) if d["request_id"] == rid and d["continuation"]]
    assert conts and seen["killed"] not in [d["instance"] for d in conts]
