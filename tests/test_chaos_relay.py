"""Chaos against the relay with real processes: `tokenfleet up` over simulated workers, an engine
frozen with SIGSTOP before its first byte, mid-stream, and everywhere at once; then SIGCONT and
the instance comes back. Small deadlines come from the fleet file's `gateway:` block."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleetcore.policies import InstanceRouter
from tests.waits import wait_until

REPO = Path(__file__).resolve().parents[1]
MODEL = "llama-3.1-8b"
KEY = "sk-test-acme"
FIRST_BYTE_S = 2.0  # the floor; predicted TTFTs here are milliseconds, so this is the deadline
IDLE_S = 2.0

FLEET = """
regions: [us-east]
default_region: us-east
sites:
  - {{name: east, region: us-east, jurisdiction: us, rtt_ms: {{us-east: 1}}}}
models:
  - name: llama-3.1-8b
    versions: ["v1"]
    engine: {{spec: llama-3.1-8b, max_model_len: 8192, block_size: 16}}
deployments:
  - {{site: east, model: llama-3.1-8b, instances: 2, gpu: H100, adapter: sim, options: {{time_scale: {scale}}}}}
tenants:
  - {{name: acme, api_keys: [{key}], region: us-east}}
gateway:
  first_byte_timeout_floor_s: {first_byte}
  first_byte_timeout_factor: 2
  stream_idle_timeout_s: {idle}
  shutdown_grace_s: {grace}
  continuation: {{enabled: {continuation}}}
"""


def fleet_file(tmp: Path, *, scale: float = 1.0, grace: float = 120.0, continuation: bool = True) -> Path:
    path = tmp / "fleet.yaml"
    path.write_text(FLEET.format(scale=scale, key=KEY, first_byte=FIRST_BYTE_S, idle=IDLE_S, grace=grace,
                                 continuation=str(continuation).lower()))
    return path


# --- processes ---

def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def workers_of(pid: int) -> dict[str, int]:
    """instance id -> pid of the sim workers `tokenfleet up` launched."""
    out: dict[str, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = _stat(int(entry))
        if st is None or int(st[1]) != pid:
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--instance-id" in argv:
            out[argv[argv.index(b"--instance-id") + 1].decode()] = int(entry)
    return out


def read_until(proc: subprocess.Popen[str], pattern: str, timeout_s: float) -> re.Match[str]:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    seen: list[str] = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"tokenfleet exited early; output so far: {seen}")
        seen.append(line)
        m = re.search(pattern, line)
        if m:
            return m
    raise AssertionError(f"no line matching {pattern!r} in {seen}")


def poll(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@dataclass
class Gateway:
    proc: subprocess.Popen[str]
    url: str
    workers: dict[str, int]
    stopped: set[int] = field(default_factory=set)
    output: list[str] = field(default_factory=list)

    def client(self, timeout: float = 30.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=timeout)

    def stop(self, iid: str) -> None:
        os.kill(self.workers[iid], signal.SIGSTOP)
        self.stopped.add(self.workers[iid])

    def cont(self, iid: str) -> None:
        os.kill(self.workers[iid], signal.SIGCONT)
        self.stopped.discard(self.workers[iid])

    def health(self) -> dict[str, Any]:
        with self.client(5) as c:
            return c.get("/health").json()

    def wait_ready(self, n: int, timeout_s: float = 15) -> None:
        poll(lambda: self.health()["ready_instances"] == n, timeout_s, f"{n} ready instance(s)")

    def metric(self, name: str, **labels: str) -> float:
        with self.client(5) as c:
            text = c.get("/metrics").text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total


def _drain_output(proc: subprocess.Popen[str], into: list[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        into.append(line)


@pytest.fixture
def start_gateway(tmp_path: Path) -> Iterator[Callable[..., Gateway]]:
    started: list[Gateway] = []

    def start(**fleet: Any) -> Gateway:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "tokenfleet", "up", "--fleet", str(fleet_file(tmp_path, **fleet)),
             "--port", "0", "--router", "round_robin", "--log-level", "warning"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
        url = read_until(proc, r"gateway\s+(http://\S+)/v1", 90).group(1)
        gw = Gateway(proc, url, workers_of(proc.pid))
        assert len(gw.workers) == 2, gw.workers
        threading.Thread(target=_drain_output, args=(proc, gw.output), daemon=True).start()
        started.append(gw)
        gw.wait_ready(2)
        return gw

    yield start
    for gw in started:
        for pid in list(gw.stopped):
            with_suppress(lambda: os.kill(pid, signal.SIGCONT))
        if gw.proc.poll() is None:
            gw.proc.send_signal(signal.SIGTERM)
            try:
                gw.proc.wait(30)
            except subprocess.TimeoutExpired:
                gw.proc.kill()
                gw.proc.wait()
        for pid in gw.workers.values():
            if alive(pid):
                with_suppress(lambda: os.kill(pid, signal.SIGKILL))


def with_suppress(fn: Callable[[], None]) -> None:
    try:
        fn()
    except ProcessLookupError:
        pass


# --- streams ---

def chat(content: str, max_tokens: int, stream: bool = True) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream}


@dataclass
class StreamResult:
    status: int = 0
    instance: str = ""
    tokens: int = 0
    events: list[Any] = field(default_factory=list)
    first_token_at: float | None = None
    ended_at: float | None = None
    error: BaseException | None = None

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [e["error"] for e in self.events if isinstance(e, dict) and "error" in e]


def read_stream(gw: Gateway, body: dict[str, Any], result: StreamResult,
                on_token: Callable[[int], None] | None = None, timeout: float = 30.0) -> None:
    """Consume one SSE stream into `result` (run it in a thread for concurrency)."""
    try:
        with gw.client(timeout) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
            result.status = r.status_code
            result.instance = r.headers.get("x-tokenfleet-instance", "")
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                ev: Any = data if data == "[DONE]" else json.loads(data)
                result.events.append(ev)
                if isinstance(ev, dict) and any(ch.get("delta", {}).get("content") for ch in ev.get("choices", [])):
                    result.tokens += 1
                    if result.first_token_at is None:
                        result.first_token_at = time.monotonic()
                    if on_token is not None:
                        on_token(result.tokens)
    except BaseException as e:  # kept for the assertion message
        result.error = e
    finally:
        result.ended_at = time.monotonic()


def no_address(text: str) -> bool:
    return "127.0.0.1" not in text and "localhost" not in text and not re.search(r":\d{4,5}\b", text)


# --- the chaos ---

@pytest.mark.slow
def test_engine_stopped_before_first_byte_retried_elsewhere(start_gateway: Callable[..., Gateway]) -> None:
    gw = start_gateway()
    frozen, other = sorted(gw.workers)
    gw.stop(frozen)
    # Round robin sends one of two concurrent requests to each instance: one lands on the frozen
    # engine before any health check can notice it (that takes a timed-out check).
    results = [StreamResult(), StreamResult()]
    threads = [threading.Thread(target=read_stream, args=(gw, chat(f"question {i}", 20), results[i]))
               for i in range(2)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for r in results:
        assert r.error is None and r.status == 200, (r.error, r.status)
        assert r.instance == other and r.done and not r.errors and r.tokens == 20
    retried = max(r.first_token_at or 0 for r in results) - t0
    assert FIRST_BYTE_S - 0.2 < retried < FIRST_BYTE_S + 5, f"retry came after {retried:.2f} s"
    assert gw.metric("tokenfleet_upstream_errors_total", instance=frozen, kind="first_byte_timeout") == 1
    assert gw.metric("tokenfleet_retries_total") == 1
    assert gw.metric("tokenfleet_inflight", instance=frozen) == 0
    assert gw.health()["ready_instances"] == 1

    gw.cont(frozen)
    gw.wait_ready(2)
    # back in rotation: round robin gives it one of the next two
    served = set()
    with gw.client() as c:
        for i in range(2):
            r = c.post("/v1/chat/completions", json=chat(f"again {i}", 4, stream=False))
            assert r.status_code == 200, r.text
            served.add(r.headers["x-tokenfleet-instance"])
    assert served == {frozen, other}


@pytest.mark.slow
def test_engine_stopped_mid_stream_ends_with_error_event(start_gateway: Callable[..., Gateway]) -> None:
    # Without continuation (gateway.continuation.enabled: false) a stall after the first byte ends the
    # stream; with it the stream continues elsewhere (tests/test_continuation_live.py).
    gw = start_gateway(continuation=False)
    result = StreamResult()
    stopped_at: list[float] = []

    def freeze_after_five(n: int) -> None:
        if n == 5:
            gw.stop(result.instance)
            stopped_at.append(time.monotonic())

    read_stream(gw, chat("a long story", 4000), result, on_token=freeze_after_five)
    assert result.error is None, f"stream did not end by itself: {result.error!r}"
    assert result.status == 200 and stopped_at
    waited = (result.ended_at or 0) - stopped_at[0]
    assert IDLE_S - 0.5 < waited < IDLE_S + 4, f"stream ended {waited:.2f} s after the engine stopped"
    assert result.done, "stream must end with [DONE]"
    (err,) = result.errors
    assert err["code"] == "upstream_timeout" and err["type"] == "server_error"
    assert result.instance in err["message"] and no_address(err["message"]), err["message"]
    assert result.events[-2] == {"error": err}
    assert 5 <= result.tokens < 4000
    assert gw.metric("tokenfleet_upstream_errors_total", instance=result.instance, kind="stream_idle_timeout") == 1
    assert gw.metric("tokenfleet_inflight", instance=result.instance) == 0
    assert gw.health()["ready_instances"] == 1, "a stalled engine must be taken out of routing"

    gw.cont(result.instance)
    gw.wait_ready(2)


@pytest.mark.slow
def test_every_engine_stopped_non_stream_gets_504(start_gateway: Callable[..., Gateway]) -> None:
    gw = start_gateway()
    for iid in gw.workers:
        gw.stop(iid)
    t0 = time.monotonic()
    with gw.client() as c:
        r = c.post("/v1/chat/completions", json=chat("anyone there?", 8, stream=False))
    elapsed = time.monotonic() - t0
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["code"] == "upstream_timeout" and err["type"] == "server_error"
    assert "engine instance" in err["message"] and no_address(err["message"]), err["message"]
    # first-byte deadline, then at most a few health periods to see the engine is not alive
    assert FIRST_BYTE_S - 0.2 < elapsed < 4 * FIRST_BYTE_S + 6, f"504 after {elapsed:.2f} s"
    assert sum(gw.metric("tokenfleet_inflight", instance=i) for i in gw.workers) == 0

    for iid in gw.workers:
        gw.cont(iid)
    gw.wait_ready(2)
    with gw.client() as c:
        r = c.post("/v1/chat/completions", json=chat("and now?", 4, stream=False))
    assert r.status_code == 200, r.text


# --- graceful shutdown ---

@pytest.mark.slow
def test_sigterm_lets_short_streams_finish_and_ends_long_ones(start_gateway: Callable[..., Gateway]) -> None:
    grace = 3.0
    gw = start_gateway(grace=grace)
    long_r, short_r = StreamResult(), StreamResult()
    long_on, short_on = threading.Event(), threading.Event()
    # ~6 ms a token on the simulated H100: the long stream needs ~25 s, the short one ~1 s
    tl = threading.Thread(target=read_stream, args=(gw, chat("a long story", 4000), long_r),
                          kwargs={"on_token": lambda n: long_on.set()})
    ts = threading.Thread(target=read_stream, args=(gw, chat("a short one", 150), short_r),
                          kwargs={"on_token": lambda n: short_on.set()})
    tl.start()
    assert long_on.wait(30)
    ts.start()
    assert short_on.wait(30)
    sigterm_at = time.monotonic()
    gw.proc.send_signal(signal.SIGTERM)
    ts.join(30)
    tl.join(30)

    assert short_r.error is None, short_r.error
    assert short_r.done and not short_r.errors and short_r.tokens == 150, "a stream within the grace finishes whole"
    assert long_r.error is None, f"the long stream was cut without an error event: {long_r.error!r}"
    assert long_r.done, "the long stream must end with [DONE]"
    (err,) = long_r.errors
    assert err["code"] == "gateway_shutdown" and err["type"] == "server_error"
    assert long_r.events[-2] == {"error": err}
    ended = (long_r.ended_at or 0) - sigterm_at
    assert grace - 0.5 < ended < grace + 3, f"long stream ended {ended:.2f} s after SIGTERM"
    assert 0 < long_r.tokens < 4000
    assert gw.proc.wait(30) == 0
    poll(lambda: not any(alive(p) for p in gw.workers.values()), 10, "engines to stop")


@pytest.mark.slow
def test_second_signal_ends_streams_at_once(start_gateway: Callable[..., Gateway]) -> None:
    gw = start_gateway(grace=60.0)
    result = StreamResult()
    on = threading.Event()
    t = threading.Thread(target=read_stream, args=(gw, chat("a long story", 4000), result),
                         kwargs={"on_token": lambda n: on.set()})
    t.start()
    assert on.wait(30)
    gw.proc.send_signal(signal.SIGTERM)
    # the listener closes: readiness is off for any new connection
    poll(lambda: _refused(gw.url), 10, "the listener to close")
    assert t.is_alive(), "the stream must still be running within the grace"
    forced_at = time.monotonic()
    gw.proc.send_signal(signal.SIGINT)
    t.join(30)
    assert result.error is None, f"cut without an error event: {result.error!r}"
    assert result.done and [e["code"] for e in result.errors] == ["gateway_shutdown"]
    assert (result.ended_at or 0) - forced_at < 5
    gw.proc.wait(30)
    poll(lambda: not any(alive(p) for p in gw.workers.values()), 10, "engines to stop")


def _refused(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=2)
    except httpx.ConnectError:
        return True
    return False


# --- in-process, over real sockets: readiness while draining, errors without addresses ---

async def test_draining_gateway_reports_shutting_down_and_refuses_new_work(
        stub_upstream: Any, stub_gateway: Any) -> None:
    stub = await stub_upstream(chunks=2, delay_s=0.01)
    url, app = await stub_gateway(stub)
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        assert (await c.get("/health")).status_code == 200
        app.state.tokenfleet.relay.shutdown.begin()
        health = await c.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "shutting_down"
        r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 503 and r.headers["retry-after"]
    assert r.json()["error"]["code"] == "gateway_shutdown"
    assert stub.requests == [], "a draining gateway sends no new work to engines"


async def test_a_stream_waiting_for_its_first_event_when_the_grace_ends_gets_a_503(
        stub_upstream: Any, stub_gateway: Any) -> None:
    # the engine sent its head, not yet an event (a long prefill); the shutdown's grace ends: a 503
    # `gateway_shutdown` (retry it elsewhere), not a stream the gateway "could not relay" (502) and
    # not an engine marked failed
    stub = await stub_upstream(chunks=2, first_delay_s=30.0)
    url, app = await stub_gateway(stub)
    relay = app.state.tokenfleet.relay
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        post = asyncio.ensure_future(c.post("/v1/chat/completions", json=body))
        await wait_until(lambda: relay.shutdown.in_flight == 1, 10, "the dispatch is waiting for its first event")
        relay.shutdown.begin()
        relay.shutdown.expire()
        r = await asyncio.wait_for(post, 10)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "gateway_shutdown"
    assert relay.state.get("i0").failed_at == float("-inf")  # the engine is not blamed


async def test_refused_everywhere_502_names_instances_not_addresses(
        gateway_server: Any, fake_adapter: Any, instance_factory: Any, config_factory: Any,
        refused_url: str) -> None:
    from gateway.app import create_app

    app = create_app(config_factory(), [fake_adapter([instance_factory("a", refused_url),
                                                      instance_factory("b", refused_url)])], poll_interval_s=60)
    url = await gateway_server(app)
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 502
    err = r.json()["error"]
    assert err["code"] == "upstream_error"
    assert re.fullmatch(r"Upstream engine failed: engine instance [ab] refused the connection", err["message"]), err
    assert no_address(r.text), r.text


class _PredictingRouter(InstanceRouter):
    """Lowest instance id first, with a fixed TTFT prediction (what the first-byte deadline scales)."""

    name = "predicting"

    def __init__(self, predicted_ttft_s: float) -> None:
        self.predicted_ttft_s = predicted_ttft_s

    def route(self, profile: Any, candidates: Any, now: float) -> Any:
        from fleetcore.types import RouteDecision

        best = min(c.instance_id for c in candidates)
        return RouteDecision(best, "lowest id", (), predicted_ttft_s=self.predicted_ttft_s)


async def _gateway_with(stubs: dict[str, Any], predicted_ttft_s: float, gateway_server: Any, fake_adapter: Any,
                        instance_factory: Any, config_factory: Any, poll_interval_s: float = 60,
                        **settings: Any) -> str:
    from fleetcore.fleet_config import GatewaySettings
    from gateway.app import create_app

    config = config_factory()
    config = config.model_copy(update={"gateway": GatewaySettings(
        first_byte_timeout_floor_s=0.3, first_byte_timeout_factor=4, stream_idle_timeout_s=5, **settings)})
    adapter = fake_adapter([instance_factory(iid, stub.url) for iid, stub in stubs.items()])
    app = create_app(config, [adapter], router=_PredictingRouter(predicted_ttft_s), poll_interval_s=poll_interval_s)
    return await gateway_server(app)


async def test_first_byte_deadline_is_the_larger_of_floor_and_factor_times_prediction(
        stub_upstream: Any, gateway_server: Any, fake_adapter: Any, instance_factory: Any,
        config_factory: Any) -> None:
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    slow = await stub_upstream(chunks=2, delay_s=0.01, first_delay_s=0.6)
    fast = await stub_upstream(chunks=2, delay_s=0.01)
    # predicted 0.25 s x 4 = 1.0 s > the 0.3 s floor: a first byte at 0.6 s is in time
    url = await _gateway_with({"a": slow, "b": fast}, 0.25, gateway_server, fake_adapter, instance_factory,
                              config_factory)
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.headers["x-tokenfleet-instance"] == "a"
    assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
    # predicted 0.05 s x 4 = 0.2 s < floor: 0.3 s; a first byte at 2 s is a stall, retried on b.
    # (With a first byte at 0.6 s the bound below left 0.3 s for the retry: a loaded machine's
    # scheduling, not the relay, decided it. At 2 s the two outcomes stay far apart.)
    slow2 = await stub_upstream(chunks=2, delay_s=0.01, first_delay_s=2.0)
    url = await _gateway_with({"a": slow2, "b": fast}, 0.05, gateway_server, fake_adapter, instance_factory,
                              config_factory)
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        r = await c.post("/v1/chat/completions", json=body)
        metrics = (await c.get("/metrics")).text
    assert r.status_code == 200 and r.headers["x-tokenfleet-instance"] == "b"
    assert 0.3 <= time.monotonic() - t0 < 2.0  # retried at the 0.3 s deadline, not after a's first byte
    assert 'tokenfleet_upstream_errors_total{instance="a",kind="first_byte_timeout"} 1.0' in metrics
    await asyncio.wait_for(slow2.aborted.wait(), 2)  # the stalled request is aborted on the engine


async def test_non_stream_answer_from_a_live_engine_may_outlast_the_first_byte_deadline(
        stub_upstream: Any, gateway_server: Any, fake_adapter: Any, instance_factory: Any,
        config_factory: Any) -> None:
    # an engine sends a non-streaming answer only when the generation is done; while it passes
    # its health checks, the gateway waits past the first-byte deadline
    stub = await stub_upstream(chunks=4, delay_s=0.2)  # answers after 0.8 s; deadline 0.3 s
    url = await _gateway_with({"a": stub}, 0.0, gateway_server, fake_adapter, instance_factory, config_factory)
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        r = await c.post("/v1/chat/completions", json={"model": "m1", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == " tok0 tok1 tok2 tok3"
    assert len(stub.requests) == 1 and stub.completed == 1


async def test_non_stream_answer_waits_no_longer_than_whole_answer_timeout_s(
        stub_upstream: Any, gateway_server: Any, fake_adapter: Any, instance_factory: Any,
        config_factory: Any) -> None:
    # an engine whose scheduler hangs while its /health still answers: past the first-byte deadline
    # the gateway waits while the health checks pass, but not past whole_answer_timeout_s from the
    # request's arrival (it waited for ever): 504, and the request aborted on the engine
    stub = await stub_upstream(first_delay_s=3600.0)
    url = await _gateway_with({"a": stub}, 0.0, gateway_server, fake_adapter, instance_factory, config_factory,
                              poll_interval_s=0.2, whole_answer_timeout_s=1.5)
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        r = await c.post("/v1/chat/completions", json={"model": "m1", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "upstream_timeout"
    assert 1.5 <= time.monotonic() - t0 < 10.0
    await asyncio.wait_for(stub.aborted.wait(), 5)


async def test_a_whole_answer_larger_than_the_bound_is_a_502_not_the_gateways_memory(
        stub_upstream: Any, gateway_server: Any, fake_adapter: Any, instance_factory: Any,
        config_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # the gateway holds at most MAX_EVENT_BYTES of one engine answer (an engine that never stops
    # sending must not take its memory); here the bound is made small, the answer ~5 kB
    import gateway.relay as relay_module

    monkeypatch.setattr(relay_module, "MAX_EVENT_BYTES", 1000)
    stub = await stub_upstream(chunks=600, delay_s=0.0)
    url = await _gateway_with({"a": stub}, 0.0, gateway_server, fake_adapter, instance_factory, config_factory)
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        r = await c.post("/v1/chat/completions", json={"model": "m1", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 502, r.text
        assert "larger than 1000 bytes" in r.json()["error"]["message"]
        metrics = (await c.get("/metrics")).text
        assert 'tokenfleet_upstream_errors_total{instance="a",kind="answer_too_large"} 1.0' in metrics
        monkeypatch.setattr(relay_module, "MAX_EVENT_BYTES", 1 << 20)
        r = await c.post("/v1/chat/completions", json={"model": "m1", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200 and len(r.content) > 1000  # under the bound: whole, as before


async def test_an_error_answer_that_never_ends_is_read_only_for_its_snippet(
        gateway_server: Any, fake_adapter: Any, instance_factory: Any, config_factory: Any) -> None:
    # A 500 whose body never ends: the gateway keeps a 300-character snippet of an error answer, and
    # used to read the whole body for up to 2 s to get it (GBs over loopback); now it reads the
    # snippet's bytes and closes, so the client's 502 comes at once and carries the snippet.
    from types import SimpleNamespace

    from tests.endless_server import endless_body_server

    async with endless_body_server(b"500 Internal Server Error", b"text/plain", fill=b"e") as engine_url:
        url = await _gateway_with({"a": SimpleNamespace(url=engine_url)}, 0.0, gateway_server, fake_adapter,
                                  instance_factory, config_factory)
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            r = await c.post("/v1/chat/completions", json={"model": "m1", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 502, r.text
    assert "HTTP 500: eeee" in r.json()["error"]["message"]  # the snippet, not a 2 s timeout's nothing
