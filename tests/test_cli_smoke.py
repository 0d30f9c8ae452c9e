"""`tokenfleet up` as a user runs it: a subprocess, its printed URL and key, a streamed answer, a clean stop."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

REPO = Path(__file__).resolve().parents[1]
FLEET_FILE = Path(__file__).with_name("fleet_test.yaml")


def children_of(pid: int) -> set[int]:
    kids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.add(int(entry))
    return kids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def read_until(proc: subprocess.Popen[str], pattern: str, timeout_s: float) -> re.Match[str]:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"tokenfleet exited early; output so far: {seen}")
        seen.append(line)
        m = re.search(pattern, line)
        if m:
            return m
    raise AssertionError(f"no line matching {pattern!r} in {seen}")


@pytest.mark.slow
def test_tokenfleet_up_streams_and_stops_cleanly() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenfleet", "up", "--fleet", str(FLEET_FILE), "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = read_until(proc, r"gateway\s+(http://\S+)", 60).group(1)
        key = read_until(proc, r"api key\s+(\S+)", 5).group(1)
        workers = children_of(proc.pid)
        assert len(workers) == 3

        client = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=30)
        stream = client.chat.completions.create(
            model="llama-3.1-8b", messages=[{"role": "user", "content": "hello"}], max_tokens=10, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text.strip()

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        deadline = time.monotonic() + 5
        while any(alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(w) for w in workers), "worker processes outlived tokenfleet up"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_tokenfleet_up_with_the_planner_on_says_its_cycle() -> None:
    """The start-up banner reads the placement cycle's settings (it once read a removed attribute
    and crashed `up` whenever the planner was on)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenfleet", "up", "--fleet", str(FLEET_FILE.with_name("fleet_planner.yaml")),
         "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert read_until(proc, r"planner\s+every (\S+) s", 60).group(1) == "0.5"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_check_reports_fleet_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "fleet.yaml"
    bad.write_text("sites: []\nmodels: []\n")
    r = subprocess.run([sys.executable, "-m", "tokenfleet", "check", "--fleet", str(bad)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert "sites" in r.stderr and "invalid fleet file" in r.stderr
    ok = subprocess.run([sys.executable, "-m", "tokenfleet", "check"], capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    assert "8 instance(s)" in ok.stdout


@pytest.mark.slow
def test_tokenfleet_up_on_the_local_fleet_prints_a_working_admin_key() -> None:
    """The embedded local fleet's dev admin key is printed (discoverability), and it is the admin's."""
    proc = subprocess.Popen([sys.executable, "-m", "tokenfleet", "up", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = read_until(proc, r"gateway\s+(http://\S+)/v1", 90).group(1)
        tenant_key = read_until(proc, r"api key\s+(\S+)", 5).group(1)
        admin_key = read_until(proc, r"admin key\s+(\S+)", 5).group(1)
        assert admin_key != tenant_key
        admin = httpx.get(f"{url}/admin/v1/fleet", headers={"Authorization": f"Bearer {admin_key}"}, timeout=10)
        assert admin.status_code == 200, admin.text
        tenant = httpx.get(f"{url}/admin/v1/fleet", headers={"Authorization": f"Bearer {tenant_key}"}, timeout=10)
        assert tenant.status_code == 403, tenant.text
        # The README's admin examples run as written against this fleet (only the port differs).
        examples = readme_admin_examples()
        assert len(examples) >= 15
        for line in examples:
            argv = shlex.split(line.replace("localhost:8080", url.removeprefix("http://")))
            done = subprocess.run([*argv, "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "20"],
                                  capture_output=True, text=True, timeout=30)
            assert done.stdout.strip() in ("200", "201"), f"{line} -> {done.stdout} {done.stderr}"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def readme_admin_examples() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = text.split("<!-- admin-examples:", 1)[1].split("<!-- /admin-examples -->", 1)[0]
    return [ln.strip() for ln in block.splitlines() if ln.strip().startswith("curl ")]



async def test_the_servers_main_loop_sleeps_a_second_and_wakes_when_asked_to_exit() -> None:
    """`tokenfleet up`'s server wakes once a second with nothing to do (uvicorn's own: every 0.1 s),
    refreshes the Date header each time, and ends as soon as `should_exit` is set."""
    import asyncio

    import uvicorn

    from gateway.cli import DATE_REFRESH_S, _Server

    async def app(scope, receive, send):  # never called
        raise AssertionError

    server = _Server(uvicorn.Config(app, lifespan="off"))
    server.config.load()
    ticks: list[int] = []
    on_tick = server.on_tick

    async def counted(counter: int) -> bool:
        ticks.append(counter)
        return await on_tick(counter)

    server.on_tick = counted  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    task = asyncio.create_task(server.main_loop())
    await asyncio.sleep(DATE_REFRESH_S * 2.5)
    assert 2 <= len(ticks) <= 4  # ~1 a second, not 10
    assert all(c % 10 == 0 for c in ticks)  # each one refreshes the Date header
    assert any(name == b"date" for name, _ in server.server_state.default_headers)
    asked = loop.time()
    server.should_exit = True
    await asyncio.wait_for(task, 5)
    assert loop.time() - asked < 0.5 and loop.time() - t0 < 10
