"""Several gateway worker processes on one port, with real processes: `tokenfleet up --workers 2`
(SO_REUSEPORT), its private redis-server, the fleet's simulated workers launched once. Requests
on fresh connections spread over the workers (the kernel balances), a tenant's budget holds
across them (shared through Redis, as for replicas), and SIGTERM stops every process it started.
One deployment for the module; the SIGTERM test stops it, so it runs last."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.replicas import FLEET, REPO, START_TIMEOUT_S, alive, descendants, free_port

KEY = {"authorization": "Bearer sk-test-acme"}
CAPPED = {"authorization": "Bearer sk-test-capped"}
MODEL = "llama-3.1-8b"
N = 2


@dataclass
class Workers:
    proc: subprocess.Popen[str]
    url: str
    pids: dict[int, int] = field(default_factory=dict)  # worker index -> pid
    lines: list[str] = field(default_factory=list)
    q: queue.Queue[str | None] = field(default_factory=queue.Queue)

    def wait_line(self, want: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                line = ""
            if line is None:
                raise AssertionError("tokenfleet up exited; output:\n" + "\n".join(self.lines))
            if line:
                self.lines.append(line)
                # "tokenfleet: gateway  worker 1 (pid 123)  http://127.0.0.1:8080/v1"
                if line.startswith("tokenfleet: gateway  worker "):
                    words = line.split()
                    self.pids[int(words[3])] = int(words[5].rstrip(")"))
                if line == want:
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"no {want!r} in {timeout_s:.0f} s; output:\n" + "\n".join(self.lines))


@pytest.fixture(scope="module")
def workers() -> Iterator[Workers]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "TOKENFLEET_REDIS_URL"}
    proc = subprocess.Popen([sys.executable, "-m", "tokenfleet.cli", "up", "--workers", str(N), "--fleet", str(FLEET),
                             "--port", str(port)], cwd=REPO, stdout=subprocess.PIPE, text=True, bufsize=1,
                            env={**env, "PYTHONUNBUFFERED": "1"})
    w = Workers(proc, f"http://127.0.0.1:{port}")

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            w.q.put(line.rstrip("\n"))
        w.q.put(None)
    threading.Thread(target=read, daemon=True).start()
    try:
        w.wait_line("tokenfleet: stop with Ctrl-C", START_TIMEOUT_S)
        assert sorted(w.pids) == list(range(N)), w.lines
        yield w
    finally:
        if proc.poll() is None:
            left = descendants(proc.pid)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                for pid in [proc.pid, *left]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                proc.wait(timeout=10)


def fresh_client() -> httpx.Client:
    """A connection per request, so the kernel's SO_REUSEPORT balancing chooses a worker each time."""
    return httpx.Client(timeout=30, limits=httpx.Limits(max_keepalive_connections=0))


def test_requests_spread_over_workers_on_one_port(workers: Workers) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    seen: list[str] = []
    with fresh_client() as c:
        for _ in range(24):
            r = c.post(workers.url + "/v1/chat/completions", headers=KEY, json=body)
            assert r.status_code == 200, r.text
            assert "data: [DONE]" in r.text
            seen.append(r.headers["x-tokenfleet-worker"])
    # 24 connections hashed over 2 listeners: all on one would be a 2^-23 chance
    assert set(seen) == {f"worker{i}" for i in range(N)}, seen


def test_budget_holds_across_workers(workers: Workers) -> None:
    """Tenant `capped` may make 12 requests/minute; spread over the workers it still gets at most
    that (plus its refill and one per worker of slack) and at least 0.9 of it."""
    rpm, sent = 12, 36
    one = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    statuses: list[int] = []
    served_by: set[str] = set()
    t0 = time.monotonic()
    with fresh_client() as c:
        for _ in range(sent):
            r = c.post(workers.url + "/v1/chat/completions", headers=CAPPED, json=one)
            statuses.append(r.status_code)
            if r.status_code == 200:
                served_by.add(r.headers["x-tokenfleet-worker"])
    elapsed = time.monotonic() - t0
    admitted = statuses.count(200)
    assert set(statuses) <= {200, 429}, statuses
    assert len(served_by) == N, served_by  # really spread: one worker's own bucket would not prove it
    assert 0.9 * rpm <= admitted <= rpm + rpm * elapsed / 60 + N, (admitted, elapsed)


def test_sigterm_stops_every_worker_and_what_they_share(workers: Workers) -> None:
    # last in the module: it stops the deployment
    started = descendants(workers.proc.pid)
    assert set(workers.pids.values()) <= started
    redis = {p for p in started if "redis-server" in Path(f"/proc/{p}/cmdline").read_text()}
    assert len(redis) == 1, started  # the private Redis the workers share
    assert len(started) >= N + 3 + 1, started  # workers + 3 simulated engines + Redis
    workers.proc.send_signal(signal.SIGTERM)
    assert workers.proc.wait(timeout=60) == 0
    workers.wait_line("tokenfleet: stopped", 5)
    left = {p for p in started if alive(p)}
    assert not left, f"left running after SIGTERM: {left}"


def test_workers_refused_without_redis(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TOKENFLEET_REDIS_URL"}
    env["PATH"] = str(tmp_path)  # no redis-server to start
    r = subprocess.run([sys.executable, "-m", "tokenfleet.cli", "up", "--workers", "2", "--fleet", str(FLEET),
                        "--port", "0"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r
    assert "--workers 2 needs a Redis" in r.stdout and "--redis-url" in r.stdout, r.stdout
    assert "launching" not in r.stdout


def test_workers_and_replicas_do_not_combine() -> None:
    r = subprocess.run([sys.executable, "-m", "tokenfleet.cli", "up", "--workers", "2", "--replicas", "2",
                        "--fleet", str(FLEET), "--port", "0"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "do not combine" in r.stdout, r
