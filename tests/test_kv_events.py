"""KV events from real engines: wire decoding, engine-hash -> index-key translation, and the
ZMQ subscriber over real sockets with a publisher that behaves like vLLM's (it connects)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import msgpack
import pytest
import zmq

from engine_adapters.kv_translate import BlockHashTranslator
from engine_adapters.kv_zmq import KVDecodeError, KVEventSubscriber, decode_batch, decode_message
from fleetcore.prefix import block_hashes
from tests.waits import wait_until
from tokenpilot.cache_index import PrefixCacheIndex

BS = 4


def stored(hashes, tokens, parent=None, bs=BS, **extra):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": bs, "lora_id": None, "medium": "GPU", **extra}


# --- decoding -------------------------------------------------------------------------

def test_decode_vllm_map_events():
    ev = stored([11, 12], list(range(8)), group_idx=0, kv_cache_spec_kind="full_attention")
    payload = msgpack.packb([1.5, [ev, {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"},
                                   {"type": "AllBlocksCleared"}], 0])
    ts, events = decode_batch(payload)
    assert ts == 1.5
    assert [e["type"] for e in events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert events[0]["block_hashes"] == [11, 12] and events[0]["token_ids"] == list(range(8))


def test_decode_array_events_of_sglang_and_older_vllm():
    payload = msgpack.packb([2.0, [["BlockStored", [1, 2], None, list(range(8)), 4, None],
                                   ["BlockRemoved", [1], "GPU"], ["AllBlocksCleared"],
                                   ["SomethingNew", 1, 2]]])
    _, events = decode_batch(payload)
    assert events[0] == {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
                         "token_ids": list(range(8)), "block_size": 4, "lora_id": None}
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}
    assert events[2] == {"type": "AllBlocksCleared"}
    assert len(events) == 3  # unknown kinds are skipped, not fatal


def test_decode_bytes_hashes_and_message_frames():
    payload = msgpack.packb([0.0, [stored([b"\x01" * 32], list(range(4)))]], use_bin_type=True)
    topic, seq, events = decode_message([b"kv@a", (7).to_bytes(8, "big"), payload])
    assert (topic, seq) == ("kv@a", 7)
    assert events[0]["block_hashes"] == [b"\x01" * 32]


@pytest.mark.parametrize("frames", [
    [b"t", b"\x00" * 8],
    [b"t", b"\x00" * 4, msgpack.packb([0.0, []])],
    [b"t", b"\x00" * 8, b"\xc1not msgpack"],
    [b"t", b"\x00" * 8, msgpack.packb({"nope": 1})],
    [b"t", b"\x00" * 8, msgpack.packb([0.0, [42]])],
])
def test_decode_rejects_malformed(frames):
    with pytest.raises(KVDecodeError):
        decode_message(frames)


# --- translation ----------------------------------------------------------------------

def test_translation_chains_like_the_gateway():
    """Keys from events equal what the gateway computes from the prompt's token ids."""
    prompt = list(range(100, 124))  # 6 blocks of 4
    tr = BlockHashTranslator(BS)
    out = tr.translate(0, [stored([1, 2, 3], prompt[:12])])
    out += tr.translate(1, [stored([4, 5, 6], prompt[12:], parent=3)])  # extends the cached prefix
    ours = [h for ev in out for h in ev["block_hashes"]]
    assert ours == block_hashes(prompt, BS)
    removed = tr.translate(2, [{"type": "BlockRemoved", "block_hashes": [6, 5, 99], "medium": "GPU"}])
    assert removed == [{"type": "BlockRemoved", "block_hashes": block_hashes(prompt, BS)[5:3:-1]}]
    assert tr.stats.unknown_removed == 1 and len(tr) == 4


def test_translation_orphans_restart_and_foreign_blocks():
    tr = BlockHashTranslator(BS)
    assert tr.translate(0, [stored([2], [1, 2, 3, 4], parent=1)]) == []  # parent never seen
    assert tr.stats.orphan_blocks == 1
    assert tr.translate(1, [stored([3], [1, 2, 3, 4], medium="CPU")]) == []  # offload tier
    assert tr.translate(2, [stored([4], [1, 2, 3, 4], group_idx=1)]) == []  # second KV group
    assert tr.translate(3, [stored([5], [1, 2, 3], bs=3)]) == []  # block size we cannot split
    assert tr.stats.foreign_blocks == 3
    tr.translate(4, [stored([6], [1, 2, 3, 4])])
    assert len(tr) == 1
    tr.translate(0, [])  # sequence restarted: the engine restarted with an empty cache
    assert len(tr) == 0 and tr.stats.restarts == 1
    tr.translate(5, [])
    assert tr.stats.gaps == 1


def test_translation_splits_larger_engine_blocks():
    """An engine block of 8 stands for two gateway blocks of 4."""
    tokens = list(range(16))
    tr = BlockHashTranslator(4)
    out = tr.translate(0, [stored([1, 2], tokens, bs=8)])
    assert out[0]["block_hashes"] == block_hashes(tokens, 4)
    out = tr.translate(1, [{"type": "BlockRemoved", "block_hashes": [2], "medium": None}])
    assert out[0]["block_hashes"] == block_hashes(tokens, 4)[2:]


def test_all_blocks_cleared_empties_the_map():
    tr = BlockHashTranslator(BS)
    tr.translate(0, [stored([1], [1, 2, 3, 4])])
    assert tr.translate(1, [{"type": "AllBlocksCleared"}]) == [{"type": "AllBlocksCleared"}]
    assert len(tr) == 0


# --- the subscriber over real sockets -------------------------------------------------

async def _until(pred, timeout=5.0):
    await wait_until(pred, timeout, "the subscriber to deliver what was published")


@contextlib.asynccontextmanager
async def _one_engine() -> AsyncIterator[tuple[KVEventSubscriber, zmq.Socket]]:
    """(subscriber, the engine's publisher): one instance `i0` on topic `t`, connected; closed after."""
    sub = KVEventSubscriber()
    endpoint = sub.start()
    sub.register("t", "i0", BS)
    ctx = zmq.Context()
    pub = await _engine_pub(ctx, endpoint)
    try:
        yield sub, pub
    finally:
        pub.close(0)
        ctx.term()
        await sub.close()


async def _engine_pub(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """An engine's publisher connected to the subscriber, returned once the subscription has reached
    it (a PUB drops what it sends before that). An XPUB publishes as a PUB does and also hears the
    subscription arrive, so the test waits for that event instead of sleeping."""
    pub = ctx.socket(zmq.XPUB)
    pub.connect(endpoint)
    await wait_until(lambda: pub.poll(0), 5, f"the subscriber's subscription to reach a publisher on {endpoint}")
    assert pub.recv() == b"\x01"  # subscribe, all topics
    return pub


def _publish(pub: zmq.Socket, topic: str, seq: int, events) -> None:
    pub.send_multipart([topic.encode(), seq.to_bytes(8, "big"), msgpack.packb([time.time(), events, 0])])


async def test_subscriber_binds_and_routes_topics_to_instances():
    sub = KVEventSubscriber()
    endpoint = sub.start()
    assert endpoint.startswith("tcp://127.0.0.1:")
    sub.register("tokenfleet/a", "site/m/0", BS)
    sub.register("tokenfleet/b", "site/m/1", BS)
    ctx = zmq.Context()
    pubs = []
    try:
        for _ in range(2):  # two engines connect to the one bound socket
            pubs.append(await _engine_pub(ctx, endpoint))
        prompt = list(range(40, 52))
        _publish(pubs[0], "tokenfleet/a", 0, [stored([7, 8, 9], prompt)])
        _publish(pubs[1], "tokenfleet/b", 0, [stored([7], prompt[:4])])
        _publish(pubs[1], "tokenfleet/zzz", 0, [stored([7], prompt[:4])])
        pubs[1].send_multipart([b"tokenfleet/b", b"bad"])

        got: dict[str, list] = {"site/m/0": [], "site/m/1": []}

        async def follow(iid: str) -> None:
            async for batch in sub.stream(iid):
                got[iid].append(batch)

        tasks = [asyncio.create_task(follow(i)) for i in got]
        await _until(lambda: all(got.values()) and sub.stats.unknown_topic == 1 and sub.stats.malformed == 1)
        a, b = got["site/m/0"][0], got["site/m/1"][0]
        assert a.instance_id == "site/m/0" and a.seq == 0
        assert a.events[0]["block_hashes"] == block_hashes(prompt, BS)
        assert b.events[0]["block_hashes"] == block_hashes(prompt, BS)[:1]
        # The engine behind b restarts: it connects again and its sequence starts over.
        pubs[1].close(0)
        pub = pubs[1] = await _engine_pub(ctx, endpoint)
        _publish(pub, "tokenfleet/b", 0, [stored([70], prompt[4:8], parent=7)])  # parent died with the old engine
        await _until(lambda: len(got["site/m/1"]) == 2)
        assert sub.translator("site/m/1").stats.restarts == 1
        assert got["site/m/1"][1].seq == 0 and got["site/m/1"][1].events == []
        await sub.close()
        await asyncio.wait_for(asyncio.gather(*tasks), 2)  # streams end when the subscriber closes
    finally:
        for p in pubs:
            p.close(0)
        ctx.term()
        await sub.close()


async def test_events_reach_the_cache_index_with_gateway_keys():
    """Fake publisher -> subscriber -> the router's index: a request's hashes match there."""
    async with _one_engine() as (sub, pub):
        index = PrefixCacheIndex(stride=1)
        prompt = list(range(500, 532))
        _publish(pub, "t", 0, [stored(list(range(1, 9)), prompt)])
        stream = sub.stream("i0")
        batch = await asyncio.wait_for(stream.__anext__(), 5)
        index.apply_events(batch.instance_id, batch.seq, batch.events, now=0.0)
        assert index.match(block_hashes(prompt, BS), ["i0"]) == {"i0": 8}
        _publish(pub, "t", 1, [{"type": "BlockRemoved", "block_hashes": [5, 6, 7, 8], "medium": "GPU"}])
        batch = await asyncio.wait_for(stream.__anext__(), 5)
        index.apply_events(batch.instance_id, batch.seq, batch.events, now=0.0)
        assert index.match(block_hashes(prompt, BS), ["i0"]) == {"i0": 4}


async def test_subscriber_bind_failure_is_an_oserror():
    first = KVEventSubscriber()
    endpoint = first.start()
    try:
        with pytest.raises(OSError, match="cannot bind"):
            KVEventSubscriber(endpoint).start()
    finally:
        await first.close()


def test_unconsumed_streams_stay_bounded():
    sub = KVEventSubscriber(buffer_batches=3)
    sub.register("t", "i", BS)
    for seq in range(10):
        sub.deliver("t", seq, [stored([seq + 1], [1, 2, 3, 4])])
    ch = sub._by_instance["i"]
    assert len(ch.buffer) == 3 and ch.dropped == 7
    assert [b.seq for b in ch.buffer] == [7, 8, 9]
    sub.deliver("nobody", 10, [])
    assert sub.drops() == {("i", "buffer_full"): 7, ("", "unknown_topic"): 1}  # what /metrics shows


async def test_hostile_batches_do_not_end_the_feed():
    """A msgpack batch whose events have fields of the wrong types (an unhashable `type`, a
    non-numeric block_size, an int for block_hashes, a list for a hash) is counted malformed and
    dropped; the next good batch still arrives. The receive loop caught only KVDecodeError: the
    first TypeError/ValueError ended it and every instance's feed went silent."""
    async with _one_engine() as (sub, pub):
        prompt = list(range(600, 612))
        hostile = [
            [{"type": [1, 2]}],
            [["BlockStored", [1], None, prompt, "x"]],
            [{"type": "BlockStored", "block_hashes": 5, "token_ids": prompt, "block_size": BS}],
            [stored([[1]], prompt[:4])],
            [{"type": "BlockStored", "block_hashes": [1], "token_ids": 7, "block_size": BS}],
        ]
        for i, evs in enumerate(hostile):
            _publish(pub, "t", i, evs)
        _publish(pub, "t", len(hostile), [stored([7, 8, 9], prompt)])
        stream = sub.stream("i0")
        await _until(lambda: sub.stats.messages == len(hostile) + 1)
        assert sub.stats.malformed == len(hostile)
        assert sub.drops() == {("", "malformed"): len(hostile)}
        batch = None
        while True:  # skip what the hostile batches left behind before they raised (if anything)
            batch = await asyncio.wait_for(stream.__anext__(), 5)
            if batch.events:
                break
        assert batch.events[0]["block_hashes"] == block_hashes(prompt, BS)


async def test_unregistered_instance_is_forgotten_and_its_stream_ends():
    """The planner removed the instance (ids are never reused): its hash map and buffer go, its
    reader's stream ends, and a late batch on its topic is an unknown topic. There was no way to
    drop a channel: every removed instance's map stayed for the gateway's life."""
    sub = KVEventSubscriber()
    sub.start()
    try:
        sub.register("t0", "i0", BS)
        sub.register("t1", "i1", BS)
        sub.deliver("t0", 0, [stored([1, 2, 3], list(range(12)))])
        assert len(sub.translator("i0")) == 3
        got = []

        async def follow() -> None:
            async for batch in sub.stream("i0"):
                got.append(batch)

        reader = asyncio.create_task(follow())
        await _until(lambda: got)
        sub.unregister("i0")
        await asyncio.wait_for(reader, 5)  # ended, not waiting for ever on a channel nobody feeds
        assert not sub.has("i0") and sub.translator("i0") is None and sub.has("i1")
        sub.deliver("t0", 1, [stored([4], list(range(4)))])
        assert sub.stats.unknown_topic == 1
    finally:
        await sub.close()


async def test_an_oversized_message_is_refused():
    """A message past MAX_MESSAGE_BYTES never reaches the subscriber (ZMQ drops its sender's
    connection, which reconnects); the next batches do. ZMQ took messages of any size, up to
    RCVHWM (100,000) of them."""
    from engine_adapters.kv_zmq import MAX_MESSAGE_BYTES

    async with _one_engine() as (sub, pub):
        pub.send_multipart([b"t", (0).to_bytes(8, "big"), b"\xc1" * (MAX_MESSAGE_BYTES + 1)])
        got: list = []

        async def follow() -> None:
            async for b in sub.stream("i0"):
                got.append(b)

        reader = asyncio.create_task(follow())
        prompt = list(range(700, 704))
        for seq in range(1, 200):  # the first sent after the reconnect gets through
            _publish(pub, "t", seq, [stored([seq], prompt)])
            try:
                await wait_until(lambda: got, 0.1, "a batch after the oversized one")
                break
            except AssertionError:
                continue
        assert got, "no batch got through after the oversized one"
        assert sub.stats.malformed == 0  # the oversized one was never received
        await sub.close()
        await asyncio.wait_for(reader, 5)
