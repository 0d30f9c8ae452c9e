"""The sim worker's P/D legs in-process (engine_adapters.sim.pd): both published protocols'
fields, the KV pull timed by the link model, and the timeouts that keep either side from
holding KV for a partner that never comes."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from engine_adapters.sim.worker import start_worker
from fleetcore import hardware
from fleetcore.interconnect import Link, kv_bytes
from tests.waits import wait_until

pytestmark = pytest.mark.asyncio

GB_S = 1.0  # a slow link, so that the transfer's modelled time is plain to see


@pytest_asyncio.fixture
async def pair() -> AsyncIterator[tuple[str, str, Any]]:
    common = dict(served_model_name="m", time_scale=1.0, kv_link_gb_s=GB_S, kv_link_latency_ms=1.0,
                  pd_wait_timeout_s=3.0, pd_hold_timeout_s=1.0)
    rp, up = await start_worker(pd_role="prefill", **common)
    rd, ud = await start_worker(pd_role="decode", **common)
    async with aiohttp.ClientSession() as s:
        yield up, ud, s
    await rp.cleanup()
    await rd.cleanup()


def prompt(words: int = 1500) -> str:
    n = random.getrandbits(32)
    return " ".join(f"p{n}-{i}" for i in range(words))


async def state(s: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with s.get(url + "/pd/state") as r:
        return await r.json()


def empty(st: dict[str, Any]) -> bool:
    return st["rooms"] == 0 and st["engine_held"] == 0 and st["engine_receiving"] == 0 and st["kv_usage"] == 0


def sglang_body(up: str, text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": text, "max_tokens": 16, "ignore_eos": True, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": int(up.rsplit(":", 1)[1]), "bootstrap_room": random.getrandbits(63), **extra}


@pytest.mark.slow
async def test_sglang_legs_concurrent_usage_and_modelled_transfer(pair: Any) -> None:
    up, ud, s = pair
    body = sglang_body(up, prompt())

    async def leg(url: str) -> tuple[int, dict[str, Any], float]:
        t = time.monotonic()
        async with s.post(url + "/v1/completions", json=body) as r:
            return r.status, await r.json(), time.monotonic() - t
    (ps, pb, _), (ds, db, d_wall) = await asyncio.gather(leg(up), leg(ud))
    assert ps == 200 and pb["usage"]["completion_tokens"] == 1  # the prefill leg makes the first token only
    assert ds == 200 and db["usage"]["completion_tokens"] == 16
    n = db["usage"]["prompt_tokens"]
    assert pb["usage"]["prompt_tokens"] == n and db["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # the KV crossed the 1 GB/s link: the decode leg took at least that long
    xfer = Link(GB_S * 1e9, 0.001).transfer_s(kv_bytes(hardware.model("llama-3.1-8b"), n))
    assert xfer > 0.3 and d_wall >= xfer
    assert (await state(s, up))["transfers"] == 1
    assert empty(await state(s, up)) and empty(await state(s, ud))


async def test_vllm_prefill_answers_nixl_fields_and_decode_reads_them(pair: Any) -> None:
    up, ud, s = pair
    text = prompt(400)
    async with s.post(up + "/v1/completions", json={
            "model": "m", "prompt": text, "max_tokens": 1, "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                   "remote_block_ids": None, "remote_host": None, "remote_port": None}}) as r:
        assert r.status == 200
        params = (await r.json())["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_host"] == "127.0.0.1" and params["remote_port"] == int(up.rsplit(":", 1)[1])
    assert params["remote_engine_id"] == (await state(s, up))["instance_id"] and params["tp_size"] == 1
    assert len(params["remote_block_ids"]) >= 1 and isinstance(params["remote_request_id"], str)
    assert (await state(s, up))["engine_held"] == 1  # held for the decode side
    async with s.post(ud + "/v1/completions", json={"model": "m", "prompt": text, "max_tokens": 8,
                                                    "ignore_eos": True, "kv_transfer_params": params}) as r:
        assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 8
    assert empty(await state(s, up)) and empty(await state(s, ud))
    # a second read of the same KV hears it is gone, at once
    async with s.post(ud + "/v1/completions", json={"model": "m", "prompt": text, "max_tokens": 8,
                                                    "kv_transfer_params": params}) as r:
        assert r.status == 503 and "KV transfer" in (await r.json())["error"]["message"]
    assert empty(await state(s, ud))


@pytest.mark.slow
async def test_decode_gives_up_a_room_that_never_comes(pair: Any) -> None:
    up, ud, s = pair
    t = time.monotonic()
    async with s.post(ud + "/v1/completions", json=sglang_body(up, prompt(300), stream=True)) as r:
        assert r.status == 504, await r.text()
    assert 2.9 <= time.monotonic() - t < 8
    assert empty(await state(s, ud))
    # the prefill side hears the decode side hang up (its pull's connection closes) and forgets the room
    await wait_until(lambda: state(s, up), 5, "the prefill side forgets the room", ok=empty)


@pytest.mark.slow
async def test_prefilled_kv_nobody_pulls_is_freed(pair: Any) -> None:
    up, ud, s = pair
    async with s.post(up + "/v1/completions", json=sglang_body(up, prompt(300))) as r:
        assert r.status == 200
    assert (await state(s, up))["engine_held"] == 1
    await asyncio.sleep(1.3)  # the hold timeout (1 s) passed
    assert empty(await state(s, up))


@pytest.mark.parametrize("body,role_url", [
    ({"bootstrap_room": "x", "bootstrap_host": "h", "bootstrap_port": 1}, "decode"),
    ({"bootstrap_room": 1, "bootstrap_port": 1}, "decode"),
    ({"kv_transfer_params": {"do_remote_decode": True}}, "decode"),
    ({"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "h"}}, "decode"),
    ({"kv_transfer_params": "yes"}, "prefill"),
])
async def test_bad_pd_fields_are_400(pair: Any, body: dict[str, Any], role_url: str) -> None:
    up, ud, s = pair
    url = ud if role_url == "decode" else up
    async with s.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4, **body}) as r:
        assert r.status == 400, await r.text()
        assert (await r.json())["error"]["type"] == "BadRequestError"  # vLLM's error type


async def test_one_token_answer_comes_from_the_prefill(pair: Any) -> None:
    """max_tokens 1 through SGLang PD (the real router sends it so): the decode side takes the KV
    and answers the prefill's token; nothing is decoded, nothing is left held."""
    up, ud, s = pair
    body = sglang_body(up, prompt(200), max_tokens=1)

    async def leg(url: str) -> tuple[int, dict[str, Any]]:
        async with s.post(url + "/v1/completions", json=body) as r:
            return r.status, await r.json()
    (ps, _), (ds, db) = await asyncio.gather(leg(up), leg(ud))
    assert ps == 200 and ds == 200, db
    assert db["usage"]["completion_tokens"] == 1 and db["choices"][0]["finish_reason"] == "length"
    assert (await state(s, up))["transfers"] == 1
    assert empty(await state(s, up)) and empty(await state(s, ud))


@pytest.mark.slow
async def test_a_room_whose_decode_side_left_mid_prefill_is_freed_when_prefilled() -> None:
    """The decode side (a room's only reader) hangs up while the prefill runs: the KV is freed the
    moment it is made, not held for the hold timeout (30 s here) for a pull that will never come."""
    common = dict(served_model_name="m", time_scale=20.0, kv_link_gb_s=GB_S, kv_link_latency_ms=1.0,
                  pd_wait_timeout_s=60.0, pd_hold_timeout_s=30.0)
    rp, up = await start_worker(pd_role="prefill", **common)
    rd, ud = await start_worker(pd_role="decode", **common)
    try:
        async with aiohttp.ClientSession() as s:
            body = sglang_body(up, prompt(1500))

            async def leg(url: str) -> int:
                async with s.post(url + "/v1/completions", json=body) as r:
                    await r.read()
                    return r.status
            prefill = asyncio.create_task(leg(up))
            decode = asyncio.create_task(leg(ud))
            await wait_until(lambda: state(s, ud), 10, "the decode side reserving for the room",
                             ok=lambda st: st["engine_receiving"] == 1)
            assert not prefill.done()  # still prefilling when the decode side leaves
            decode.cancel()
            with pytest.raises(asyncio.CancelledError):
                await decode
            assert await asyncio.wait_for(prefill, 30) == 200
            await wait_until(lambda: state(s, up), 5, "the prefill side freeing the unread KV", ok=empty)
            await wait_until(lambda: state(s, ud), 5, "the decode side holding nothing", ok=empty)
    finally:
        await rp.cleanup()
        await rd.cleanup()
