"""Supervision of real-engine adapters in launch mode (vLLM here; SGLang shares the code), with
the fake engine process of tests/test_engine_adapters.py: a SIGKILLed engine is started again
on its port after the backoff, the dead one's helper processes do not linger, and the KV event
stream the gateway was following carries the new engine's events."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import Any

import aiohttp
import pytest

from engine_adapters.registry import build_adapters
from fleetcore.prefix import block_hashes
from tests.test_engine_adapters import fake_options, fleet, gone, make_tokenizer_dir


def with_backoff(config: Any, first_s: float, max_s: float) -> Any:
    g = config.gateway.model_copy(update={"engine_restart_backoff_s": first_s,
                                          "engine_restart_backoff_max_s": max_s})
    return config.model_copy(update={"gateway": g})


@pytest.mark.slow
async def test_launched_engine_is_restarted_on_its_port_and_keeps_its_kv_stream(tmp_path):
    make_tokenizer_dir(tmp_path / "model")
    opts = fake_options(tmp_path)
    record = tmp_path / "record.json"
    opts["env"]["FAKE_ENGINE_RECORD"] = str(record)
    (a,) = build_adapters(with_backoff(fleet(options=opts, instances=1), 0.3, 1.0))
    second: dict[str, Any] = {}
    try:
        (inst,) = await a.launch()
        first = json.loads(record.read_text())
        stream = a.kv_events(inst)
        assert stream is not None
        # The gateway's follower is waiting on this stream when the engine dies.
        follower = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        os.kill(first["pid"], signal.SIGKILL)
        killed = time.monotonic()
        deadline = killed + 30
        while True:
            assert time.monotonic() < deadline, "the engine was not restarted"
            if a.restart_counts().get(inst.instance_id) == 1 and await a.health(inst):
                break
            await asyncio.sleep(0.05)
        assert time.monotonic() - killed >= 0.3  # it waited its backoff
        second = json.loads(record.read_text())
        assert second["pid"] != first["pid"] and [i.url for i in a.instances] == [inst.url]
        assert await gone(first["helper_pid"])  # the dead leader's helper was killed with its group
        # The restarted engine publishes on the same channel; its map of hashes starts empty.
        ids = list(range(1, 70))
        translator = a.kv_translator(inst)
        assert translator is not None and len(translator) == 0
        async with aiohttp.ClientSession() as s:
            for _ in range(50):  # the engine's PUB connects asynchronously; retry until heard
                async with s.post(f"{inst.url}/v1/completions", json={"prompt_token_ids": ids}) as r:
                    assert r.status == 200
                await asyncio.sleep(0.1)
                if translator.stats.batches:
                    break
            else:
                raise AssertionError("no KV events from the restarted engine")
        batch = await asyncio.wait_for(follower, 5)
        assert batch.events[0]["block_hashes"] == block_hashes(ids, 32)
    finally:
        await a.stop()
    assert second and await gone(second["pid"], second["helper_pid"])
    assert a.restart_counts() == {inst.instance_id: 1}  # stop was not taken for a crash

