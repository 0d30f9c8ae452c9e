"""The gateway's ZMQ subscriber for engine KV cache events (vLLM's wire format; SGLang's too).

Wire format (vLLM `ZmqEventPublisher`): multipart `[topic, seq, payload]` with `seq`
an 8-byte big-endian counter that restarts at 0 when the engine restarts, and
`payload` a msgpack `KVEventBatch`: `[ts, [event, ...], dp_rank?]`. An event is a
map tagged `{"type": "BlockStored", ...}` (vLLM >= 0.11) or, in older vLLM and in
SGLang, a positional array `["BlockStored", block_hashes, parent, token_ids, ...]`.

Topology: the subscriber BINDS and engines CONNECT. vLLM connects whenever its
endpoint names a host (`tcp://127.0.0.1:5557`) and binds only on wildcards, so one
gateway socket serves any number of engines and survives their restarts: a
restarted engine simply connects again. Which instance a batch belongs to is
told by its topic: each instance publishes on its own topic (`tokenfleet/<id>`
for engines the adapter launches), one socket and one port per adapter. (vLLM
offsets the endpoint's port by the data-parallel rank: run data-parallel ranks as
separate instances.) Missed batches are not replayed: a gap only costs index
precision, and an engine restart clears that instance's state anyway.

Batches are translated to the gateway's block hashes on arrival
(`kv_translate`), so the translation stays right even when nobody consumes the
stream for a while; each instance then keeps a bounded buffer of translated
batches that `stream(instance_id)` yields as `KVEventBatch`es (the shape
`gateway.kv_feed` feeds into the router's cache index).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from engine_adapters.base import KVEventBatch
from engine_adapters.kv_translate import BlockHashTranslator

log = logging.getLogger("tokenfleet.kv_events")

# Positional field order of array-encoded events (older vLLM, SGLang); map-encoded
# events carry their names. Later fields are optional (msgspec omits defaults).
_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                    "kv_cache_spec_sliding_window", "locality", "ownership", "session_id"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx", "locality", "ownership"),
    "AllBlocksCleared": (),
}
DEFAULT_BUFFER_BATCHES = 4096
# A batch is at most a few MB (a 128k-token prompt stored at once: ~0.7 MB of token ids). ZMQ
# otherwise takes a message of any size, up to RCVHWM of them, from anyone who can connect (the
# bind may be a routable address for attached engines): a peer sending more is disconnected.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class KVDecodeError(ValueError):
    """A message that is not a KV event batch."""


def _text(v: Any) -> Any:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else v


def decode_event(raw: Any) -> dict[str, Any] | None:
    """One event as a dict with a `type`; None for kinds we do not know (skipped, not fatal)."""
    if isinstance(raw, Mapping):
        ev = {str(_text(k)): v for k, v in raw.items()}
        ev["type"] = _text(ev.get("type"))
    elif isinstance(raw, (list, tuple)) and raw:
        kind = _text(raw[0])
        names = _FIELDS.get(kind)
        if names is None:
            return None
        ev = dict(zip(names, raw[1:], strict=False))  # trailing defaults may be omitted
        ev["type"] = kind
    else:
        raise KVDecodeError(f"event is neither a map nor an array: {type(raw).__name__}")
    if ev["type"] not in _FIELDS:
        return None
    if "medium" in ev:
        ev["medium"] = _text(ev["medium"])
    return ev


def decode_batch(payload: bytes) -> tuple[float | None, list[dict[str, Any]]]:
    """msgpack KVEventBatch -> (timestamp, events)."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise KVDecodeError(f"payload is not msgpack: {e}") from None
    if isinstance(batch, Mapping):
        ts, events = batch.get("ts"), batch.get("events")
    elif isinstance(batch, (list, tuple)) and len(batch) >= 2:
        ts, events = batch[0], batch[1]
    else:
        raise KVDecodeError("payload is not a KVEventBatch")
    if not isinstance(events, (list, tuple)):
        raise KVDecodeError("KVEventBatch.events is not a list")
    out = [ev for ev in (decode_event(e) for e in events) if ev is not None]
    return (float(ts) if isinstance(ts, (int, float)) else None), out


def decode_message(frames: Sequence[bytes]) -> tuple[str, int, list[dict[str, Any]]]:
    """`[topic, seq, payload]` -> (topic, seq, events)."""
    if len(frames) != 3:
        raise KVDecodeError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq, payload = frames
    if len(seq) != 8:
        raise KVDecodeError(f"sequence frame has {len(seq)} bytes, not 8")
    _, events = decode_batch(payload)
    return bytes(topic).decode("utf-8", "replace"), int.from_bytes(seq, "big"), events


@dataclass(slots=True)
class _Channel:
    instance_id: str
    translator: BlockHashTranslator
    buffer: deque[KVEventBatch]
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    dropped: int = 0
    closed: bool = False  # unregistered: its stream ends


@dataclass(slots=True)
class SubscriberStats:
    messages: int = 0
    malformed: int = 0
    unknown_topic: int = 0


class KVEventSubscriber:
    """One bound SUB socket; batches demultiplexed by topic to per-instance streams."""

    def __init__(self, bind: str = "tcp://127.0.0.1:*", advertise: str | None = None,
                 buffer_batches: int = DEFAULT_BUFFER_BATCHES) -> None:
        self.bind_address = bind
        self._advertise = advertise
        self.buffer_batches = buffer_batches
        self.stats = SubscriberStats()
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._by_topic: dict[str, _Channel] = {}
        self._by_instance: dict[str, _Channel] = {}
        self._closed = False
        self.endpoint = ""

    def start(self) -> str:
        """Bind and start receiving; returns the endpoint engines should connect to."""
        if self._sock is not None:
            return self.endpoint
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")  # all topics: exact topic match is ours (ZMQ matches prefixes)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(self.bind_address)
        except zmq.ZMQError as e:
            sock.close(0)
            raise OSError(f"cannot bind KV event subscriber at {self.bind_address}: {e}") from None
        self._sock = sock
        bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.endpoint = self._advertise or bound.replace("0.0.0.0", "127.0.0.1")
        self._task = asyncio.get_running_loop().create_task(self._receive(), name="kv-zmq")
        return self.endpoint

    def register(self, topic: str, instance_id: str, block_size: int) -> None:
        """Batches on `topic` belong to `instance_id`, whose index keys use `block_size`-token blocks."""
        ch = _Channel(instance_id, BlockHashTranslator(block_size), deque(maxlen=self.buffer_batches))
        self._by_topic[topic] = ch
        self._by_instance[instance_id] = ch

    def unregister(self, instance_id: str) -> None:
        """The instance was removed for good (the planner scaled it down): drop its channel, hash map
        and undelivered batches, and end a reader following its `stream`. Kept, every removed
        instance's map (up to kv_translate.MAX_ENTRIES) stayed for the gateway's life, while ids
        are never reused."""
        ch = self._by_instance.pop(instance_id, None)
        if ch is None:
            return
        for topic in [t for t, c in self._by_topic.items() if c is ch]:
            del self._by_topic[topic]
        ch.buffer.clear()
        ch.closed = True
        ch.wake.set()

    def reset(self, instance_id: str) -> None:
        """The instance's engine restarted: forget its hash map and undelivered batches, keep the
        channel (a reader following `stream` stays attached to it)."""
        ch = self._by_instance.get(instance_id)
        if ch is not None:
            ch.translator = BlockHashTranslator(ch.translator.block_size)
            ch.buffer.clear()

    def translator(self, instance_id: str) -> BlockHashTranslator | None:
        ch = self._by_instance.get(instance_id)
        return ch.translator if ch else None

    def has(self, instance_id: str) -> bool:
        return instance_id in self._by_instance

    def drops(self) -> dict[tuple[str, str], int]:
        """What never reached the index, (instance id, reason) -> count (`EngineAdapter.kv_event_drops`):
        batches a full buffer pushed out (`buffer_full`, per instance), messages that could not be read
        (`malformed`) or named no registered topic (`unknown_topic`), not attributable ("")."""
        out = {(iid, "buffer_full"): ch.dropped for iid, ch in self._by_instance.items() if ch.dropped}
        if self.stats.malformed:
            out["", "malformed"] = self.stats.malformed
        if self.stats.unknown_topic:
            out["", "unknown_topic"] = self.stats.unknown_topic
        return out

    async def stream(self, instance_id: str) -> AsyncIterator[KVEventBatch]:
        """Translated batches of one instance, until the subscriber closes."""
        ch = self._by_instance.get(instance_id)
        if ch is None:
            return
        while not self._closed and not ch.closed:
            while ch.buffer:
                yield ch.buffer.popleft()
            ch.wake.clear()
            await ch.wake.wait()

    def deliver(self, topic: str, seq: int, events: Sequence[Mapping[str, Any]]) -> None:
        """Translate and buffer one decoded batch (the receive loop's step; tests call it directly)."""
        ch = self._by_topic.get(topic)
        if ch is None:
            self.stats.unknown_topic += 1
            return
        translated = ch.translator.translate(seq, events)
        if len(ch.buffer) == ch.buffer.maxlen:
            ch.dropped += 1  # nobody is reading: the oldest batch goes
        # Pass even an empty batch on: its sequence number tells the index the engine restarted.
        ch.buffer.append(KVEventBatch(ch.instance_id, seq, translated))
        ch.wake.set()

    async def _receive(self) -> None:
        assert self._sock is not None
        while True:
            try:
                frames = await self._sock.recv_multipart()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as e:
                if self._closed:
                    return
                log.warning("KV event subscriber: %s", e)
                await asyncio.sleep(0.1)
                continue
            self.stats.messages += 1
            try:
                topic, seq, events = decode_message(frames)
                self.deliver(topic, seq, events)
            except Exception as e:  # noqa: BLE001
                # Not only KVDecodeError: a well-formed batch whose fields have the wrong types
                # (an unhashable `type` or hash, a non-numeric block_size, token_ids that are not a
                # list) raises TypeError/ValueError in decoding or translation. Raised here it
                # ended this task: every instance's KV feed went silent for the gateway's life.
                self.stats.malformed += 1
                log.debug("dropping malformed KV event message: %s", e)
                continue

    async def close(self) -> None:
        self._closed = True
        for ch in self._by_instance.values():
            ch.wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
