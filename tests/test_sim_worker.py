"""The live simulated worker over real sockets: OpenAI shapes, caching, abort, KV events, probes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from engine_adapters.sim.driver import EngineDriver
from engine_adapters.sim.engine import EngineConfig, SimEngine
from engine_adapters.sim.openai_wire import ApiError, plan_output
from engine_adapters.sim.worker import WORKER_KEY, start_worker
from fleetcore import hardware
from fleetcore.prefix import block_hashes
from fleetcore.tokens import encode
from tests.waits import wait_until

MODEL = "sim-llama"
SCALE = 0.02  # 50x faster than the physical GPU
REPO = Path(__file__).resolve().parents[1]


def long_prompt(words: int = 2000, salt: str = "") -> str:
    return salt + " ".join(f"w{i % 97}x" for i in range(words))


@pytest.fixture
async def worker() -> AsyncIterator[str]:
    runner, url = await start_worker(served_model_name=MODEL, time_scale=SCALE, instance_id="w-test")
    try:
        yield url
    finally:
        await runner.cleanup()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        yield s


async def post(http: aiohttp.ClientSession, url: str, body: Any, **kw: Any) -> tuple[int, Any]:
    async with http.post(url, json=body, **kw) as r:
        return r.status, await r.json(content_type=None)


async def sse_events(resp: aiohttp.ClientResponse) -> list[Any]:
    out: list[Any] = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line:
            continue
        assert line.startswith("data: ")
        data = line[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def metric(http: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    async with http.get(f"{url}/metrics") as r:
        text = await r.text()
    want = {"model_name": MODEL, **labels}
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        lbl = dict(p.split("=", 1) for p in line[len(name) + 1:line.index("}")].split(","))
        if all(lbl.get(k) == f'"{v}"' for k, v in want.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{labels} not in /metrics")


def assert_usage(u: dict[str, Any], prompt: int | None = None) -> None:
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert isinstance(u["prompt_tokens_details"]["cached_tokens"], int)
    if prompt is not None:
        assert u["prompt_tokens"] == prompt


# -- OpenAI shapes ----------------------------------------------------------------------


async def test_chat_non_stream_shape(worker: str, http: aiohttp.ClientSession) -> None:
    st, body = await post(http, f"{worker}/v1/chat/completions",
                          {"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 8})
    assert st == 200
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == MODEL and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
    n = body["usage"]["completion_tokens"]
    assert 1 <= n <= 8 and len(choice["message"]["content"].split()) == n  # one word per token
    assert_usage(body["usage"])


async def test_completion_prompt_forms(worker: str, http: aiohttp.ClientSession) -> None:
    for prompt, n_prompt in (("one two three", 3), (["one two three"], 3), ([5, 6, 7, 8], 4)):
        st, body = await post(http, f"{worker}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4,
                                                                  "ignore_eos": True})
        assert st == 200, body
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        assert body["choices"][0]["finish_reason"] == "length" and len(body["choices"][0]["text"].split()) == 4
        assert_usage(body["usage"], n_prompt)


async def test_chat_stream_with_usage(worker: str, http: aiohttp.ClientSession) -> None:
    req = {"model": MODEL, "messages": [{"role": "user", "content": "stream me"}], "max_tokens": 5,
           "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(f"{worker}/v1/chat/completions", json=req) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        ev = await sse_events(r)
    assert ev[-1] == "[DONE]"
    chunks = ev[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = [c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]]
    assert len([t for t in content if t]) == 5
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finish] == ["length"]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 5
    assert all(c["usage"] is None for c in chunks[:-1])
    # Streaming and non-streaming write the same text.
    _, full = await post(http, f"{worker}/v1/chat/completions", {**req, "stream": False, "stream_options": None})
    assert "".join(content) == full["choices"][0]["message"]["content"]


async def test_completion_stream_without_usage(worker: str, http: aiohttp.ClientSession) -> None:
    req = {"model": MODEL, "prompt": "count", "max_tokens": 3, "ignore_eos": True, "stream": True}
    async with http.post(f"{worker}/v1/completions", json=req) as r:
        ev = await sse_events(r)
    assert ev[-1] == "[DONE]"
    assert all(c["object"] == "text_completion" and "usage" not in c for c in ev[:-1])
    assert "".join(c["choices"][0]["text"] for c in ev[:-1]).count(" ") == 3
    assert ev[-2]["choices"][0]["finish_reason"] == "length"


async def test_openai_sdk_parses_responses(worker: str) -> None:
    import openai
    client = openai.AsyncOpenAI(base_url=f"{worker}/v1", api_key="x")
    try:
        r = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "sdk"}],
                                                 max_tokens=4)
        assert r.usage is not None and r.usage.prompt_tokens_details.cached_tokens == 0
        stream = await client.completions.create(model=MODEL, prompt="sdk", max_tokens=3, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    finally:
        await client.close()


# -- behaviour ----------------------------------------------------------------------------


async def test_output_is_deterministic_in_the_prompt(worker: str, http: aiohttp.ClientSession) -> None:
    async def text(prompt: str) -> str:
        st, body = await post(http, f"{worker}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 12})
        assert st == 200
        return body["choices"][0]["text"]

    a, b, c = await asyncio.gather(text("same prompt"), text("same prompt"), text("other prompt"))
    assert a == b and a != c


def test_plan_output_stop_length_min_tokens() -> None:
    ids = encode("a prompt of a few tokens")
    natural = plan_output(ids, 4096)
    assert natural.finish_reason == "stop" and 16 <= natural.output_len <= 272
    assert plan_output(ids, 4096, max_tokens=natural.output_len) == natural  # EOS exactly at the cap: stop
    short = plan_output(ids, 4096, max_tokens=natural.output_len - 1)
    assert (short.output_len, short.finish_reason) == (natural.output_len - 1, "length")
    forced = plan_output(ids, 4096, max_tokens=1000, ignore_eos=True)
    assert (forced.output_len, forced.finish_reason) == (1000, "length")
    longer = plan_output(ids, 4096, max_tokens=1000, min_tokens=500)
    assert (longer.output_len, longer.finish_reason) == (500, "stop")
    capped = plan_output(ids, 64, ignore_eos=True)  # no max_tokens: the context is the cap
    assert capped.output_len == 64 - len(ids)
    with pytest.raises(ApiError):
        plan_output(ids, 64, max_tokens=64)


async def test_prefix_cache_hit_on_repeat(worker: str, http: aiohttp.ClientSession) -> None:
    prompt = long_prompt()
    n_prompt = len(encode(prompt))
    assert n_prompt >= 2000
    req = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    hits0 = await metric(http, worker, "vllm:prefix_cache_hits_total")
    _, first = await post(http, f"{worker}/v1/completions", req)
    _, second = await post(http, f"{worker}/v1/completions", req)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % 16 == 0 and cached >= n_prompt - 32
    assert await metric(http, worker, "vllm:prefix_cache_hits_total") >= hits0 + cached
    assert await metric(http, worker, "vllm:prompt_tokens_total") == 2 * n_prompt
    # After a reset nothing is cached any more.
    async with http.post(f"{worker}/reset_prefix_cache") as r:
        assert r.status == 200
    _, third = await post(http, f"{worker}/v1/completions", req)
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def _wait_metric(http: aiohttp.ClientSession, url: str, name: str, want: float, timeout: float = 5.0,
                       **labels: str) -> float:
    """The worker's gauges follow its scheduler, not our reads: wait for `name` to read `want`."""
    return await wait_until(lambda: metric(http, url, name, **labels), timeout, f"{name}{labels} == {want}",
                            ok=lambda v: v == want)


async def test_client_disconnect_aborts_engine_request(worker: str, http: aiohttp.ClientSession) -> None:
    req = {"model": MODEL, "prompt": "a very long answer please", "max_tokens": 20000, "ignore_eos": True,
           "stream": True}
    async with aiohttp.ClientSession() as other:
        resp = await other.post(f"{worker}/v1/completions", json=req)
        assert resp.status == 200
        got = 0
        async for raw in resp.content:
            got += raw.startswith(b"data: ")
            if got >= 3:
                break
        assert await _wait_metric(http, worker, "vllm:num_requests_running", 1) == 1
        resp.close()  # drop the connection mid-stream
    assert await _wait_metric(http, worker, "vllm:num_requests_running", 0) == 0
    assert await _wait_metric(http, worker, "vllm:request_success_total", 1, finished_reason="abort") == 1


async def test_abort_request_endpoint_and_request_id_header(worker: str, http: aiohttp.ClientSession) -> None:
    req = {"model": MODEL, "messages": [{"role": "user", "content": "long"}], "max_tokens": 20000,
           "ignore_eos": True, "stream": True}
    async with http.post(f"{worker}/v1/chat/completions", json=req, headers={"X-Request-Id": "rid-42"}) as r:
        assert r.headers["X-Request-Id"] == "rid-42"
        first = await r.content.readline()
        assert json.loads(first[len(b"data: "):])["id"] == "chatcmpl-rid-42"
        st, body = await post(http, f"{worker}/abort_request", {"rid": "rid-42"})
        assert st == 200 and body["success"] is True
        rest = await asyncio.wait_for(r.content.read(), 5)  # the stream ends promptly
    events = [json.loads(x[len(b"data: "):]) for x in rest.split(b"\n\n") if x.startswith(b"data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "abort" and rest.endswith(b"data: [DONE]\n\n")
    assert await _wait_metric(http, worker, "vllm:num_requests_running", 0) == 0


async def test_kv_events_feed_reports_stored_blocks(worker: str, http: aiohttp.ClientSession) -> None:
    prompt = long_prompt(200, salt="kv ")
    expected = block_hashes(encode(prompt), 16)
    async with http.get(f"{worker}/kv_events") as feed:
        assert feed.status == 200
        st, _ = await post(http, f"{worker}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
        assert st == 200
        stored: list[int] = []
        seqs: list[int] = []
        while len(stored) < len(expected):
            line = await asyncio.wait_for(feed.content.readline(), 5)
            batch = json.loads(line)
            seqs.append(batch["seq"])
            assert isinstance(batch["ts"], float)
            for ev in batch["events"]:
                if ev["type"] == "BlockStored":
                    assert ev["block_size"] == 16 and ev["medium"] == "GPU"
                    assert ev["parent_block_hash"] == (stored[-1] if stored else None)
                    stored += ev["block_hashes"]
    assert seqs[0] == 0 and seqs == sorted(seqs)
    assert stored == expected  # the same chained hashes the gateway computes


async def test_kv_subscriber_drops_oldest_with_gap_flag() -> None:
    engine = SimEngine(EngineConfig(hardware.model("llama-3.1-8b"), hardware.gpu("H100"),
                                    num_gpu_blocks_override=512))
    driver = EngineDriver(engine, time_scale=0.001)
    driver.start()
    sub = driver.subscribe_kv(maxsize=2)
    try:
        for i in range(5):
            ids = encode(long_prompt(40, salt=f"p{i} "))
            async for _ in driver.submit(f"r{i}", len(ids), block_hashes(ids, 16), 1):
                pass
        first = await sub.get()
        assert first.gap and sub.dropped >= 1  # the engine never waited for us
        assert first.seq >= 1
    finally:
        await driver.stop()


async def test_a_step_delivered_late_is_counted_in_wall_seconds() -> None:
    """The loop held 0.15 s while a step of a few ms runs (a host whose cores are busy): its tokens go
    out ~0.14 s after the moment its engine time maps to, which the driver counts (`DriverStats.late_s`,
    `late_max_s`) and /metrics exports, so a live benchmark can say how much of a TTFT was the host's."""
    from engine_adapters.sim.metrics import SimMetrics

    engine = SimEngine(EngineConfig(hardware.model("llama-3.1-8b"), hardware.gpu("H100"),
                                    num_gpu_blocks_override=512))
    driver = EngineDriver(engine, time_scale=1.0)  # real time: this step takes ~10 ms
    driver.start()
    try:
        ids = encode(long_prompt(40, salt="late "))
        stream = driver.submit("late", len(ids), block_hashes(ids, 16), 2)
        await asyncio.sleep(0)  # the driver takes the step and sleeps until its end
        time.sleep(0.15)  # noqa: ASYNC251  (the point: the loop is blocked past the step's end)
        async for _ in stream:
            pass
    finally:
        await driver.stop()
    assert driver.stats.late_max_s >= 0.1, driver.stats
    assert driver.stats.late_s >= driver.stats.late_max_s and driver.stats.steps >= 2
    m = SimMetrics(MODEL, 16, 512)
    m.refresh_driver(driver.stats)
    text = m.render(engine).decode()
    assert f'tokenfleet_sim:step_late_seconds_total{{model_name="{MODEL}"}} {driver.stats.late_s}' in text
    assert f'tokenfleet_sim:steps_total{{model_name="{MODEL}"}} {float(driver.stats.steps)}' in text


# -- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/chat/completions", b"{not json", 400),
        ("/v1/completions", b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),  # (was a 500)
        ("/v1/chat/completions", {"model": MODEL}, 400),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400),
        ("/v1/completions", {"model": MODEL}, 400),
        ("/v1/completions", {"model": "nope", "prompt": "x"}, 404),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10_000_000}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 129}, 400),
            ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400),
            ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400),
    ],
)
async def test_error_bodies(worker: str, http: aiohttp.ClientSession, path: str, body: Any, status: int) -> None:
    kw = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with http.post(f"{worker}{path}", **kw) as r:
        assert r.status == status
        err = (await r.json())["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["message"]


async def test_context_length_error_names_the_limit(http: aiohttp.ClientSession) -> None:
    runner, url = await start_worker(served_model_name=MODEL, time_scale=SCALE, max_model_len=256)
    try:
        st, body = await post(http, f"{url}/v1/completions",
                              {"model": MODEL, "prompt": long_prompt(200), "max_tokens": 100})
        assert st == 400 and "maximum context length is 256" in body["error"]["message"]
        st, body = await post(http, f"{url}/v1/completions", {"model": MODEL, "prompt": long_prompt(300)})
        assert st == 400
    finally:
        await runner.cleanup()


# -- probes for peer routers -------------------------------------------------------------------


async def test_probe_endpoints(worker: str, http: aiohttp.ClientSession) -> None:
    for path in ("/health", "/health_generate", "/v1/models", "/version", "/server_info", "/get_server_info",
                 "/model_info", "/get_model_info", "/get_load", "/v1/loads", "/metrics"):
        async with http.get(f"{worker}{path}") as r:
            assert r.status == 200, path
    async with http.get(f"{worker}/v1/models") as r:
        assert (await r.json())["data"][0]["id"] == MODEL
    async with http.get(f"{worker}/get_model_info") as r:
        info = await r.json()
        assert info["model_path"] == MODEL and info["is_generation"] is True
    async with http.get(f"{worker}/get_load") as r:
        assert (await r.json()) == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    async with http.get(f"{worker}/get_server_info") as r:
        si = await r.json()
        assert si["instance_id"] == "w-test" and si["page_size"] == 16
    async with http.post(f"{worker}/flush_cache") as r:
        assert r.status == 200


async def test_tokenize_and_render_depend_on_content(worker: str, http: aiohttp.ClientSession) -> None:
    _, a = await post(http, f"{worker}/tokenize", {"model": MODEL, "prompt": "alpha beta"})
    _, b = await post(http, f"{worker}/tokenize", {"model": MODEL, "prompt": "gamma delta"})
    assert a["count"] == 2 and a["tokens"] == encode("alpha beta") and a["tokens"] != b["tokens"]
    st, rc = await post(http, f"{worker}/v1/completions/render", {"model": MODEL, "prompt": "alpha beta"})
    assert st == 200 and rc[0]["token_ids"] == encode("alpha beta")
    msgs = [{"role": "user", "content": "alpha"}]
    st, rch = await post(http, f"{worker}/v1/chat/completions/render", {"model": MODEL, "messages": msgs})
    _, rch2 = await post(http, f"{worker}/v1/chat/completions/render",
                         {"model": MODEL, "messages": [{"role": "user", "content": "beta"}]})
    assert st == 200 and rch["token_ids"] != rch2["token_ids"]


async def test_sglang_generate(worker: str, http: aiohttp.ClientSession) -> None:
    req = {"text": "native api", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    st, body = await post(http, f"{worker}/generate", req)
    assert st == 200 and len(body["text"].split()) == 4
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert body["meta_info"]["prompt_tokens"] == 2 and body["meta_info"]["completion_tokens"] == 4
    async with http.post(f"{worker}/generate", json={**req, "stream": True}) as r:
        ev = await sse_events(r)
    assert ev[-1] == "[DONE]" and ev[-2]["text"] == body["text"]  # cumulative text, as SGLang streams


# -- the process -----------------------------------------------------------------------------------


def test_worker_process_ready_line_health_and_sigterm() -> None:
    cmd = [sys.executable, "-m", "engine_adapters.sim.worker", "--served-model-name", MODEL, "--port", "0",
           "--time-scale", "0.02", "--instance-id", "proc-1", "--num-gpu-blocks-override", "1024"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        ready = json.loads(line)
        assert ready["event"] == "ready" and ready["instance_id"] == "proc-1"
        assert ready["url"] == f"http://127.0.0.1:{ready['port']}"

        async def probe() -> int:
            async with aiohttp.ClientSession() as s, s.get(f"{ready['url']}/health") as r:
                return r.status

        assert asyncio.run(probe()) == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert proc.stdout.read() == ""  # type: ignore[union-attr]  # exactly one stdout line
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_in_process_worker_exposes_itself(http: aiohttp.ClientSession) -> None:
    runner, url = await start_worker(served_model_name=MODEL, time_scale=SCALE)
    try:
        w = runner.app[WORKER_KEY]
        assert w.driver.alive and url.startswith("http://127.0.0.1:")
    finally:
        await runner.cleanup()
    assert not w.driver.alive


async def test_startup_delay_and_emulated_network_rtt() -> None:
    """A worker that is still loading answers 503 (health and generation); an emulated RTT
    delays every answer by one round trip."""
    started = time.monotonic()
    runner, url = await start_worker(served_model_name=MODEL, time_scale=SCALE, startup_s=0.6,
                                     network_rtt_ms=80)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    try:
        async with aiohttp.ClientSession() as s:
            t0 = time.monotonic()
            async with s.get(f"{url}/health") as r:
                assert r.status == 503 and "loading" in await r.text()
            assert time.monotonic() - t0 >= 0.08
            async with s.post(f"{url}/v1/completions", json=body) as r:
                assert r.status == 503
                assert (await r.json())["error"]["type"] == "ServiceUnavailableError"
            async def health() -> int:
                async with s.get(f"{url}/health") as r:
                    return r.status

            await wait_until(health, 10, "the worker to finish loading (GET /health 200)", ok=lambda st: st == 200)
            assert time.monotonic() - started >= 0.6  # not before its startup delay
            t0 = time.monotonic()
            async with s.post(f"{url}/v1/completions", json=body) as r:
                assert r.status == 200
            assert time.monotonic() - t0 >= 0.08
    finally:
        await runner.cleanup()


@pytest.mark.slow
async def test_sim_adapter_adds_a_loading_instance_and_removes_one() -> None:
    from engine_adapters.sim.launcher import SimAdapter

    adapter = SimAdapter(id_prefix="s/m", site="s", model=MODEL, version="v1", instances=1, spec="llama-3.1-8b",
                         gpu="H100", options={"time_scale": SCALE, "startup_s": 0.5})
    assert adapter.scalable
    try:
        (first,) = await adapter.launch()
        assert await adapter.health(first)  # the fleet's own instances are up when launch returns
        added = await adapter.add_instance()
        assert added.instance_id == "s/m/1" and [i.instance_id for i in adapter.instances] == ["s/m/0", "s/m/1"]
        assert not await adapter.health(added)  # still loading
        await wait_until(lambda: adapter.health(added), 10, f"{added.instance_id} to finish loading")
        proc = adapter.process(first)
        assert proc is not None
        await adapter.remove_instance(first)
        assert proc.returncode is not None
        assert [i.instance_id for i in adapter.instances] == ["s/m/1"]
    finally:
        await adapter.stop()
