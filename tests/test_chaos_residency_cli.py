"""The residency story as an operator lives it: `tokenfleet up --redis-url` (a subprocess over sim
workers), an EU-only policy set through the admin API, then Redis hung, the gateway restarted
against the hung Redis, Redis restarted empty. eu-team enters from us-east, so any request of
it served in `east` is a residency breach.

Before this change: admin calls hung behind the stopped Redis, the restarted gateway served
eu-team in `east` (fleet-file policies, no snapshot), and the empty Redis was re-seeded at
version 1 with no policies.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.redis_control import RedisProc
from tests.test_cli_smoke import read_until

ADMIN = {"Authorization": "Bearer sk-admin"}
EU_TEAM = {"Authorization": "Bearer sk-eu", "x-tokenfleet-region": "us-east"}
STORE_TIMEOUT_S = 0.2  # well under the 1 s default: the admin timing below shows the CLI passes it on
MODEL = "llama-3.1-8b"


def fleet_file(tmp_path: Path) -> Path:
    sim = {"gpu": "H100", "adapter": "sim", "instances": 1, "options": {"time_scale": 0.05}}
    body = {
        "regions": ["us-east", "eu-west"], "default_region": "us-east",
        "sites": [{"name": "east", "region": "us-east", "jurisdiction": "us", "rtt_ms": {"us-east": 1, "eu-west": 70}},
                  {"name": "west", "region": "eu-west", "jurisdiction": "eu", "rtt_ms": {"us-east": 70, "eu-west": 1}}],
        "models": [{"name": MODEL, "versions": ["v1"],
                    "engine": {"spec": "llama-3.1-8b", "max_model_len": 8192, "block_size": 16}}],
        "deployments": [{"site": "east", "model": MODEL, **sim}, {"site": "west", "model": MODEL, **sim}],
        "tenants": [{"name": "eu-team", "api_keys": ["sk-eu"], "region": "us-east"}],
        "admin_api_keys": ["sk-admin"],
        "planner": {"enabled": False},
        "gateway": {"store_timeout_s": STORE_TIMEOUT_S, "state_dir": str(tmp_path / "state")},
    }
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


class Gateway:
    def __init__(self, fleet: Path, redis_url: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenfleet", "up", "--fleet", str(fleet), "--port", "0", "--redis-url", redis_url],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.url = read_until(self.proc, r"gateway\s+(http://\S+)/v1", 60).group(1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def redis_proc(tmp_path: Path) -> Iterator[RedisProc]:
    r = RedisProc(tmp_path)
    r.start()
    try:
        yield r
    finally:
        r.stop()


def eu_sites(c: httpx.Client, url: str, n: int) -> dict[tuple[int, str | None], int]:
    out: dict[tuple[int, str | None], int] = {}
    for _ in range(n):
        r = c.post(f"{url}/v1/completions", headers=EU_TEAM, json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
        key = (r.status_code, r.headers.get("x-tokenfleet-site"))
        out[key] = out.get(key, 0) + 1
    return out


@pytest.mark.slow
def test_tokenfleet_up_keeps_eu_team_in_the_eu_through_redis_failures(tmp_path: Path, redis_proc: RedisProc) -> None:
    fleet = fleet_file(tmp_path)
    c = httpx.Client(timeout=10)
    gw = Gateway(fleet, redis_proc.url)
    try:
        assert eu_sites(c, gw.url, 3) == {(200, "east"): 3}  # no policy yet: the nearest site
        r = c.put(f"{gw.url}/admin/v1/region-policies/eu-team/*", headers=ADMIN, json={"allowed_jurisdictions": ["eu"]})
        assert r.status_code == 201 and r.json()["version"] == 2
        assert eu_sites(c, gw.url, 20) == {(200, "west"): 20}

        redis_proc.pause()  # hung
        t0 = time.monotonic()
        r = c.get(f"{gw.url}/admin/v1/region-policies", headers=ADMIN)
        took = time.monotonic() - t0
        assert r.status_code == 503 and r.json()["error"]["code"] == "policy_store_unavailable"
        assert r.headers["retry-after"] and took < 0.9, took  # 1 s (the default) would fail
        assert eu_sites(c, gw.url, 20) == {(200, "west"): 20}
        gw.stop()

        gw = Gateway(fleet, redis_proc.url)  # restarted while Redis still hangs: from its snapshot
        assert eu_sites(c, gw.url, 20) == {(200, "west"): 20}

        redis_proc.stop()  # Redis restarted empty
        redis_proc.start()
        deadline = time.monotonic() + 10
        while True:
            r = c.get(f"{gw.url}/admin/v1/region-policies", headers=ADMIN)
            if r.status_code == 200:
                break
            assert time.monotonic() < deadline, r.text
            time.sleep(0.05)
        assert r.json()["version"] == 2 and r.json()["policies"][0]["allowed_jurisdictions"] == ["eu"]
        assert c.get(f"{gw.url}/admin/v1/audit", headers=ADMIN).json()["entries"][0]["action"] == "restore"
        assert eu_sites(c, gw.url, 20) == {(200, "west"): 20}
    finally:
        gw.stop()
        c.close()
