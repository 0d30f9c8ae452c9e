"""The HAProxy config: committed example in step with the generator, valid for the real haproxy,
and the settings streaming and non-idempotent POSTs depend on."""

from __future__ import annotations

import subprocess
from pathlib import Path

from gateway.haproxy_config import render
from tests.replicas import REPO, haproxy_exe

EXAMPLE = REPO / "deploy" / "haproxy" / "haproxy.cfg"


def test_committed_example_is_the_generators_output() -> None:
    assert EXAMPLE.read_text() == render([("127.0.0.1", 8080 + i) for i in range(3)], "*:8000"), \
        "regenerate: python -m gateway.haproxy_config --replicas 3 --port 8080 > deploy/haproxy/haproxy.cfg"


def test_haproxy_accepts_it(tmp_path: Path) -> None:
    cfg = tmp_path / "h.cfg"
    cfg.write_text(render([("127.0.0.1", 9000), ("::1", 9001)], "127.0.0.1:8000", stats_bind="127.0.0.1:8001"))
    r = subprocess.run([haproxy_exe(), "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "WARNING" not in r.stderr, r.stderr


def test_streaming_and_retry_settings() -> None:
    lines = {line.strip() for line in render([("127.0.0.1", 8080)], "*:8000").splitlines()}
    assert "retry-on conn-failure" in lines  # never re-send a POST that reached a replica
    assert not any(x.startswith("retry-on") and x != "retry-on conn-failure" for x in lines)
    assert "http-check send meth GET uri /health" in lines and "http-check expect status 200" in lines
    assert not any("http-buffer-request" in x or x.startswith("compression") for x in lines)
    assert not any("shutdown-sessions" in x for x in lines)  # a draining replica keeps its streams
    server = next(x for x in lines if x.startswith("timeout server "))
    assert int(server.split()[2].rstrip("s")) >= 300
    assert "server replica0 127.0.0.1:8080 check" in lines
