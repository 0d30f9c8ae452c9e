"""An 8 MB prompt (under the body limit, far over the context) against a real `tokenfleet up`.

Before: the whole prompt was tokenized before the context check (seconds of CPU holding the
GIL, hundreds of MB of pieces), so other tenants' requests stalled and health polls missed.
Now the prompt is rejected from its length alone, off the event loop: the big request gets
a 400 at once, another tenant's small requests keep getting 200 with no stall, and the
gateway's peak memory barely moves.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

FLEET = """
sites:
  - {name: use1, region: us-east, jurisdiction: us, rtt_ms: {us-east: 1}}
models:
  - {name: m1, engine: {spec: llama-3.1-8b, max_model_len: 32768, block_size: 16}}
deployments:
  - {site: use1, model: m1, instances: 1, gpu: H100, adapter: sim}
tenants:
  - {name: big, api_keys: [sk-big]}
  - {name: small, api_keys: [sk-small]}
admin_api_keys: [sk-admin]
"""
BIG_PROMPT = "a " * 4_000_000  # 8 MB, 4M one-letter words; the body stays under the 8 MiB limit
SMALL = {"model": "m1", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


def _status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM of `pid` in kB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name] = int(value.split()[0])
    return out


def _read_url(proc: subprocess.Popen[str], timeout_s: float) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    seen: list[str] = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"tokenfleet exited early: {seen}")
        seen.append(line)
        m = re.search(r"gateway\s+(http://\S+)", line)
        if m:
            return m.group(1).rstrip("/").removesuffix("/v1")
    raise AssertionError(f"no gateway URL in {seen}")


async def _wait_ready(c: httpx.AsyncClient, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if (await c.get(f"{url}/health")).json()["ready_instances"] >= 1:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError("the fleet never became ready")


async def _small_loop(c: httpx.AsyncClient, url: str, stop: asyncio.Event,
                      out: list[tuple[int, float]]) -> None:
    headers = {"Authorization": "Bearer sk-small"}
    while not stop.is_set():
        t = time.monotonic()
        r = await c.post(f"{url}/v1/chat/completions", json=SMALL, headers=headers)
        out.append((r.status_code, time.monotonic() - t))


async def _oversized_run(url: str, pid: int) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=60) as c:
        await _wait_ready(c, url, 60)
        warm: list[tuple[int, float]] = []
        for _ in range(5):  # warm the path (first requests pay imports and connection set-up)
            r = await c.post(f"{url}/v1/chat/completions", json=SMALL, headers={"Authorization": "Bearer sk-small"})
            assert r.status_code == 200, r.text
        before = _status(pid)
        stop = asyncio.Event()
        small: list[tuple[int, float]] = []
        loops = [asyncio.create_task(_small_loop(c, url, stop, small)) for _ in range(2)]
        big_body = json.dumps({"model": "m1", "messages": [{"role": "user", "content": BIG_PROMPT}]})
        assert len(big_body) < 8 * 1024 * 1024
        results = []
        for path, body in (("/v1/chat/completions", big_body),
                           ("/v1/completions", json.dumps({"model": "m1", "prompt": BIG_PROMPT}))):
            t = time.monotonic()
            r = await c.post(f"{url}{path}", content=body, headers={"Authorization": "Bearer sk-big",
                                                                     "Content-Type": "application/json"})
            results.append((r.status_code, r.json()["error"], time.monotonic() - t))
        n = len(small)
        while len(small) < n + 5:  # a few more after the big ones, then stop
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.gather(*loops)
        health = (await c.get(f"{url}/health")).json()
        return {"big": results, "small": small, "before": before, "after": _status(pid), "health": health}


@pytest.mark.slow
def test_an_8mb_prompt_is_refused_at_once_and_other_tenants_keep_being_served(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(FLEET)
    proc = subprocess.Popen([sys.executable, "-m", "tokenfleet", "up", "--fleet", str(fleet), "--port", "0",
                             "--no-planner"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = _read_url(proc, 60)
        res = asyncio.run(_oversized_run(url, proc.pid))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    latencies = sorted(t for _, t in res["small"])
    print(f"\nbig: {[(s, round(t, 3)) for s, _, t in res['big']]}; small: n={len(latencies)} "
          f"p50={latencies[len(latencies) // 2]:.3f}s max={latencies[-1]:.3f}s; "
          f"RSS {res['before']['VmRSS'] // 1024} -> {res['after']['VmRSS'] // 1024} MB, "
          f"peak {res['before']['VmHWM'] // 1024} -> {res['after']['VmHWM'] // 1024} MB")
    for status, error, elapsed in res["big"]:
        assert status == 400 and error["code"] == "context_length_exceeded", error
        assert "at least" in error["message"]
        assert elapsed < 3.0, f"the oversized prompt took {elapsed:.2f}s to be refused"
    assert all(s == 200 for s, _ in res["small"]), [s for s, _ in res["small"] if s != 200]
    # no stall: the other tenant's requests are never held up by the big one
    assert latencies[-1] < 0.5, f"a small request took {latencies[-1]:.2f}s"
    assert res["health"]["ready_instances"] == 1
    # the peak resident set grows by the bodies themselves (a few copies of 8 MB), not by
    # a tokenization of them (hundreds of MB)
    grown_mb = (res["after"]["VmHWM"] - res["before"]["VmHWM"]) / 1024
    assert grown_mb < 120, f"peak RSS grew by {grown_mb:.0f} MB"
