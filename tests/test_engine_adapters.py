"""vLLM and SGLang adapters without the real engines: flags, options, process handling
(readiness, crash, graceful stop and kill), attach mode, KV events over ZMQ, metrics mapping.

The engine process is `tests/fake_engine_server.py`, reached through a shim package
on PYTHONPATH so the adapters launch it with their real command lines.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from engine_adapters.base import AdapterError
from engine_adapters.metrics_scrape import parse_metrics
from engine_adapters.registry import build_adapters
from engine_adapters.sglang import SGLangAdapter
from engine_adapters.vllm import VLLMAdapter
from fleetcore.fleet_config import FleetConfigError, parse_fleet
from fleetcore.prefix import block_hashes

FAKE = Path(__file__).with_name("fake_engine_server.py")
FIXTURES = Path(__file__).with_name("fixtures")


def fleet(adapter: str = "vllm", options: dict[str, Any] | None = None, instances: int | None = 2,
          model_extra: dict[str, Any] | None = None, engine: dict[str, Any] | None = None):
    dep: dict[str, Any] = {"site": "s1", "model": "tiny", "adapter": adapter,
                           "options": options if options is not None else {"model": "/models/tiny"}}
    if instances is not None:
        dep["instances"] = instances
    return parse_fleet({
        "sites": [{"name": "s1", "region": "r", "jurisdiction": "j"}],
        "models": [{"name": "tiny", "engine": {"spec": "llama-3.1-8b", "max_model_len": 1024,
                                               "block_size": 32, **(engine or {})},
                    **(model_extra or {})}],
        "deployments": [dep],
    })


def shim(tmp: Path) -> Path:
    """Packages `vllm.entrypoints.openai.api_server` and `sglang.launch_server` that run the fake."""
    run = f"import runpy\nrunpy.run_path({str(FAKE)!r}, run_name='__main__')\n"
    for pkg in ("vllm", "vllm/entrypoints", "vllm/entrypoints/openai", "sglang"):
        (tmp / pkg).mkdir(parents=True, exist_ok=True)
        (tmp / pkg / "__init__.py").write_text("")
    (tmp / "vllm/entrypoints/openai/api_server.py").write_text(run)
    (tmp / "sglang/launch_server.py").write_text(run)
    return tmp


def fake_options(tmp: Path, **extra: Any) -> dict[str, Any]:
    env = {"PYTHONPATH": str(shim(tmp / "shim")), "FAKE_ENGINE_RECORD": str(tmp / "record-{}.json")}
    env.update(extra.pop("env", {}))
    return {"model": str(tmp / "model"), "python": sys.executable, "log_dir": str(tmp / "logs"),
            "ready_timeout_s": 30, "stop_grace_s": 2, "env": env, **extra}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


async def gone(*pids: int, timeout_s: float = 3.0) -> bool:
    """True once none of `pids` runs (a SIGKILL lands asynchronously)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while any(alive(p) for p in pids):
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


# --- flags and options -------------------------------------------------------------------

def test_vllm_flags():
    (a,) = build_adapters(fleet(options={"model": "/models/tiny", "enforce_eager": True,
                                         "num_gpu_blocks_override": 64, "extra_args": ["--seed", "1"]},
                                engine={"gpu_memory_utilization": 0.5}))
    assert isinstance(a, VLLMAdapter) and a.count == 2
    argv = a.engine_argv(8001, a.kv_events_config("tcp://127.0.0.1:5557", "tokenfleet/x"))
    assert argv[:2] == ["-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(argv, argv[1:], strict=False))
    assert flags["--model"] == "/models/tiny" and flags["--served-model-name"] == "tiny"
    assert flags["--port"] == "8001" and flags["--host"] == "127.0.0.1"
    assert flags["--block-size"] == "32" and flags["--max-model-len"] == "1024"
    assert flags["--gpu-memory-utilization"] == "0.5" and flags["--num-gpu-blocks-override"] == "64"
    assert {"--enable-prefix-caching", "--enable-prompt-tokens-details", "--enforce-eager"} <= set(argv)
    assert json.loads(flags["--kv-events-config"]) == {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557",
        "topic": "tokenfleet/x"}
    assert argv[-2:] == ["--seed", "1"]
    assert "--tensor-parallel-size" not in argv
    env = a.engine_env()
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["VLLM_NO_USAGE_STATS"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"


def test_vllm_gpu_memory_utilization_only_when_the_file_says():
    (a,) = build_adapters(fleet())
    assert "--gpu-memory-utilization" not in a.engine_argv(8001, None)
    assert "--kv-events-config" not in a.engine_argv(8001, None)


def test_sglang_flags():
    (a,) = build_adapters(fleet("sglang", {"model": "/models/tiny", "mem_fraction_static": 0.8}, instances=1))
    assert isinstance(a, SGLangAdapter)
    argv = a.engine_argv(9000, a.kv_events_config("tcp://10.0.0.1:5557", "t"))
    flags = dict(zip(argv, argv[1:], strict=False))
    assert argv[:2] == ["-m", "sglang.launch_server"]
    assert flags["--model-path"] == "/models/tiny" and flags["--page-size"] == "32"
    assert flags["--context-length"] == "1024" and flags["--mem-fraction-static"] == "0.8"
    assert {"--enable-metrics", "--enable-cache-report"} <= set(argv)
    assert json.loads(flags["--kv-events-config"]) == {"publisher": "zmq", "endpoint": "tcp://10.0.0.1:5557",
                                                      "topic": "t"}


@pytest.mark.parametrize("options, message", [
    ({}, "either `model`"),
    ({"model": "/m", "urls": ["http://x"]}, "either `model`"),
    ({"model": "/m", "colour": "red"}, "colour: Extra inputs"),
    ({"urls": ["http://a", "http://b"], "kv_topics": ["t"]}, "kv_topics has 1 entries for 2 urls"),
    ({"model": "/m", "ports": [1]}, "1 ports for 2 instances"),
    ({"urls": ["http://a"]}, "instances=2 but 1 urls"),
])
def test_options_errors_name_the_deployment(options, message):
    with pytest.raises(FleetConfigError, match="deployment s1/tiny") as e:
        build_adapters(fleet(options=options))
    assert message in str(e.value)


def test_kv_events_need_the_models_tokenizer(tmp_path):
    """Without a tokenizer the gateway cannot compute matching keys: no subscription (approximate)."""
    (a,) = build_adapters(fleet(options={"model": str(tmp_path)}))
    assert not a.kv_enabled
    make_tokenizer_dir(tmp_path)
    (b,) = build_adapters(fleet(options={"model": str(tmp_path)}))
    assert b.kv_enabled
    (c,) = build_adapters(fleet(options={"model": str(tmp_path), "kv_events": False}))
    assert not c.kv_enabled


def make_tokenizer_dir(d: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {w: i for i, w in enumerate(["<s>", "hello", "world", "the", "fleet"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<s>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    return d


# --- launching (fake engine processes) ------------------------------------------------------

async def test_launch_ready_events_and_graceful_stop(tmp_path):
    model_dir = make_tokenizer_dir(tmp_path / "model")
    opts = fake_options(tmp_path)
    opts["env"]["FAKE_ENGINE_RECORD"] = str(tmp_path / "record.json")
    (a,) = build_adapters(fleet(options=opts, instances=1))
    assert isinstance(a, VLLMAdapter) and a.kv_enabled
    try:
        (inst,) = await a.launch()
        record = json.loads((tmp_path / "record.json").read_text())
        argv = record["argv"]
        assert argv[argv.index("--model") + 1] == str(model_dir)
        assert record["env"]["HF_HUB_OFFLINE"] == "1"
        assert record["pgid"] == record["pid"]  # its own process group
        snap = await a.snapshot(inst)
        assert snap.ready and snap.block_size == 32 and snap.kv_usage == 0.25
        # The engine's KV events arrive, translated to the keys the gateway computes.
        stream = a.kv_events(inst)
        assert stream is not None
        ids = list(range(1, 70))
        translator = a.kv_translator(inst)
        assert translator is not None
        async with aiohttp.ClientSession() as s:
            for _ in range(50):  # the engine's PUB connects asynchronously; retry until heard
                async with s.post(f"{inst.url}/v1/completions", json={"prompt_token_ids": ids}) as r:
                    assert r.status == 200
                await asyncio.sleep(0.1)
                if translator.stats.batches:
                    break
            else:
                raise AssertionError("no KV events arrived")
        batch = await asyncio.wait_for(stream.__anext__(), 5)
        assert batch.instance_id == inst.instance_id
        assert batch.events[0]["block_hashes"] == block_hashes(ids, 32)
        assert translator.our_hashes() == set(block_hashes(ids, 32))
        assert (a.log_path(inst) or Path()).is_file()
    finally:
        await a.stop()
    assert await gone(record["pid"], record["helper_pid"])
    assert a.kv_events(inst) is None


async def test_engine_that_exits_before_ready_fails_the_launch_with_its_log(tmp_path):
    opts = fake_options(tmp_path, env={"FAKE_ENGINE_MODE": "crash"})
    (a,) = build_adapters(fleet(options=opts, instances=2))
    with pytest.raises(AdapterError, match=r"exited with code 3 before it was ready(?s:.*)CUDA out of memory"):
        await a.launch()
    assert a.instances == []


@pytest.mark.slow
async def test_engine_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    opts = fake_options(tmp_path, env={"FAKE_ENGINE_MODE": "ignore_term"}, stop_grace_s=0.5)
    opts["env"]["FAKE_ENGINE_RECORD"] = str(tmp_path / "record.json")
    (a,) = build_adapters(fleet(options=opts, instances=1))
    await a.launch()
    record = json.loads((tmp_path / "record.json").read_text())
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await a.stop()
    assert 0.4 < loop.time() - t0 < 5
    assert await gone(record["pid"], record["helper_pid"])


@pytest.mark.slow
async def test_launch_timeout_names_the_instance_and_stops_it(tmp_path):
    # long enough for the fake engine to start and write its record on a loaded 2-core machine
    opts = fake_options(tmp_path, ready_timeout_s=4, env={"FAKE_ENGINE_MODE": "hang"})
    opts["env"]["FAKE_ENGINE_RECORD"] = str(tmp_path / "record.json")
    (a,) = build_adapters(fleet(options=opts, instances=1))
    with pytest.raises(AdapterError, match="s1/tiny/0: not ready after 4 s"):
        await a.launch()
    record = json.loads((tmp_path / "record.json").read_text())
    assert await gone(record["pid"], record["helper_pid"])


@pytest.mark.slow
async def test_launched_deployment_adds_and_removes_engines(tmp_path):
    """FleetMind's planner scales a launch-mode deployment: a new engine is returned before it is
    ready (the gateway's poller admits it later); a removed one is stopped with its helpers."""
    make_tokenizer_dir(tmp_path / "model")
    (a,) = build_adapters(fleet(options=fake_options(tmp_path), instances=1))
    assert a.scalable
    try:
        (first,) = await a.launch()
        added = await a.add_instance()
        assert added.instance_id == "s1/tiny/1" and added.url != first.url
        for _ in range(100):
            if await a.health(added):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the added engine never became healthy")
        proc = a.process(first)
        assert proc is not None
        assert a.subscriber is not None and a.subscriber.has(first.instance_id)
        await a.remove_instance(first)
        assert proc.returncode is not None and [i.instance_id for i in a.instances] == ["s1/tiny/1"]
        assert not a.subscriber.has(first.instance_id)  # its KV hash map is not kept for ever
        assert (await a.add_instance()).instance_id == "s1/tiny/2"  # ids are never reused
    finally:
        await a.stop()
    attached = build_adapters(fleet(options={"urls": ["http://127.0.0.1:9"]}, instances=1))[0]
    assert not attached.scalable
    with pytest.raises(AdapterError, match="cannot be scaled"):
        await attached.add_instance()


async def test_missing_engine_package_is_reported(tmp_path):
    opts = fake_options(tmp_path, env={"PYTHONPATH": str(tmp_path / "empty")})
    (a,) = build_adapters(fleet(options=opts, instances=1))
    with pytest.raises(AdapterError, match=r"s1/tiny/0: engine exited with code 1(?s:.*)No module named"):
        await a.launch()


async def test_attach_mode_watches_urls_and_subscribes_to_given_topics(tmp_path, stub_upstream):
    make_tokenizer_dir(tmp_path / "tok")
    stub = await stub_upstream()
    cfg = fleet(options={"urls": [stub.url + "/"], "kv_topics": ["engine-a"],
                         "kv_events_bind": "tcp://127.0.0.1:*"},
                instances=None, model_extra={"tokenizer": str(tmp_path / "tok")})
    (a,) = build_adapters(cfg)
    (inst,) = await a.launch()
    try:
        assert inst.url == stub.url and inst.instance_id == "s1/tiny/0"
        assert await a.health(inst)
        assert a.kv_events(inst) is not None and a.subscriber is not None
        assert a.subscriber.endpoint.startswith("tcp://127.0.0.1:")
    finally:
        await a.stop()
    assert await a.health(inst)  # attached engines keep running


# --- metrics mapping -----------------------------------------------------------------------

def test_vllm_metrics_recorded_from_a_real_engine():
    snap = parse_metrics((FIXTURES / "vllm_0.32_metrics.txt").read_text())
    assert snap.ready and snap.block_size == 32
    assert (snap.num_running, snap.num_waiting) == (1, 2)
    assert snap.kv_usage == pytest.approx(0.1875)
    assert snap.prefix_cache_queries == 1234.0 and snap.prefix_cache_hits == 576.0


def test_sglang_metrics_map_onto_the_same_fields():
    snap = parse_metrics((FIXTURES / "sglang_metrics.txt").read_text())
    # Two DP-attention ranks: requests add up, usage is the fuller rank's.
    assert (snap.num_running, snap.num_waiting) == (12, 3)
    assert snap.kv_usage == pytest.approx(0.41)
    assert snap.prefix_cache_queries == 8128902.0 and snap.prefix_cache_hits == 3120451.0
    assert snap.block_size is None  # SGLang does not publish its page size; the fleet file's stands


def test_a_page_read_before_is_not_parsed_again_and_a_changed_one_is():
    """An idle engine's page is the same at every poll: its snapshot is reused (same object, same
    figures); a page whose load lines differ is parsed anew, one with only other lines changed is not."""
    import engine_adapters.metrics_scrape as ms

    text = (FIXTURES / "vllm_0.32_metrics.txt").read_text()
    first = parse_metrics(text)
    again = parse_metrics(text + "# HELP some_other_metric changes nothing read\nsome_other_metric 7\n")
    assert again is first
    changed = parse_metrics(text.replace("vllm:num_requests_waiting{", "vllm:num_requests_waiting{x=\"1\",", 1)
                            + 'vllm:num_requests_waiting{model_name="m2"} 5.0\n')
    assert changed is not first and changed.num_waiting == first.num_waiting + 5
    assert len(ms._parsed) <= ms._PARSED_MAX
    for i in range(ms._PARSED_MAX + 10):  # bounded: the oldest go first
        parse_metrics(f"vllm:num_requests_running {i}\n")
    assert len(ms._parsed) == ms._PARSED_MAX
    assert parse_metrics("vllm:num_requests_running 3\n").num_running == 3


@pytest.mark.parametrize("chunked", [False, True])
async def test_an_oversized_metrics_page_is_a_failed_scrape(chunked: bool) -> None:
    """An endpoint whose /metrics page runs past MAX_METRICS_BYTES (a bug, or not an engine) is not
    read whole into the gateway's memory: the scrape fails (not ready), as a non-200 one does. It
    was read to the end (`r.text()`) and parsed as a ready engine."""
    from aiohttp import web

    from engine_adapters.base import Instance
    from engine_adapters.http_engine import MAX_METRICS_BYTES, HttpEngineAdapter

    page = b"vllm:num_requests_running 1\n" + b"# padding" + b"x" * 1000 + b"\n"
    big = page * (MAX_METRICS_BYTES // len(page) + 2)

    async def metrics(request: web.Request) -> web.StreamResponse:
        if not chunked:
            return web.Response(body=big, content_type="text/plain")
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for i in range(0, len(big), 1 << 20):
            await resp.write(big[i:i + (1 << 20)])
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    class Scraper(HttpEngineAdapter):
        @property
        def instances(self) -> list[Instance]:
            return []

        async def launch(self) -> list[Instance]:
            return []

        async def stop(self) -> None:
            await self.close_http()

    a = Scraper()
    try:
        inst = Instance("i0", "s", "m", "v1", f"http://127.0.0.1:{port}", "vllm")
        snap = await asyncio.wait_for(a.snapshot(inst), 30)
        assert not snap.ready
    finally:
        await a.close_http()
        await runner.cleanup()
