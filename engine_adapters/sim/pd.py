"""The live sim worker's prefill/decode disaggregation: both published protocols, one KV handshake.

Requests that ask for a P/D leg (issue 17):

* SGLang PD (`sgl-router --pd-disaggregation`): the router sends the *same* body to a prefill
  and a decode server at once, with `bootstrap_host`, `bootstrap_port`, `bootstrap_room`.
  Which leg a server runs is its own `--disaggregation-mode` (here the worker's `pd_role`).
  The bootstrap port of a sim prefill worker is its HTTP port.
* vLLM disaggregated serving (NixlConnector, `toy_proxy_server.py`): the proxy sends the prefill
  instance `kv_transfer_params: {"do_remote_decode": true, ...}` with `max_tokens: 1`; its
  answer carries `kv_transfer_params` (`do_remote_prefill: true`, `remote_engine_id`,
  `remote_block_ids`, `remote_request_id`, `remote_host`, `remote_port`, `tp_size`), which the
  proxy puts in the original request to the decode instance.

Either way the prefill leg runs in the engine's prefill-only mode (`SimEngine`, mode
"prefill": it ends at the first token and holds the KV) and the decode leg reserves the
prompt's blocks (`SimEngine.receive`) and then *pulls* the KV from the prefill worker:
`POST {prefill}/pd/kv_pull {"key", "tokens"}` waits until that room (SGLang) or request
(vLLM) has been prefilled, books the transfer on the prefill worker's link (one FIFO per
sender, `fleetcore.interconnect.LinkQueue`, bytes from the model's KV per token, as the
simulator's `SimLinks`), sleeps its modelled duration, frees the prefill side's blocks and
answers with the prefill's prefix-cache hit. KV bytes are not sent, their time is modelled.

Nothing waits forever: the decode side gives up on a room after `wait_timeout_s` (SGLang's
`SGLANG_DISAGGREGATION_WAITING_TIMEOUT`) and frees its reservation; the prefill side frees a
prefilled request nobody pulled after `hold_timeout_s` (vLLM's
`VLLM_NIXL_ABORT_REQUEST_TIMEOUT`); a decode leg whose client leaves aborts its pull, which
frees both ends. Every bound is in wall seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import aiohttp

from fleetcore.hardware import ModelSpec
from fleetcore.interconnect import Link, LinkQueue, kv_bytes

from .driver import EngineDriver, RequestStream
from .openai_wire import ApiError, bad_request

log = logging.getLogger(__name__)

PDRole = Literal["mixed", "prefill", "decode"]
PDProtocol = Literal["sglang", "vllm"]
PD_ROLES: tuple[str, ...] = ("mixed", "prefill", "decode")
# How often a decode leg asks its engine again for the blocks of a transfer (the simulator's
# `fleetsim.disagg.RECEIVE_RETRY_S`, in wall seconds here).
RECEIVE_RETRY_S = 0.02
# Rooms remembered after they ended (a pull that comes late must hear "gone", not wait).
_ENDED_ROOMS = 4096


@dataclass(frozen=True, slots=True)
class PDLeg:
    """The P/D part of one request: which protocol, which side, and (decode side) where from."""

    protocol: PDProtocol
    side: Literal["prefill", "decode"]
    key: str | None = None  # SGLang: the room; vLLM decode: the prefill's request id
    remote: str | None = None  # decode side: the prefill worker's base URL


def _int(v: Any, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"`{name}` must be an integer", name)
    return v


def parse_pd(body: Mapping[str, Any], role: PDRole) -> PDLeg | None:
    """The request's P/D leg, or None for an ordinary request. 400 for malformed fields, or a leg
    this worker's role cannot run (a decode-only server never prefills for someone else)."""
    room = body.get("bootstrap_room")
    params = body.get("kv_transfer_params")
    if room is not None:
        room = _int(room, "bootstrap_room")
        host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
        if not isinstance(host, str) or not host:
            raise bad_request("`bootstrap_host` is required with `bootstrap_room`", "bootstrap_host")
        port = _int(port, "bootstrap_port")
        if role == "mixed":
            raise bad_request("bootstrap fields need a server in prefill or decode disaggregation mode",
                              "bootstrap_room")
        if role == "prefill":
            return PDLeg("sglang", "prefill", str(room))
        return PDLeg("sglang", "decode", str(room), f"http://{host}:{port}")
    if params is None:
        return None
    if not isinstance(params, dict):
        raise bad_request("`kv_transfer_params` must be an object", "kv_transfer_params")
    if params.get("do_remote_decode"):
        if role == "decode":
            raise bad_request("this server is a KV consumer: it does not prefill for another",
                              "kv_transfer_params")
        return PDLeg("vllm", "prefill")
    if params.get("do_remote_prefill"):
        if role == "prefill":
            raise bad_request("this server is a KV producer: it does not decode remote prefills",
                              "kv_transfer_params")
        host, port, rid = params.get("remote_host"), params.get("remote_port"), params.get("remote_request_id")
        if not isinstance(host, str) or not host or not isinstance(rid, str) or not rid:
            raise bad_request("`kv_transfer_params` needs `remote_host` and `remote_request_id`",
                              "kv_transfer_params")
        return PDLeg("vllm", "decode", rid, f"http://{host}:{_int(port, 'kv_transfer_params.remote_port')}")
    return None  # params present but asking for nothing (vLLM treats it as a plain request)


@dataclass(slots=True)
class _Room:
    """One prefill leg as the prefill worker tracks it, from submit (or from an early pull) on."""

    rid: str | None = None
    cached: int = 0
    state: Literal["waiting", "prefilling", "held", "ended"] = "waiting"
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    hold_timer: asyncio.TimerHandle | None = None
    abandoned: bool = False  # its one reader (the decode side's pull) gave up while it prefilled

    def set(self, state: Literal["waiting", "prefilling", "held", "ended"]) -> None:
        self.state = state
        self.changed.set()
        self.changed = asyncio.Event()


class PullFailed(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class PDPeer:
    """A worker's P/D half: its rooms (prefill side), its link, its pulls (decode side)."""

    def __init__(self, driver: EngineDriver, model: ModelSpec, link: Link, time_scale: float,
                 instance_id: str, side_channel: tuple[str, int] | None = None,
                 wait_timeout_s: float = 30.0, hold_timeout_s: float = 30.0, tp: int = 1) -> None:
        self.driver = driver
        self.model = model
        self.link = LinkQueue(link)
        self.time_scale = time_scale
        self.instance_id = instance_id
        self.side_channel = side_channel  # (host, port) set once the worker listens
        self.wait_timeout_s = wait_timeout_s
        self.hold_timeout_s = hold_timeout_s
        self.tp = tp
        self._rooms: dict[str, _Room] = {}
        self._by_rid: dict[str, str] = {}  # prefill request id -> room key
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._session: aiohttp.ClientSession | None = None
        self.transfers = 0
        self.pull_failures = 0
        driver.on_prefilled = self._prefilled

    async def close(self) -> None:
        for room in self._rooms.values():
            if room.hold_timer is not None:
                room.hold_timer.cancel()
        if self._session is not None:
            await self._session.close()

    def state(self) -> dict[str, Any]:
        """What the P/D side holds right now (`GET /pd/state`; tests check nothing is left)."""
        e = self.driver.engine
        return {"instance_id": self.instance_id, "rooms": len(self._rooms),
                "rooms_held": sum(r.state == "held" for r in self._rooms.values()),
                "engine_held": e.num_held - e.num_receiving, "engine_receiving": e.num_receiving,
                "transfers": self.transfers, "pull_failures": self.pull_failures,
                "kv_usage": e.kv_usage}

    # -- prefill side ---------------------------------------------------------------------
    def _room(self, key: str) -> _Room:
        room = self._rooms.get(key)
        if room is None:
            room = self._rooms[key] = _Room()
        return room

    def start_prefill(self, key: str, stream: RequestStream) -> None:
        """A prefill leg was submitted (prefill-only mode) under `key`."""
        if key in self._ended or (key in self._rooms and self._rooms[key].rid is not None):
            self.driver.abort(stream.request_id)
            raise bad_request(f"bootstrap room / request {key!r} is already in use", "bootstrap_room")
        room = self._room(key)
        room.rid = stream.request_id
        self._by_rid[stream.request_id] = key
        room.set("prefilling")

    def prefill_ended(self, key: str, aborted: bool = False) -> None:
        """The prefill leg's handler is over: if it never got to hold its KV (aborted, the engine
        stopped), the room is over too and a decode waiting on it hears so at once. So is a room
        whose leg was aborted after its KV was made (the client left between the prefill and the
        answer): aborting the request freed its blocks, and a pull must hear "gone", not read them."""
        room = self._rooms.get(key)
        if room is not None and (room.state == "prefilling" or (aborted and room.state == "held")):
            self._end(key)

    def _prefilled(self, rid: str, cached: int) -> None:
        key = self._by_rid.get(rid)
        room = self._rooms.get(key) if key is not None else None
        if room is None:  # nobody will pull it (should not happen): do not leak its blocks
            self.driver.release_kv(rid)
            return
        room.cached = cached
        if room.abandoned:  # nobody will pull it any more: free it now, not at the hold timeout
            self._end(key)
            return
        room.set("held")
        # vLLM frees a prefilled request nobody read after a timeout; so does this side.
        room.hold_timer = asyncio.get_running_loop().call_later(self.hold_timeout_s, self._expire, key)

    def _expire(self, key: str) -> None:
        room = self._rooms.get(key)
        if room is not None and room.state == "held":
            log.warning("P/D room %s: prefilled KV never pulled within %.1f s; freed", key, self.hold_timeout_s)
            self._end(key)

    def _end(self, key: str) -> None:
        room = self._rooms.pop(key, None)
        if room is None:
            return
        if room.hold_timer is not None:
            room.hold_timer.cancel()
        if room.rid is not None:
            self._by_rid.pop(room.rid, None)
            self.driver.release_kv(room.rid)
        self._ended[key] = None
        while len(self._ended) > _ENDED_ROOMS:
            self._ended.popitem(last=False)
        room.set("ended")

    def transfer_params(self, rid: str) -> dict[str, Any]:
        """vLLM's answer to a `do_remote_decode` prefill: where and what the decode side reads."""
        host, port = self.side_channel or ("127.0.0.1", 0)
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": self.driver.engine.kv.blocks_of(rid),
                "remote_engine_id": self.instance_id, "remote_request_id": rid,
                "remote_host": host, "remote_port": port, "tp_size": self.tp}

    async def serve_pull(self, key: str, tokens: int) -> dict[str, Any]:
        """`POST /pd/kv_pull`: wait for the room's prefill, move its KV over the link, free it."""
        if key in self._ended:
            raise ApiError(410, f"P/D room {key!r} is over (aborted, expired or already sent)", param="key")
        room = self._room(key)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.wait_timeout_s
        try:
            while room.state in ("waiting", "prefilling"):
                left = give_up - loop.time()
                if left <= 0:
                    raise ApiError(504, f"P/D room {key!r} was not prefilled within {self.wait_timeout_s:.1f} s")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(room.changed.wait(), left)
        finally:
            # A pull that gave up (or whose decode side left) on a room no prefill ever opened
            # leaves nothing behind; a prefill that comes later is freed by its hold timeout.
            if room.state == "waiting" and self._rooms.get(key) is room:
                del self._rooms[key]
            elif room.state == "prefilling":
                room.abandoned = True  # (the decode side left or timed out: its KV has no reader)
        if room.state != "held":
            raise ApiError(410, f"P/D room {key!r} is over (aborted, expired or already sent)", param="key")
        if room.hold_timer is not None:
            room.hold_timer.cancel()
            room.hold_timer = None
        room.state = "ended"  # claimed: a second pull hears "gone"
        try:
            now = self.driver.now()
            _, end = self.link.reserve(now, kv_bytes(self.model, tokens))
            await asyncio.sleep(max(0.0, end - now) * self.time_scale)
            self.transfers += 1
            return {"cached_tokens": room.cached, "transfer_s": end - now}
        finally:  # sent, or the decode side left mid-transfer: this side's copy goes either way
            self._end(key)

    # -- decode side ----------------------------------------------------------------------
    async def receive(self, leg: PDLeg, rid: str, prompt_len: int, hashes: list[int], output_len: int,
                      finish_reason: str) -> RequestStream:
        """Reserve the blocks, pull the KV, and return the stream (its first token delivered).
        An ApiError (503/504) if the KV cannot be had; the reservation is freed then, and when
        the caller is cancelled (its client left)."""
        assert leg.remote is not None and leg.key is not None
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.wait_timeout_s
        if output_len < 2:  # the prefill's first token is the whole answer: its KV still comes over
            try:
                info = await self._pull(leg, prompt_len, give_up - loop.time())
            except PullFailed as exc:
                self.pull_failures += 1
                raise ApiError(exc.status, f"KV transfer from the prefill server failed: {exc}",
                               "ServiceUnavailableError") from None
            return self.driver.made_elsewhere(rid, int(info.get("cached_tokens", 0)))
        try:
            got = self.driver.receive(rid, prompt_len, hashes, output_len, finish_reason)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        while got is None:
            if loop.time() >= give_up:
                raise ApiError(503, "no KV room for the transfer on this decode server", "ServiceUnavailableError")
            await asyncio.sleep(RECEIVE_RETRY_S)
            got = self.driver.receive(rid, prompt_len, hashes, output_len, finish_reason)
        stream, here = got
        try:
            info = await self._pull(leg, prompt_len - here, give_up - loop.time())
        except BaseException as exc:
            self.driver.abort(rid)  # the room is over for us: free the reserved blocks
            if isinstance(exc, PullFailed):
                self.pull_failures += 1
                raise ApiError(exc.status, f"KV transfer from the prefill server failed: {exc}",
                               "ServiceUnavailableError") from None
            raise
        self.driver.kv_arrived(rid, int(info.get("cached_tokens", 0)))
        return stream

    async def _pull(self, leg: PDLeg, tokens: int, timeout_s: float) -> dict[str, Any]:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        try:
            async with self._session.post(f"{leg.remote}/pd/kv_pull", json={"key": leg.key, "tokens": tokens},
                                          timeout=aiohttp.ClientTimeout(total=max(0.05, timeout_s))) as resp:
                body = await resp.json(content_type=None)
                if resp.status != 200:
                    msg = body.get("error", {}).get("message") if isinstance(body, dict) else None
                    raise PullFailed(504 if resp.status == 504 else 503, msg or f"HTTP {resp.status}")
                return body if isinstance(body, dict) else {}
        except asyncio.TimeoutError:
            raise PullFailed(504, f"no KV from the prefill server within {timeout_s:.1f} s") from None
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            raise PullFailed(503, f"prefill server unreachable: {type(exc).__name__}") from None
