"""A redis-server of a test's own, on a fixed port, that the test can restart empty, kill,
and stop (SIGSTOP: it accepts connections and never answers) — the policy store's failures."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis as redis_sync


class RedisProc:
    def __init__(self, directory: Path) -> None:
        exe = shutil.which("redis-server")
        assert exe is not None, "redis-server is not installed"
        self.exe = exe
        self.dir = directory
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False

    def start(self) -> None:
        """A fresh, empty server (no persistence: a restart loses everything)."""
        self.proc = subprocess.Popen([self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.dir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with redis_sync.Redis(port=self.port, socket_timeout=0.5) as r:
                    r.ping()
                return
            except redis_sync.RedisError:
                assert time.monotonic() < deadline and self.proc.poll() is None, "redis-server did not start"
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.paused:
            self.resume()
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:  # a hung Redis: accepts connections, never answers
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)
        self.paused = False

    def client(self) -> redis_sync.Redis:
        return redis_sync.Redis(port=self.port, socket_timeout=2, decode_responses=True)
