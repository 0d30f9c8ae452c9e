"""The KV event feed says when it stops: a feed that ended or broke is counted per instance
(`tokenfleet_kv_feed_interruptions_total{reason}`) beside the batches it applied, warned about
once per run of failures, and its recovery logged. Before, an interruption was a debug line:
the router's index fell back to approximate for that instance and nothing told the operator."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import pytest

import gateway.kv_feed as kv_feed
from engine_adapters.base import KVEventBatch
from gateway.kv_feed import KVEventFeed
from gateway.metrics import GatewayMetrics


def _sample(metrics: GatewayMetrics, name: str, **labels: str) -> float | None:
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


async def test_interruptions_and_batches_are_counted_and_warned_once_per_run(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(kv_feed, "BACKOFF_S", (0.0,))
    opened = 0
    done = asyncio.Event()
    applied: list[int] = []

    async def stream() -> AsyncIterator[KVEventBatch]:
        # 1st: two batches, then unreadable; 2nd: broken at once; 3rd: one batch, then closed by
        # the engine; 4th: stays open (the test ends there)
        nonlocal opened
        opened += 1
        n = opened
        if n == 1:
            yield KVEventBatch("a", 0, [])
            yield KVEventBatch("a", 1, [])
            raise ValueError("Chunk too big")
        if n == 2:
            raise ConnectionResetError("reset by peer")
        if n == 3:
            yield KVEventBatch("a", 2, [])
            return
        done.set()
        await asyncio.Event().wait()
        yield KVEventBatch("a", 3, [])  # (never: makes this an async generator)

    class Sink:
        def observe_kv_events(self, instance_id: str, seq: int, events: Sequence[Mapping[str, Any]],
                              now: float) -> None:
            applied.append(seq)

    st = SimpleNamespace(instance=SimpleNamespace(instance_id="a"),
                         adapter=SimpleNamespace(kv_events=lambda instance: stream()))
    state = SimpleNamespace(get=lambda instance_id: st, states=lambda: [st])
    metrics = GatewayMetrics()
    feed = KVEventFeed(state, Sink(), clock=lambda: 0.0, metrics=metrics)  # type: ignore[arg-type]
    caplog.set_level(logging.DEBUG, logger="tokenfleet.gateway")
    follower = asyncio.create_task(feed._follow("a"))
    try:
        await asyncio.wait_for(done.wait(), 10)
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
    assert applied == [0, 1, 2]
    assert _sample(metrics, "tokenfleet_kv_event_batches_total", instance="a") == 3
    assert _sample(metrics, "tokenfleet_kv_feed_interruptions_total", instance="a", reason="error") == 2
    assert _sample(metrics, "tokenfleet_kv_feed_interruptions_total", instance="a", reason="ended") == 1
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "kv events from a" in r.getMessage()]
    # the first of each run of failures: the unreadable batch, then (after it resumed) the close
    assert len(warned) == 2, [r.getMessage() for r in warned]
    assert "ValueError: Chunk too big" in warned[0].getMessage()
    assert "closed the stream" in warned[1].getMessage()
    assert any(r.levelno == logging.INFO and "kv events from a resumed" in r.getMessage() for r in caplog.records)


def test_a_removed_instances_feed_series_are_forgotten() -> None:
    m = GatewayMetrics()
    m.kv_batch("a")
    m.kv_batch("b")
    m.kv_interrupted("a", "error")
    m.forget_instance("a")
    text = m.render().decode()
    assert 'tokenfleet_kv_event_batches_total{instance="b"} 1.0' in text
    assert 'instance="a"' not in text


async def test_adapters_kv_drops_are_on_the_gateways_metrics(
        fake_adapter: Any, instance_factory: Any, config_factory: Any) -> None:
    # summed over the adapters at each scrape: two subscribers' unattributable drops add up
    import httpx

    from gateway.app import create_app
    from gateway.embedded import serve_app

    drops = [{("use1/m1/0", "buffer_full"): 3, ("", "malformed"): 1}, {("", "malformed"): 2}]
    adapters = [fake_adapter([instance_factory(f"use1/m1/{i}", "http://127.0.0.1:9")]) for i in range(2)]
    for adapter, counts in zip(adapters, drops):
        adapter.kv_event_drops = lambda counts=counts: dict(counts)
    app = create_app(config_factory(), adapters, poll_interval_s=60)
    async with serve_app(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as c:
        text = (await c.get("/metrics")).text
        drops[0][("use1/m1/0", "buffer_full")] = 5
        later = (await c.get("/metrics")).text
    assert 'tokenfleet_kv_events_dropped_total{instance="use1/m1/0",reason="buffer_full"} 3.0' in text
    assert 'tokenfleet_kv_events_dropped_total{instance="",reason="malformed"} 3.0' in text
    assert 'tokenfleet_kv_events_dropped_total{instance="use1/m1/0",reason="buffer_full"} 5.0' in later
