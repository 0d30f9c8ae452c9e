"""Streams that survive their engine: continuation by re-prefill over real simulated workers.

The gateway runs in-process over real sim worker processes on loopback (`gateway.embedded`);
engines are SIGKILLed or SIGSTOPped mid-stream, or drained. The client must see one stream:
exactly `max_tokens` tokens, one `id`, one usage counting every token, `[DONE]` once, no
error event; or, where the request cannot be continued, the error event as before.

When: inside the gateway's own read of a request's n-th token (`tests.upstream_tap`), not when
the client has read it. The engine is another process and keeps generating while the gateway
relays and the client reads; timed off the client, a loaded machine can let it finish the whole
stream first, and the test then checks a stream that never failed. At the gateway's read it can
only have finished if it generated the rest of its budget between sending the n-th token and
that read, and then that read carried [DONE] too (`Fired.done`, checked by `acted`).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import pytest_asyncio

from engine_adapters.base import Instance
from engine_adapters.sim.launcher import SimAdapter
from fleetcore.fleet_config import FleetConfig
from gateway.embedded import ServedFleet, serve_fleet
from gateway.errors import overloaded
from tests.upstream_tap import Fired, UpstreamTap
from tests.waits import wait_until

MODEL = "llama-3.1-8b"
KEY = "sk-test-acme"
PINNED_KEY = "sk-test-pinned"
IDLE_S = 2.0  # a stream idle this long is stalled: 1.0 s was within a loaded machine's own stalls (continuation legs cut at load 8-10)

FLEET: dict[str, Any] = {
    "regions": ["us-east", "eu-west"],
    "default_region": "us-east",
    "sites": [{"name": "east", "region": "us-east", "jurisdiction": "us", "rtt_ms": {"us-east": 1, "eu-west": 70}},
              {"name": "west", "region": "eu-west", "jurisdiction": "eu", "rtt_ms": {"us-east": 70, "eu-west": 1}}],
    "models": [{"name": MODEL, "versions": ["v1"],
                "engine": {"spec": "llama-3.1-8b", "max_model_len": 8192, "block_size": 16}}],
    "deployments": [{"site": "east", "model": MODEL, "instances": 3, "gpu": "H100", "adapter": "sim",
                     "options": {"time_scale": 1.0}},
                    {"site": "west", "model": MODEL, "instances": 1, "gpu": "H100", "adapter": "sim",
                     "options": {"time_scale": 1.0}}],
    "tenants": [{"name": "acme", "api_keys": [KEY], "region": "us-east"},
                {"name": "pinned", "api_keys": [PINNED_KEY], "region": "eu-west"}],
    "region_policies": [{"tenant": "pinned", "allowed_jurisdictions": ["eu"]}],
    "planner": {"drain_timeout_s": 2.0},
    # engines killed here come back quickly: the next test starts with all four
    "gateway": {"stream_idle_timeout_s": IDLE_S, "first_byte_timeout_floor_s": 5.0,
                "engine_restart_backoff_s": 0.2, "engine_restart_backoff_max_s": 1.0,
                "continuation": {"max_continuations": 2}},
}

pytestmark = pytest.mark.asyncio(loop_scope="module")


@dataclass
class Fleet:
    served: ServedFleet
    stopped: set[int] = field(default_factory=set)

    @property
    def url(self) -> str:
        return self.served.url

    def instance(self, iid: str) -> tuple[SimAdapter, Instance]:
        for a in self.served.adapters:
            for i in a.instances:
                if i.instance_id == iid:
                    assert isinstance(a, SimAdapter)
                    return a, i
        raise KeyError(iid)

    def instances(self, site: str) -> list[Instance]:
        return [i for a in self.served.adapters for i in a.instances if i.site == site]

    def kill(self, iid: str) -> None:
        adapter, inst = self.instance(iid)
        proc = adapter.process(inst)
        assert proc is not None
        # its supervisor restarts it later (cold); the continuation, not the restart, saves the stream
        os.kill(proc.pid, signal.SIGKILL)

    def stop(self, iid: str) -> None:
        adapter, inst = self.instance(iid)
        proc = adapter.process(inst)
        assert proc is not None
        os.kill(proc.pid, signal.SIGSTOP)
        self.stopped.add(proc.pid)

    def cont_all(self) -> None:
        for pid in list(self.stopped):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.stopped.clear()

    @property
    def ctx(self) -> Any:
        return self.served.app.state.tokenfleet

    def metric(self, name: str, **labels: str) -> float:
        text = self.ctx.metrics.render(per_tenant=True).decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total


def fleet_config(**gateway: Any) -> FleetConfig:
    raw = json.loads(json.dumps(FLEET))
    raw["gateway"].update(gateway)
    return FleetConfig.model_validate(raw)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def fleet() -> AsyncIterator[Fleet]:
    async with serve_fleet(fleet_config(), poll_interval_s=0.1) as served:
        f = Fleet(served)
        await wait_until(lambda: _ready(f), 30, "every instance ready", ok=lambda n: n == 4)
        yield f
        f.cont_all()


def _ready(f: Fleet) -> int:
    return sum(1 for st in f.ctx.state.states() if st.up)


@pytest_asyncio.fixture(loop_scope="module")
async def healthy(fleet: Fleet) -> AsyncIterator[Fleet]:
    """The fleet with every engine up before each test (killed ones restarted by their supervisor)."""
    fleet.cont_all()
    for st in fleet.ctx.state.states():
        st.draining = False
    await wait_until(lambda: _ready(fleet), 60, "every instance ready", ok=lambda n: n == 4)
    yield fleet
    fleet.cont_all()


@pytest.fixture
def tap(healthy: Fleet) -> Iterator[UpstreamTap]:
    """Actions inside the gateway's reads of a request's stream, for this test only."""
    with UpstreamTap(healthy.ctx.relay) as t:
        yield t


def new_rid(what: str) -> str:
    """A request id of the test's own (the client's X-Request-Id): what `UpstreamTap` keys on."""
    return f"{what}-{os.urandom(6).hex()}"


def kill_at(f: Fleet, tap: UpstreamTap, n: int) -> str:
    """A request id whose first engine is SIGKILLed inside the gateway's read of its n-th token."""
    rid = new_rid("kill")
    tap.at_tokens(rid, n, f.kill)
    return rid


def acted(tap: UpstreamTap, rid: str, times: int = 1, cut: bool = True) -> list[Fired]:
    """The tap's actions on `rid`, each taken while its engine was still generating: the read it
    ran in did not carry [DONE] and, where the action cut the leg (`cut`: a kill or a stop), no
    [DONE] came on that leg at all (one would have been sent before the action)."""
    fired = tap.fired_for(rid)
    assert len(fired) == times, f"expected {times} action(s) on {rid}, took {fired}"
    late = [x for x in fired if x.done or (cut and tap.finished(rid, x.leg))]
    assert not late, f"the engine had sent its whole answer before the gateway read the token acted on: {late}"
    return fired


@dataclass
class Stream:
    status: int = 0
    instance: str = ""
    tokens: int = 0
    text: str = ""
    ids: set[str] = field(default_factory=set)
    events: list[Any] = field(default_factory=list)
    last_token_at: float = 0.0
    gaps: list[float] = field(default_factory=list)

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [e["error"] for e in self.events if isinstance(e, dict) and "error" in e]

    @property
    def usage(self) -> dict[str, Any] | None:
        found = [e["usage"] for e in self.events if isinstance(e, dict) and e.get("usage")]
        assert len(found) <= 1, found
        return found[0] if found else None


def _token_text(ev: dict[str, Any], chat: bool) -> str:
    out = ""
    for ch in ev.get("choices") or ():
        out += (ch.get("delta") or {}).get("content") or "" if chat else ch.get("text") or ""
    return out


async def read_stream(f: Fleet, body: dict[str, Any], *, chat: bool = True, key: str = KEY,
                      request_id: str | None = None) -> Stream:
    s = Stream()
    path = "/v1/chat/completions" if chat else "/v1/completions"
    headers = {"Authorization": f"Bearer {key}", **({"X-Request-Id": request_id} if request_id else {})}
    async with httpx.AsyncClient(base_url=f.url, headers=headers, timeout=60) as c:
        async with c.stream("POST", path, json=body) as r:
            s.status = r.status_code
            s.instance = r.headers.get("x-tokenfleet-instance", "")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                ev: Any = data if data == "[DONE]" else json.loads(data)
                s.events.append(ev)
                if isinstance(ev, dict):
                    if "id" in ev:
                        s.ids.add(ev["id"])
                    text = _token_text(ev, chat)
                    if text:
                        now = time.monotonic()
                        if s.tokens:
                            s.gaps.append(now - s.last_token_at)
                        s.tokens += 1
                        s.text += text
                        s.last_token_at = now
    return s


def chat_body(content: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **extra}


def completion_body(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **extra}


def assert_whole(s: Stream, max_tokens: int) -> None:
    assert s.status == 200
    assert not s.errors, s.errors
    assert s.events[-1] == "[DONE]" and s.events.count("[DONE]") == 1
    assert s.tokens == max_tokens, (s.tokens, max_tokens)
    assert len(s.ids) == 1, s.ids
    usage = s.usage
    assert usage is not None and usage["completion_tokens"] == max_tokens, usage
    assert usage["total_tokens"] == usage["prompt_tokens"] + max_tokens


# --- where it continues: the instance holding the prefix re-prefills only the tail ---

async def test_continuation_prefers_the_instance_holding_the_prefix(healthy: Fleet, tap: UpstreamTap) -> None:
    """First in the module, before any engine was killed: an engine its supervisor restarted
    may take long to feed the index its KV events again (seen: over 30 s)."""
    f = healthy
    messages = [{"role": "user", "content": " ".join(f"paragraph {i} on routing cached prefixes" for i in range(80))}]
    warm, cold = f.instances("east")[:2], f.instances("east")[2]
    router = f.ctx.relay.router
    prompt_tokens = 0

    async def warmed() -> list[int]:
        """Send the prompt straight to each warm engine not indexed yet: their KV events tell the
        gateway's index (an engine restarted by an earlier test resubscribes within a backoff)."""
        nonlocal prompt_tokens
        async with httpx.AsyncClient(timeout=30) as c:
            for inst in warm:
                if prompt_tokens and (router.cache_blocks(inst.instance_id) or 0) >= prompt_tokens // 16:
                    continue
                r = await c.post(inst.url + "/v1/chat/completions",
                                 json={"model": MODEL, "messages": messages, "max_tokens": 1})
                assert r.status_code == 200, r.text
                prompt_tokens = r.json()["usage"]["prompt_tokens"]
        return [router.cache_blocks(i.instance_id) or 0 for i in warm]

    await wait_until(warmed, 30, "both warm engines indexed", ok=lambda v: min(v) >= prompt_tokens // 16,
                     every_s=0.5)
    full_blocks = prompt_tokens // 16
    body = {**chat_body("", 300), "messages": messages}
    rid = kill_at(f, tap, 20)
    s = await read_stream(f, body, request_id=rid)
    acted(tap, rid)
    assert s.instance in {i.instance_id for i in warm}
    assert_whole(s, 300)
    usage = s.usage
    assert usage is not None
    leg = [d for d in f.ctx.decisions.last(20) if d["continuation"] == 1 and d["request_id"] == rid][-1]
    assert leg["instance"] in {i.instance_id for i in warm} and leg["instance"] != cold.instance_id
    # the engine served the original prompt's full blocks from its cache: only the tail was prefilled
    reprefill, cached = usage["tokenfleet_reprefill_tokens"], usage["tokenfleet_reprefill_cached_tokens"]
    assert cached == full_blocks * 16, usage
    assert f.metric("tokenfleet_reprefill_cached_tokens_total") >= cached
    assert reprefill - cached < 16 + (reprefill - prompt_tokens), usage


# --- the engine dies or stalls mid-stream ---

async def test_engine_killed_mid_stream_chat_completes_elsewhere(healthy: Fleet, tap: UpstreamTap) -> None:
    f = healthy
    before = f.metric("tokenfleet_continuations_total", reason="engine_died", outcome="continued")
    rid = kill_at(f, tap, 20)
    s = await read_stream(f, chat_body("tell me a long story about fleets", 300), request_id=rid)
    (fired,) = acted(tap, rid)
    assert fired.instance_id == s.instance
    assert_whole(s, 300)
    usage = s.usage
    assert usage is not None and usage["tokenfleet_continuations"] == 1
    # the continuation re-prefilled the prompt and the tokens already relayed (at least the 20 the
    # gateway had read when the engine died; a few more may have been in flight to it)
    assert usage["prompt_tokens"] + 20 <= usage["tokenfleet_reprefill_tokens"] < usage["prompt_tokens"] + 300
    assert f.metric("tokenfleet_continuations_total", reason="engine_died", outcome="continued") == before + 1
    # one stream to the client: its id and the chat shape throughout
    assert all(e.get("object") == "chat.completion.chunk" for e in s.events if isinstance(e, dict))
    decisions = f.ctx.decisions.last(20)
    legs = [d for d in decisions if d["continuation"] == 1 and d["continuation_reason"] == "engine_died"]
    assert legs and legs[-1]["instance"] != s.instance and s.instance in legs[-1]["excluded"]
    # every leg released what it held: nothing in flight, nothing left in the relay's live set
    await wait_until(lambda: [st.inflight for st in f.ctx.state.states()], 5, "no dispatch in flight",
                     ok=lambda v: not any(v))
    assert not f.ctx.relay.live


async def test_engine_killed_mid_stream_completions(healthy: Fleet, tap: UpstreamTap) -> None:
    f = healthy
    rid = kill_at(f, tap, 50)
    s = await read_stream(f, completion_body("Once upon a time in a datacenter", 200), chat=False, request_id=rid)
    acted(tap, rid)
    assert_whole(s, 200)
    assert all(e.get("object") == "text_completion" for e in s.events if isinstance(e, dict))
    assert s.text.startswith(" ")  # completions words keep their spaces across the splice


async def test_engine_stopped_mid_stream_continues_after_idle_deadline(healthy: Fleet, tap: UpstreamTap) -> None:
    f = healthy
    before = f.metric("tokenfleet_continuations_total", reason="stalled", outcome="continued")
    rid = new_rid("stop")
    tap.at_tokens(rid, 10, f.stop)
    s = await read_stream(f, chat_body("a story told slowly", 150), request_id=rid)
    acted(tap, rid)
    assert_whole(s, 150)
    # the gap the client saw: the idle deadline (detection), then choice and re-prefill
    gap = max(s.gaps)
    assert IDLE_S - 0.1 < gap < IDLE_S + 3, gap
    assert f.metric("tokenfleet_continuations_total", reason="stalled", outcome="continued") == before + 1


async def test_non_streaming_request_continued_with_header(healthy: Fleet, tap: UpstreamTap) -> None:
    f = healthy
    for chat in (True, False):
        body = chat_body("a whole answer please", 200) if chat else completion_body("A whole answer:", 200)
        body.pop("stream_options")
        body["stream"] = False
        # The gateway reads a continuable whole answer from the engine as a stream: the tap sees it.
        rid = kill_at(f, tap, 20)
        async with httpx.AsyncClient(base_url=f.url, headers={"Authorization": f"Bearer {KEY}",
                                                              "X-Request-Id": rid}, timeout=60) as c:
            r = await c.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
        (fired,) = acted(tap, rid)
        killed = fired.instance_id
        assert r.status_code == 200, r.text
        assert r.headers["x-tokenfleet-continued"] == "1"
        assert r.headers["x-tokenfleet-instance"] == killed  # the first leg's; the answer is whole anyway
        out = r.json()
        assert out["object"] == ("chat.completion" if chat else "text_completion")
        text = out["choices"][0]["message"]["content"] if chat else out["choices"][0]["text"]
        assert out["usage"]["completion_tokens"] == 200 and len(text.split()) == 200
        assert out["choices"][0]["finish_reason"] == "length"
        await wait_until(lambda: _ready(f), 60, "the killed engine back", ok=lambda n: n == 4)


# --- limits and honesty ---

async def test_third_failure_ends_with_error_event(healthy: Fleet, tap: UpstreamTap) -> None:
    f = healthy
    before = f.metric("tokenfleet_continuations_total", reason="engine_died", outcome="limit")
    rid = new_rid("thrice")
    # the first leg at its 10th token, then each continuation at its 30th (each leg's own count:
    # a dying leg's last tokens, read after its kill, never kill the next one)
    for leg, n in enumerate((10, 30, 30)):
        tap.at_tokens(rid, n, f.kill, leg=leg)
    s = await read_stream(f, chat_body("a story that keeps losing its engine", 300), request_id=rid)
    killed = [x.instance_id for x in acted(tap, rid, times=3)]
    assert [x.leg for x in tap.fired_for(rid)] == [0, 1, 2]
    assert len(set(killed)) == 3, killed  # each continuation went to an instance that had not failed it
    assert s.events[-1] == "[DONE]" and s.events.count("[DONE]") == 1
    (err,) = s.errors
    assert err["code"] == "upstream_error" and "connection broke mid-stream" in err["message"]
    assert 70 <= s.tokens < 300 and len(s.ids) == 1
    assert f.metric("tokenfleet_continuations_total", reason="engine_died", outcome="limit") == before + 1
    assert f.metric("tokenfleet_continuations_total", reason="engine_died", outcome="continued") >= 2


async def test_a_continuation_re_tokenizes_its_prompt_in_the_apps_tokenizer_pool(
        healthy: Fleet, tap: UpstreamTap, monkeypatch: pytest.MonkeyPatch) -> None:
    """A continuation's tokenizing (the text relayed so far, where the engine gave no ids; the
    prompt again, its ids and block hashes: a long one's milliseconds) runs in the app's bounded
    pool, as a request's does: not on the event loop, not in an unbounded side pool. A full pool refuses it like any other work (`tokenize_failed`): the
    stream ends with an error event, never a hang."""
    f = healthy
    pool = f.ctx.relay.tokenize_pool
    assert pool is f.ctx.tokenize_pool
    ran: list[str] = []
    real = pool.run

    async def spy(fn: Any, *args: Any, **kwargs: Any) -> Any:
        ran.append(getattr(fn, "__name__", repr(fn)))
        return await real(fn, *args, **kwargs)

    monkeypatch.setattr(pool, "run", spy)
    rid = kill_at(f, tap, 20)
    s = await read_stream(f, chat_body("a story told in the tokenizer pool", 300), request_id=rid)
    acted(tap, rid)
    assert_whole(s, 300)
    assert ran == ["tail_ids", "next_leg"]  # (the small request itself was parsed on the loop)

    async def full(fn: Any, *args: Any, **kwargs: Any) -> Any:
        raise overloaded("The gateway's tokenizer pool is full (test)", "tokenizer_busy", 1)

    monkeypatch.setattr(pool, "run", full)
    before = f.metric("tokenfleet_continuations_total", reason="engine_died", outcome="tokenize_failed")
    rid = kill_at(f, tap, 20)
    s = await read_stream(f, chat_body("a story the full pool cannot continue", 300), request_id=rid)
    acted(tap, rid)
    (err,) = s.errors
    assert err["code"] == "upstream_error" and s.events[-1] == "[DONE]" and 20 <= s.tokens < 300
    assert f.metric("tokenfleet_continuations_total", reason="engine_died", outcome="tokenize_failed") == before + 1


@pytest.mark.parametrize(("extra", "label"), [({"logprobs": True, "top_logprobs": 2}, "logprobs"),
                                              ({"n": 2}, "n_gt_1")])
async def test_unfaithful_request_ends_with_error_event_as_before(healthy: Fleet, tap: UpstreamTap,
                                                                  extra: dict[str, Any], label: str) -> None:
    f = healthy
    before = f.metric("tokenfleet_continuations_total", reason="engine_died", outcome=label)
    rid = kill_at(f, tap, 10)
    s = await read_stream(f, chat_body("an answer with extras", 300, **extra), request_id=rid)
    acted(tap, rid)
    (err,) = s.errors
    assert err["code"] == "upstream_error"
    assert s.events[-1] == "[DONE]" and s.tokens < 300 * extra.get("n", 1)
    assert f.metric("tokenfleet_continuations_total", reason="engine_died", outcome=label) == before + 1


async def test_pinned_tenant_is_not_continued_across_sites(healthy: Fleet, tap: UpstreamTap) -> None:
    """The tenant may only run in the EU (one instance there): the continuation would have to leave
    it, and placement, the same as for a first attempt, allows none."""
    f = healthy
    (west,) = f.instances("west")
    before = f.metric("tokenfleet_continuations_total", reason="engine_died", outcome="no_instance")
    east_before = sum(f.metric("tokenfleet_requests_total", instance=i.instance_id) for i in f.instances("east"))
    rid = kill_at(f, tap, 10)
    s = await read_stream(f, chat_body("stay in the EU", 300), key=PINNED_KEY, request_id=rid)
    acted(tap, rid)
    assert s.instance == west.instance_id
    (err,) = s.errors
    assert err["code"] == "upstream_error" and s.events[-1] == "[DONE]"
    assert f.metric("tokenfleet_continuations_total", reason="engine_died", outcome="no_instance") == before + 1
    assert sum(f.metric("tokenfleet_requests_total", instance=i.instance_id) for i in f.instances("east")) \
        == east_before
    tried = [d for d in f.ctx.decisions.last(20) if d["continuation"] == 1 and d["tenant"] == "pinned"]
    assert tried and all(d["instance"] is None for d in tried)


# --- drain migration ---

async def test_drain_moves_streams_that_would_outlive_the_drain_timeout(healthy: Fleet, tap: UpstreamTap) -> None:
    """drain_timeout_s is 2 s here; ~6 ms a token: 40 tokens fit, 600 do not."""
    f = healthy
    before = f.metric("tokenfleet_continuations_total", reason="drained", outcome="continued")
    drained: list[tuple[str, bool]] = []

    def drain_at(n: int) -> str:
        """A request id whose instance is drained once the gateway has read its n-th token: right
        after the relay processed that read (a drain is the gateway's own state, not touched from
        inside its read; the stream is in the relay's live set by then)."""
        def drain(iid: str) -> None:
            asyncio.get_running_loop().call_soon(lambda: drained.append((iid, f.ctx.state.drain(iid))))
        rid = new_rid("drain")
        tap.at_tokens(rid, n, drain)
        return rid

    rid = drain_at(10)
    short = await read_stream(f, chat_body("a short one", 40), request_id=rid)
    acted(tap, rid, cut=False)  # it finishes where it is
    assert drained == [(short.instance, True)], drained
    assert_whole(short, 40)
    assert short.usage is not None and "tokenfleet_continuations" not in short.usage  # finished where it was
    assert f.metric("tokenfleet_continuations_total", reason="drained", outcome="continued") == before
    for st in f.ctx.state.states():
        st.draining = False

    rid = drain_at(20)
    long = await read_stream(f, chat_body("a long one", 600), request_id=rid)
    acted(tap, rid)
    assert drained[1:] == [(long.instance, True)], drained
    assert_whole(long, 600)
    assert long.usage is not None and long.usage["tokenfleet_continuations"] == 1
    assert f.metric("tokenfleet_continuations_total", reason="drained", outcome="continued") == before + 1
    # a drain is not the engine's fault: it stays healthy (only out of rotation)
    st = f.ctx.state.get(long.instance)
    assert st is not None and st.up and st.draining


async def test_client_leaving_during_a_continuation_releases_every_leg(healthy: Fleet, tap: UpstreamTap) -> None:
    f = healthy
    gone_before = f.metric("tokenfleet_requests_total", status="499")
    body = chat_body("a story nobody finishes reading", 2000)
    rid = kill_at(f, tap, 10)
    continued: list[str] = []
    tap.at_tokens(rid, 1, continued.append, leg=1)  # the continuation leg's first token reached the gateway
    tokens = 0
    headers = {"Authorization": f"Bearer {KEY}", "X-Request-Id": rid}
    async with httpx.AsyncClient(base_url=f.url, headers=headers, timeout=60) as c:
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if '"content":"' in line or '"content": "' in line:
                    tokens += 1
                if tokens >= 60 and continued:
                    break  # well into the continuation: the client goes away
    acted(tap, rid, times=2)
    cont = f.metric("tokenfleet_continuations_total", reason="engine_died", outcome="continued")
    assert cont >= 1
    await wait_until(lambda: [st.inflight for st in f.ctx.state.states()], 10, "no dispatch in flight",
                     ok=lambda v: not any(v))
    await wait_until(lambda: len(f.ctx.relay.live), 10, "the stream to leave the live set", ok=lambda n: n == 0)
    await wait_until(lambda: f.metric("tokenfleet_requests_total", status="499"), 10, "the 499 counted",
                     ok=lambda n: n == gone_before + 1)


async def test_client_leaving_while_a_continuation_waits_for_its_first_event_is_a_499(healthy: Fleet,
                                                                                      tap: UpstreamTap) -> None:
    """The client leaves after its engine died and while the continuation leg still waits for its
    first event (every other engine SIGSTOPped: the leg is sent, nothing comes back). That leg was
    once finished as "continuation ended early" with no status, and the first leg as a
    stream_error: a client that left was never counted as gone."""
    f = healthy
    gone_before = f.metric("tokenfleet_requests_total", status="499")
    body = chat_body("a story whose reader leaves during its continuation", 2000)
    rid = new_rid("strand")
    others: list[str] = []

    def strand(iid: str) -> None:
        others.extend(st.instance.instance_id for st in f.ctx.state.states() if st.instance.instance_id != iid)
        for other in others:
            f.stop(other)  # the continuation is sent to one of them and waits there
        f.kill(iid)

    tap.at_tokens(rid, 10, strand)
    try:
        headers = {"Authorization": f"Bearer {KEY}", "X-Request-Id": rid}
        async with httpx.AsyncClient(base_url=f.url, headers=headers, timeout=60) as c:
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    if tap.fired_for(rid):  # the engine is dead, the others stopped: the stream is mid-way
                        acted(tap, rid)
                        await wait_until(lambda: sum(f.ctx.state.get(o).inflight for o in others), 10,
                                         "the continuation leg to be sent", ok=lambda n: n == 1)
                        break  # the client goes away while the continuation waits for its first event
                else:
                    raise AssertionError(f"the stream ended before its 10th token reached the gateway: {tap.fired}")
        await wait_until(lambda: f.metric("tokenfleet_requests_total", status="499"), 10, "the 499 counted",
                         ok=lambda n: n == gone_before + 1)
        await wait_until(lambda: [st.inflight for st in f.ctx.state.states()], 10, "no dispatch in flight",
                         ok=lambda v: not any(v))
        assert not f.ctx.relay.live
    finally:
        f.cont_all()
