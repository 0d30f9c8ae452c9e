"""A real multi-replica deployment for tests: `tokenfleet up --replicas N` as a subprocess, with a
real Redis (tests/redis_server.py) and the real `haproxy` in front, using the config the CLI wrote.

Reusable by any test that needs several replicas of one fleet (policies, budgets, goodput
reports agreeing across replicas): `with replica_fleet(3) as fleet:` gives every replica's URL
and pid, HAProxy's URL and its view of the replicas, the Redis URL and the process tree."""

from __future__ import annotations

import contextlib
import csv
import io
import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests.redis_server import redis_url as private_redis_url

REPO = Path(__file__).resolve().parent.parent
FLEET = REPO / "tests" / "fleet_replicas.yaml"
START_TIMEOUT_S = 90.0  # workers + N replicas loading on a shared 2-core machine
STOP_TIMEOUT_S = 60.0


def free_port_block(n: int, host: str = "127.0.0.1", tries: int = 200) -> int:
    """A base port with `n` consecutive free ports (the CLI puts replicas on consecutive ports)."""
    for _ in range(tries):
        base = random.randint(20000, 45000)
        socks: list[socket.socket] = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind((host, p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports found")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc), so a test can check none outlives a stop."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:  # a process may end between the listing and the read
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper has ended and holds nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@dataclass
class ReplicaFleet:
    proc: subprocess.Popen[str]
    redis_url: str
    lb_url: str  # HAProxy, in front of every replica
    stats_url: str  # HAProxy's stats (CSV at `;csv`)
    haproxy_config: Path
    urls: dict[int, str] = field(default_factory=dict)  # replica index -> base URL (no /v1)
    pids: dict[int, int] = field(default_factory=dict)  # replica index -> its current pid
    lines: list[str] = field(default_factory=list)  # everything `tokenfleet up` printed
    _queue: queue.Queue[str | None] = field(default_factory=queue.Queue)

    # -- the CLI's output ------------------------------------------------------------
    def wait_line(self, pred: Callable[[str], bool], timeout_s: float) -> str:
        """The first line from now on matching `pred`; fails with the output so far otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no matching line in {timeout_s:.0f} s; output:\n" + "\n".join(self.lines))
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError("tokenfleet up exited; output:\n" + "\n".join(self.lines))
            self.lines.append(line)
            self._note(line)
            if pred(line):
                return line

    def _note(self, line: str) -> None:
        # "tokenfleet: gateway  replica 1 (pid 123)  http://127.0.0.1:8081/v1"
        if line.startswith("tokenfleet: gateway  replica "):
            words = line.split()
            index, pid = int(words[3]), int(words[5].rstrip(")"))
            self.urls[index] = words[6].removesuffix("/v1")
            self.pids[index] = pid

    # -- HAProxy's view -----------------------------------------------------------------
    def server_rows(self) -> dict[str, dict[str, str]]:
        """HAProxy's stats row per replica server (`replica0`: its CSV fields)."""
        with urllib.request.urlopen(self.stats_url + ";csv", timeout=5) as r:
            text = r.read().decode().lstrip("# ")
        return {row["svname"]: row for row in csv.DictReader(io.StringIO(text))
                if row["pxname"] == "gateways" and row["svname"] not in ("FRONTEND", "BACKEND")}

    def server_status(self) -> dict[str, str]:
        """HAProxy's status per replica server (`replica0`: UP / DOWN / UP 1/2 ...)."""
        return {name: row["status"] for name, row in self.server_rows().items()}

    def wait_up(self, servers: Iterable[str], timeout_s: float, haproxy: subprocess.Popen[bytes] | None = None) -> None:
        """Until HAProxy takes traffic to every one of `servers` because a health check of it passed
        (`passed_check`); fails with HAProxy's view otherwise (or at once if `haproxy` exits)."""
        want = set(servers)
        deadline = time.monotonic() + timeout_s
        rows: dict[str, dict[str, str]] = {}
        while True:
            try:
                rows = self.server_rows()
                if want <= rows.keys() and all(passed_check(rows[s]) for s in want):
                    return
            except OSError:  # the stats page is not up yet
                pass
            if haproxy is not None and haproxy.poll() is not None:
                raise AssertionError(f"haproxy exited: {haproxy.stderr.read().decode() if haproxy.stderr else ''}")
            if time.monotonic() > deadline:
                seen = {s: (r.get("status"), r.get("check_status")) for s, r in rows.items()}
                raise AssertionError(f"HAProxy did not pass a check of every one of {sorted(want)} in {timeout_s} s: {seen}")
            time.sleep(0.1)

    def wait_status(self, server: str, prefix: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.server_status()
            if status.get(server, "").startswith(prefix):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"HAProxy: {server} is {status.get(server)!r}, not {prefix} after {timeout_s} s")
            time.sleep(0.1)

    def tree(self) -> set[int]:
        return descendants(self.proc.pid)


def passed_check(row: Mapping[str, str]) -> bool:
    """HAProxy's stats row says the server is fully UP and its last health check passed. Not
    just "UP": HAProxy starts every server as "UP 1/2" before checking it (check status INI), so
    traffic sent then reaches a replica whose first check may yet fail (a replica still in its
    start-up: a timeout), and the server is DOWN until `rise` checks pass again."""
    return row.get("status") == "UP" and row.get("check_status", "").lstrip("* ") == "L7OK"


def _reader(proc: subprocess.Popen[str], q: queue.Queue[str | None]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        q.put(line.rstrip("\n"))
    q.put(None)


def haproxy_exe() -> str:
    exe = shutil.which("haproxy") or ("/usr/sbin/haproxy" if os.path.exists("/usr/sbin/haproxy") else None)
    if exe is None:
        raise AssertionError("haproxy is not installed (apt-get install haproxy; .ci/run installs it)")
    return exe


@contextmanager
def replica_fleet(n: int = 3, fleet: Path = FLEET, extra: list[str] | None = None,
                  shared_redis: bool = True) -> Iterator[ReplicaFleet]:
    """`tokenfleet up --replicas n` + HAProxy on the config it wrote; stopped (and checked) after.

    `shared_redis=False`: no --redis-url, so the CLI starts its private redis-server."""
    from gateway.haproxy_config import stats_section
    exe = haproxy_exe()
    with (private_redis_url() if shared_redis else contextlib.nullcontext("")) as redis, \
            tempfile.TemporaryDirectory(prefix="tf-replicas-") as tmp:
        base, lb_port, stats_port = free_port_block(n), free_port(), free_port()
        cfg = Path(tmp) / "haproxy.cfg"
        argv = [sys.executable, "-m", "tokenfleet.cli", "up", "--replicas", str(n), "--fleet", str(fleet),
                "--port", str(base), *(["--redis-url", redis] if redis else []), "--haproxy-config", str(cfg),
                "--haproxy-bind", f"127.0.0.1:{lb_port}", *(extra or [])]
        env = {k: v for k, v in os.environ.items() if k != "TOKENFLEET_REDIS_URL"}
        proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, text=True, bufsize=1,
                                env={**env, "PYTHONUNBUFFERED": "1"})
        fleet_ = ReplicaFleet(proc, redis, f"http://127.0.0.1:{lb_port}", f"http://127.0.0.1:{stats_port}/stats", cfg)
        threading.Thread(target=_reader, args=(proc, fleet_._queue), daemon=True).start()
        haproxy: subprocess.Popen[bytes] | None = None
        try:
            fleet_.wait_line(lambda s: s == "tokenfleet: stop with Ctrl-C", START_TIMEOUT_S)
            assert sorted(fleet_.urls) == list(range(n)), fleet_.lines
            # The CLI's config as written, plus a stats page for the test to read HAProxy's view.
            cfg.write_text(cfg.read_text() + stats_section(f"127.0.0.1:{stats_port}"))
            haproxy = subprocess.Popen([exe, "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.PIPE)
            fleet_.wait_up([f"replica{i}" for i in range(n)], 20, haproxy)  # up: a health check of each passed
            yield fleet_
        finally:
            if haproxy is not None:
                haproxy.terminate()
                haproxy.wait(timeout=10)
            if proc.poll() is None:
                left = fleet_.tree()
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    for pid in [proc.pid, *left]:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                    proc.wait(timeout=10)
                    raise AssertionError("tokenfleet up did not stop on SIGTERM") from None
