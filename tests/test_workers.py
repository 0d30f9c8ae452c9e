"""Several gateway worker processes on one port, with real processes: `tokenfleet up --workers 2`
(SO_REUSEPORT), its private redis-server, the fleet's simulated workers launched once. Requests
on fresh connections spread over the workers (the kernel balances), a tenant's budget holds
across them (shared through Redis, as for replicas), a hung worker (SIGSTOP) is killed and
restarted while one whose loop runs (serving, or draining its streams) never is
(`gateway.liveness`, with a 2 s timeout here), and SIGTERM stops every process it started.
One deployment for the module; the SIGTERM test stops it, so it runs last."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml

from tests.replicas import FLEET, REPO, START_TIMEOUT_S, alive, descendants, free_port

KEY = {"authorization": "Bearer sk-test-acme"}
CAPPED = {"authorization": "Bearer sk-test-capped"}
MODEL = "llama-3.1-8b"
N = 2
LIVENESS_TIMEOUT_S = 2.0
LOOK_S = LIVENESS_TIMEOUT_S / 4  # the supervisor looks at a heartbeat this often: a kill is at most this late
BACKOFF_S = 0.2
GRACE_S = 20.0  # a SIGTERMed worker's drain: far longer than the stream the drain test leaves it


@dataclass
class Workers:
    proc: subprocess.Popen[str]
    url: str
    pids: dict[int, int] = field(default_factory=dict)  # worker index -> pid
    lines: list[str] = field(default_factory=list)
    q: queue.Queue[str | None] = field(default_factory=queue.Queue)

    def wait_line(self, want: str | Callable[[str], bool], timeout_s: float) -> str:
        """The first line from now on equal to `want` (or matching it)."""
        pred = want if callable(want) else want.__eq__
        deadline = time.monotonic() + timeout_s
        while True:
            line = self._next(deadline)
            if line is not None and pred(line):
                return line
            if time.monotonic() > deadline:
                raise AssertionError(f"no {want!r} in {timeout_s:.0f} s; output:\n" + "\n".join(self.lines))

    def no_line(self, pred: Callable[[str], bool], for_s: float) -> None:
        """Watch the output for `for_s` (a window in which something must NOT happen); fails on a
        line matching `pred`."""
        deadline = time.monotonic() + for_s
        while time.monotonic() < deadline:
            line = self._next(deadline)
            assert line is None or not pred(line), f"{line!r}; output:\n" + "\n".join(self.lines)

    def _next(self, deadline: float) -> str | None:
        """The next line, or None when none came by `deadline`."""
        try:
            line = self.q.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            return None
        if line is None:
            raise AssertionError("tokenfleet up exited; output:\n" + "\n".join(self.lines))
        self.lines.append(line)
        # "tokenfleet: gateway  worker 1 (pid 123)  http://127.0.0.1:8080/v1[ (restart 1)]"
        if line.startswith("tokenfleet: gateway  worker "):
            words = line.split()
            self.pids[int(words[3])] = int(words[5].rstrip(")"))
        return line


@pytest.fixture(scope="module")
def fleet_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The replicas' test fleet with a short liveness timeout and restart backoff, and a grace
    long enough that a draining worker is never cut by it."""
    body = yaml.safe_load(FLEET.read_text())
    body["gateway"].update(liveness_timeout_s=LIVENESS_TIMEOUT_S, engine_restart_backoff_s=BACKOFF_S,
                           engine_restart_backoff_max_s=1.0, shutdown_grace_s=GRACE_S)
    path = tmp_path_factory.mktemp("workers") / "fleet.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


@pytest.fixture(scope="module")
def workers(fleet_file: Path) -> Iterator[Workers]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "TOKENFLEET_REDIS_URL"}
    proc = subprocess.Popen([sys.executable, "-m", "tokenfleet.cli", "up", "--workers", str(N), "--fleet", str(fleet_file),
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


def _killed(line: str) -> bool:
    return "sent no heartbeat" in line


def _gone(line: str) -> bool:
    return _killed(line) or " exited with code " in line


def _restarted(index: int) -> Callable[[str], bool]:
    return lambda line: line.startswith(f"tokenfleet: gateway  worker {index} ")


def test_workers_whose_loops_run_are_never_killed(workers: Workers) -> None:
    """Three liveness timeouts of serving on both workers: their loops beat, nobody is killed."""
    pids = dict(workers.pids)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    served: set[str] = set()
    until = time.monotonic() + 3 * LIVENESS_TIMEOUT_S
    with fresh_client() as c:
        while time.monotonic() < until:
            r = c.post(workers.url + "/v1/chat/completions", headers=KEY, json=body)
            assert r.status_code == 200, r.text
            served.add(r.headers["x-tokenfleet-worker"])
            workers.no_line(_gone, 0.05)
    workers.no_line(_gone, LOOK_S)  # the looks that were due when the window closed
    assert served == {f"worker{i}" for i in range(N)} and workers.pids == pids, (served, workers.lines)


def test_a_worker_draining_its_streams_is_not_killed(workers: Workers) -> None:
    """SIGTERM to a worker with a stream in flight that outlasts the liveness timeout: its loop beats
    through the whole drain (the heartbeat outlives the server and the app's lifespan), so the
    stream ends normally and the worker exits 0 and is restarted; never killed mid-drain."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 600, "ignore_eos": True,
            "stream": True}
    with fresh_client() as c, c.stream("POST", workers.url + "/v1/chat/completions", headers=KEY, json=body) as r:
        assert r.status_code == 200
        index = int(r.headers["x-tokenfleet-worker"].removeprefix("worker"))
        os.kill(workers.pids[index], signal.SIGTERM)
        t0 = time.monotonic()
        text = "".join(r.iter_text())
    drained_s = time.monotonic() - t0
    assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text, text[-300:]
    # long enough that a worker silent while draining would have been killed under it
    assert drained_s > LIVENESS_TIMEOUT_S + LOOK_S, drained_s
    line = workers.wait_line(lambda s: _killed(s) or s.startswith(f"tokenfleet: worker {index} (port "), 30)
    assert " exited with code 0;" in line, line
    workers.wait_line(_restarted(index), START_TIMEOUT_S)
    print(f"drained for {drained_s:.2f} s with a {LIVENESS_TIMEOUT_S:g} s liveness timeout, not killed")


def test_a_stopped_worker_is_killed_and_restarted_and_serves_again(workers: Workers) -> None:
    """SIGSTOP (a loop that never runs again): killed within the timeout and a look, restarted after
    the backoff, and the port's connections reach the new worker."""
    index, pid = 0, workers.pids[0]
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        line = workers.wait_line(_killed, LIVENESS_TIMEOUT_S + 10)
        killed_s = time.monotonic() - t0
        assert re.fullmatch(rf"tokenfleet: worker {index} \(pid {pid}\) sent no heartbeat for \d+ s: killed", line), line
        assert LIVENESS_TIMEOUT_S - 2 * LOOK_S <= killed_s <= LIVENESS_TIMEOUT_S + LOOK_S + 1.0, killed_s
        line = workers.wait_line(_gone, 5)
        assert f"worker {index} (port " in line and "exited with code -9;" in line, line
        restart = workers.wait_line(_restarted(index), START_TIMEOUT_S)
        restarted_s = time.monotonic() - t0
        assert restart.endswith("after a missed heartbeat)") and workers.pids[index] != pid, restart
        assert not alive(pid)
    finally:
        if alive(pid):  # the test failed before the kill: leave no stopped process to the teardown
            os.kill(pid, signal.SIGKILL)
    one = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    with fresh_client() as c:
        for _ in range(40):  # fresh connections: each reaches worker 0 with probability 1/2
            r = c.post(workers.url + "/v1/chat/completions", headers=KEY, json=one)
            assert r.status_code == 200, r.text
            if r.headers["x-tokenfleet-worker"] == f"worker{index}":
                break
        else:
            raise AssertionError(f"40 connections, none served by the restarted worker {index}")
    served_s = time.monotonic() - t0
    print(f"SIGSTOP -> killed {killed_s:.2f} s -> restarted {restarted_s:.2f} s -> served by it {served_s:.2f} s")


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
