"""Shared behaviour of adapters whose engines speak OpenAI + Prometheus over HTTP."""

from __future__ import annotations

import asyncio
import errno
import json
from collections.abc import AsyncIterator

import aiohttp

from engine_adapters.base import EngineAdapter, EngineDown, Instance, KVEventBatch, LoadSnapshot
from engine_adapters.metrics_scrape import parse_metrics

PROBE_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
# `check` and `snapshot` serve the gateway's poller, which sets the real deadline (in time its
# event loop could run, see gateway.fleet_state); a wall-clock timeout of their own would
# fire during a stalled loop and blame the engine. This only bounds a forgotten caller.
POLL_BACKSTOP_TIMEOUT = aiohttp.ClientTimeout(total=60.0)
# An engine's /metrics page is tens of KB (vLLM serving many LoRA adapters: a few MB). More is a
# bug or not an engine; read whole, loopback delivers GBs within the poll's deadline. Such a
# page is a failed scrape (not ready), as a non-200 one is.
MAX_METRICS_BYTES = 16 * 1024 * 1024


class HttpEngineAdapter(EngineAdapter):
    """Health from `GET /health`, load from `GET /metrics`, abort via `POST /abort_request`."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=PROBE_TIMEOUT)
        return self._session

    async def close_http(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def health(self, instance: Instance) -> bool:
        try:
            return await self._health(instance, PROBE_TIMEOUT)
        except EngineDown:
            return False

    async def check(self, instance: Instance) -> bool:
        return await self._health(instance, POLL_BACKSTOP_TIMEOUT)

    async def _health(self, instance: Instance, timeout: aiohttp.ClientTimeout) -> bool:
        if self.down(instance):
            raise EngineDown(f"{instance.instance_id}: engine process is down")
        try:
            async with self._http().get(f"{instance.url}/health", timeout=timeout) as r:
                return r.status == 200
        except aiohttp.ClientConnectorError as e:
            # Refused: nothing listens on the port, the engine is gone (not merely slow).
            if isinstance(e.os_error, ConnectionRefusedError) or e.os_error.errno == errno.ECONNREFUSED:
                raise EngineDown(f"{instance.instance_id}: connection refused") from None
            return False
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def snapshot(self, instance: Instance) -> LoadSnapshot:
        try:
            async with self._http().get(f"{instance.url}/metrics", timeout=POLL_BACKSTOP_TIMEOUT) as r:
                if r.status != 200 or (r.content_length or 0) > MAX_METRICS_BYTES:
                    return LoadSnapshot(ready=False)
                body = bytearray()
                async for chunk in r.content.iter_any():
                    body += chunk
                    if len(body) > MAX_METRICS_BYTES:
                        return LoadSnapshot(ready=False)
                return parse_metrics(body.decode("utf-8", "replace"))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            return LoadSnapshot(ready=False)

    async def abort(self, instance: Instance, request_id: str) -> bool:
        try:
            async with self._http().post(f"{instance.url}/abort_request", json={"rid": request_id}) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def wait_ready(self, instance: Instance, timeout_s: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            if await self.health(instance):
                return True
            await asyncio.sleep(0.1)
        return False


async def ndjson_kv_events(session: aiohttp.ClientSession, instance: Instance) -> AsyncIterator[KVEventBatch]:
    """Follow a worker's `GET /kv_events` feed (one JSON batch per line) until it closes."""
    async with session.get(f"{instance.url}/kv_events",
                           timeout=aiohttp.ClientTimeout(total=None, sock_connect=2.0)) as r:
        r.raise_for_status()
        async for line in r.content:
            line = line.strip()
            if not line:
                continue
            batch = json.loads(line)
            yield KVEventBatch(instance.instance_id, int(batch.get("seq", 0)), list(batch.get("events", [])))
