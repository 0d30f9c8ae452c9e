"""Several gateway replicas, one fleet, with real processes: `tokenfleet up --replicas 3`, real
HAProxy (the config the CLI writes), real Redis. One deployment for the module (starting it is
the expensive part on a shared machine); the SIGTERM test stops it, so it runs last."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.replicas import FLEET, REPO, ReplicaFleet, alive, replica_fleet

KEY = {"authorization": "Bearer sk-test-acme"}
ADMIN = {"authorization": "Bearer sk-test-admin"}
MODEL = "llama-3.1-8b"


@pytest.fixture(scope="module")
def fleet() -> Iterator[ReplicaFleet]:
    with replica_fleet(3) as f:
        yield f


@dataclass
class Stream:
    status: int = 0
    replica: str = ""
    chunks: int = 0
    done: bool = False  # saw `data: [DONE]`
    error: str = ""  # an SSE error event or a cut connection
    first: asyncio.Event | None = None


def body(max_tokens: int) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "tell me about replicas"}],
            "max_tokens": max_tokens, "stream": True}


async def stream(client: httpx.AsyncClient, url: str, max_tokens: int, s: Stream) -> Stream:
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body(max_tokens), headers=KEY) as r:
            s.status, s.replica = r.status_code, r.headers.get("x-tokenfleet-replica", "")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if s.first is not None:
                    s.first.set()
                if line == "data: [DONE]":
                    s.done = True
                elif "error" in json.loads(line[6:]):
                    s.error = line
                else:
                    s.chunks += 1
    except (httpx.HTTPError, OSError) as e:
        s.error = f"{type(e).__name__}: {e}"
    finally:
        if s.first is not None:
            s.first.set()
    return s


def test_requests_spread_over_replicas_streams_intact(fleet: ReplicaFleet) -> None:
    async def main() -> list[Stream]:
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*(stream(c, fleet.lb_url, 40, Stream()) for _ in range(30)))

    results = asyncio.run(main())
    assert all(s.status == 200 for s in results), [(s.status, s.error) for s in results]
    assert all(s.done and not s.error and s.chunks >= 2 for s in results), results
    # leastconn over concurrent streams: every replica gets some
    assert {s.replica for s in results} == {"replica0", "replica1", "replica2"}, [s.replica for s in results]


def test_budget_is_held_fleet_wide_behind_haproxy_and_reports_agree(fleet: ReplicaFleet) -> None:
    """Tenant `capped` may make 12 requests/minute: through HAProxy, spread over three replicas,
    at most that (plus its refill and one per replica of slack) gets in, at least 0.9 of it; and
    the goodput report gives the same totals from every replica within 2 s."""
    rpm, n, sent = 12, 3, 36
    capped = {"authorization": "Bearer sk-test-capped"}
    one = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}

    async def main() -> tuple[list[int], set[str]]:
        async with httpx.AsyncClient(timeout=30) as c:
            sem = asyncio.Semaphore(6)

            async def go() -> tuple[int, str]:
                async with sem:
                    r = await c.post(f"{fleet.lb_url}/v1/chat/completions", headers=capped, json=one)
                    return r.status_code, r.headers.get("x-tokenfleet-replica", "")
            done = await asyncio.gather(*(go() for _ in range(sent)))
            return [s for s, _ in done], {rep for _, rep in done}

    t0 = time.monotonic()
    statuses, replicas = asyncio.run(main())
    elapsed = time.monotonic() - t0
    admitted = statuses.count(200)
    assert set(statuses) <= {200, 429}, statuses
    assert len(replicas) >= 2, replicas  # it really was spread (else one replica's own bucket would do)
    assert 0.9 * rpm <= admitted <= rpm + rpm * elapsed / 60 + n, (admitted, elapsed)
    with httpx.Client(timeout=10) as c:
        deadline = time.monotonic() + 2.0
        while True:
            totals = [c.get(f"{u}/v1/reports/goodput?tenant=capped", headers=ADMIN).json()["totals"]
                      for u in fleet.urls.values()]
            if all(t["arrived"] == sent and t["admitted"] == admitted for t in totals):
                break
            assert time.monotonic() < deadline, totals
            time.sleep(0.05)


def test_policy_change_through_one_replica_routes_on_every_replica_within_2s(fleet: ReplicaFleet) -> None:
    path = f"/admin/v1/region-policies/acme/{MODEL}"

    def site(c: httpx.Client, url: str) -> str:
        r = c.post(f"{url}/v1/chat/completions", headers=KEY,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
        assert r.status_code == 200, r.text
        return r.headers["x-tokenfleet-site"]

    with httpx.Client(timeout=30) as c:
        # acme's region is us-east: without a policy every replica routes it to east
        assert {site(c, u) for u in fleet.urls.values()} == {"east"}
        r = c.put(fleet.urls[0] + path, headers=ADMIN, json={"allowed_sites": ["west"]})
        assert r.status_code in (200, 201), r.text
        changed = time.monotonic()
        try:
            pending = dict(fleet.urls)
            while pending:  # each replica, directly (not through HAProxy), until it routes to west
                for i, url in list(pending.items()):
                    if site(c, url) == "west":
                        del pending[i]
                assert time.monotonic() - changed < 2.0 or not pending, f"replicas {sorted(pending)} still route east"
            took = time.monotonic() - changed
            assert took < 2.0, took
            # and it stays: all replicas agree from now on
            assert {site(c, u) for u in fleet.urls.values() for _ in range(3)} == {"west"}
        finally:
            assert c.delete(fleet.urls[1] + path, headers=ADMIN).status_code == 200


def test_sigkilled_replica_loses_only_its_own_streams(fleet: ReplicaFleet) -> None:
    victim = 1
    old_pid = fleet.pids[victim]
    fleet.wait_up(["replica0", "replica1", "replica2"], 15)  # the streams below must reach all three

    async def main() -> tuple[list[Stream], list[Stream]]:
        async with httpx.AsyncClient(timeout=60) as c:
            streams = [Stream(first=asyncio.Event()) for _ in range(18)]
            tasks = [asyncio.ensure_future(stream(c, fleet.lb_url, 300, s)) for s in streams]
            for s in streams:  # every stream is open on its replica before the kill
                assert s.first is not None
                await asyncio.wait_for(s.first.wait(), 30)
            assert {s.replica for s in streams} == {"replica0", "replica1", "replica2"}
            assert not any(s.done for s in streams), "streams ended before the kill: make them longer"
            os.kill(old_pid, signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            # the others keep serving while the dead one is out (HAProxy redispatches connect failures)
            after = await asyncio.gather(*(stream(c, fleet.lb_url, 5, Stream()) for _ in range(9)))
            return results, after

    results, after = asyncio.run(main())
    on_victim = [s for s in results if s.replica == f"replica{victim}"]
    others = [s for s in results if s.replica != f"replica{victim}"]
    assert on_victim and others
    assert all(not s.done and s.error for s in on_victim), on_victim
    assert all(s.done and not s.error for s in others), others
    assert all(s.status == 200 and s.done and not s.error for s in after), after
    assert all(s.replica != f"replica{victim}" for s in after)
    fleet.wait_status(f"replica{victim}", "DOWN", 5)
    # and it comes back, on its port, as a new process that HAProxy takes in again
    fleet.wait_line(lambda s: s.startswith(f"tokenfleet: replica {victim} ") and "restarting" in s, 10)
    fleet.wait_line(lambda s: s.startswith(f"tokenfleet: gateway  replica {victim} "), 60)
    assert fleet.pids[victim] != old_pid
    fleet.wait_up([f"replica{victim}"], 15)
    with httpx.Client(timeout=30) as c:
        assert c.get(fleet.urls[victim] + "/health").status_code == 200


def test_sigterm_stops_every_process_it_started(fleet: ReplicaFleet) -> None:
    # last in the module: it stops the shared deployment
    started = fleet.tree()
    assert set(fleet.pids.values()) <= started
    assert len(started) >= 6, started  # 3 replicas + 3 workers (Redis is the harness's here)
    fleet.proc.send_signal(signal.SIGTERM)
    assert fleet.proc.wait(timeout=60) == 0
    assert "tokenfleet: stopped" in fleet.lines + [fleet.wait_line(lambda s: s == "tokenfleet: stopped", 5)]
    left = {p for p in started if alive(p)}
    assert not left, f"left running after SIGTERM: {left}"


def test_private_redis_when_no_url_and_stopped_with_the_rest() -> None:
    # a second, smaller deployment: 2 replicas, no --redis-url
    with replica_fleet(2, shared_redis=False) as f:
        line = next(s for s in f.lines if s.startswith("tokenfleet: redis "))
        port = int(line.split()[2].rsplit(":", 1)[1].split("/")[0])
        # redis-server retitles itself "redis-server 127.0.0.1:PORT"
        redis_pids = {p for p in f.tree()
                      if "redis-server" in (cmd := Path(f"/proc/{p}/cmdline").read_text()) and str(port) in cmd}
        assert len(redis_pids) == 1, (line, f.tree())
        with httpx.Client(timeout=30) as c:  # both replicas serve, through HAProxy
            seen = {c.post(f.lb_url + "/v1/chat/completions", headers=KEY, json={**body(3), "stream": False})
                    .headers["x-tokenfleet-replica"] for _ in range(6)}
        assert seen == {"replica0", "replica1"}
        started = f.tree()
        f.proc.send_signal(signal.SIGTERM)
        assert f.proc.wait(timeout=60) == 0
        assert not {p for p in started if alive(p)}, "left running"


def test_replicas_refused_without_redis(tmp_path: Path) -> None:
    # no --redis-url and no redis-server on PATH: refused before anything is launched
    env = {k: v for k, v in os.environ.items() if k != "TOKENFLEET_REDIS_URL"}
    env["PATH"] = str(tmp_path)
    r = subprocess.run([sys.executable, "-m", "tokenfleet.cli", "up", "--replicas", "2", "--fleet", str(FLEET),
                        "--port", "0"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r
    assert "--replicas 2 needs a Redis" in r.stdout and "--redis-url" in r.stdout, r.stdout
    assert "launching" not in r.stdout


def test_attach_view_gives_replicas_the_launched_ids_and_urls(tmp_path: Path) -> None:
    # what a replica builds from the parent's attach file: sim adapters in attach mode, same ids
    from engine_adapters.base import AdapterError
    from engine_adapters.registry import build_adapters
    from engine_adapters.sim.launcher import SimAdapter
    from fleetcore.fleet_config import load_fleet_file
    from gateway.replicas import apply_attach

    view = {"0": ["http://127.0.0.1:1001", "http://127.0.0.1:1002/"], "1": ["http://127.0.0.1:1003"]}
    (tmp_path / "a.json").write_text(json.dumps(view))
    adapters = build_adapters(apply_attach(load_fleet_file(FLEET), str(tmp_path / "a.json")))

    async def launch() -> list[tuple[str, str]]:
        out = [(i.instance_id, i.url) for a in adapters for i in await a.launch()]
        for a in adapters:
            await a.stop()
        return out

    assert asyncio.run(launch()) == [("east/llama-3.1-8b/0", "http://127.0.0.1:1001"),
                                     ("east/llama-3.1-8b/1", "http://127.0.0.1:1002"),
                                     ("west/llama-3.1-8b/0", "http://127.0.0.1:1003")]
    assert not any(a.scalable for a in adapters)
    with pytest.raises(AdapterError, match="instances=2 but 1 urls"):
        SimAdapter(id_prefix="x/m", site="x", model="m", version="v", instances=2, spec="llama-3.1-8b",
                   gpu="H100", options={"urls": ["http://a:1"]})
