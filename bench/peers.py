"""Live benchmark: TokenFleet vs the real SGLang router (and, for overhead, the vLLM router and LiteLLM), on the same simulated workers.

    .venv/bin/python bench/peers.py [--trace FILE] [--window S] [--start S] [--rate-scale X]
        [--workers N] [--spec M --gpu G --tp T] [--time-scale S]
        [--ours tokenpilot,round_robin] [--sglang-policy cache_aware] [--admission fcfs|slomax]
        [--parts routing,overhead,fidelity] [--overhead-rate 200,500,1000]
        [--overhead-peers sglang,vllm-router,litellm]
        [--overhead-stacks auto,h11+asyncio,httptools+uvloop] [--json OUT.json]

Three measurements, each printed as a table:

1. routing — N simulated workers (`python -m engine_adapters.sim.worker`), then in
   turn our gateway (`tokenfleet up` over a generated `adapter: static` fleet
   file, one run per `--ours` router) and the SGLang router
   (`sglang_router.launch_router --policy cache_aware`) in front of the *same*
   workers. The same trace window is replayed through each with
   `fleetsim.live.replay` (what `tokenfleet bench live` runs); every worker's
   prefix cache is flushed between runs (`POST /flush_cache`). One
   side-by-side table in `simulate`'s format.
2. overhead — one very fast worker (time_scale 0.001: a step of the model's
   physics takes microseconds, so the worker's own latency is its HTTP and
   tokenizer work) reached directly, through our gateway and through the SGLang
   router (and the vLLM router and the LiteLLM proxy: `--overhead-peers`), each
   at fixed open-loop rates (200, 500, 1000 req/s) of small streaming
   requests (64 prompt tokens, 4 output tokens). Added latency per path is the
   path's TTFT (and end-to-end) percentile minus the direct path's, median and p99.
   `--overhead-stacks` runs one gateway per uvicorn stack (HTTP parser + event
   loop, e.g. `h11+asyncio` vs `httptools+uvloop`) side by side in the same
   rounds; `auto` is exactly what `tokenfleet up` picks. Each gateway reports the
   stack it really runs, and that is what its row is labelled with (plus
   "(auto)" for the `tokenfleet up` one).
3. fidelity — the same fleet (as `adapter: sim`), the same workload and the same
   policy through the discrete-event simulator (`fleetsim`), printed next to the
   live TTFT p50: tokenpilot vs our gateway with tokenpilot, and the simulator's
   `sglang_cache_aware` model vs the real SGLang router.

Time scale. A worker with `--time-scale s` plays its physics s times slower in
wall time: an engine step of d physical seconds takes s*d wall seconds, while
the CPU work around it (HTTP, JSON, tokenizing, routing) takes what it takes.
`--rate-scale`, `--window` and `--start` describe the *physical* experiment; the
live replay sends the same arrivals stretched by s (a request at physical time t
goes out at wall time s*t), and every live time is divided by s before the
metrics (`fleetsim.live.to_physical`), so live rows, simulated rows and the
class SLOs are all in physical seconds. The default and the README's tables use
s = 1, for two reasons: (1) 2 cores keep up — the whole stack (4 workers, the
router, the load generator) needs ~0.3 cores at the default load, the rest is
headroom for bursts; (2) the gateway's policies reason in absolute seconds
(TokenPilot's roofline priors, SLOMax's TTFT predictions against the class
SLOs), so at s != 1 they face engines s times slower than the fleet file says
and decide differently from the simulator. s > 1 is for router-only
experiments on a loaded machine (fixed CPU costs shrink by 1/s).
Our gateway runs with `admission: {policy: fcfs}` unless `--admission slomax`:
the SGLang router admits everything, and so does the simulator here.

The SGLang router is a benchmark dependency, never a project one: it is
installed on first use into its own venv (default ~/.cache/tokenfleet/peers-venv,
or $TOKENFLEET_PEERS_VENV). Everything listens on 127.0.0.1 only; every process
started here is stopped by its PID on exit (and gets SIGTERM if this script dies).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from fleetcore.fleet_config import FleetConfig, parse_fleet
from fleetcore.slo import DEFAULT_SLOS
from fleetsim.cli import make_policy
from fleetsim.live import LiveRun, Target, live_row, new_session, prepare_workload, replay
from fleetsim.metrics import summarize_all
from fleetsim.report import format_table, write_json
from fleetsim.simulator import FleetSimulator, prepare
from workloads import TraceRequest, Workload, scale_rate

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = REPO / "traces" / "conversation_trace.jsonl.gz"
CACHE = Path.home() / ".cache" / "tokenfleet"
PEERS_VENV = Path(os.environ.get("TOKENFLEET_PEERS_VENV", CACHE / "peers-venv"))
SGLANG_ROUTER_PIN = "sglang-router==0.3.2"  # the version whose launch facts are in shared/notes


@dataclass(frozen=True)
class PeerKind:
    """A peer router of the overhead benchmark: installed on first use into its own venv, never
    into the project's."""

    name: str
    venv: Path
    pin: str
    probe: tuple[str, ...]  # run with the venv's python: exits 0 once installed


PEER_KINDS = {
    "sglang": PeerKind("sglang", PEERS_VENV, SGLANG_ROUTER_PIN, ("-c", "import sglang_router")),
    "vllm-router": PeerKind("vllm-router", Path(os.environ.get("TOKENFLEET_VLLM_ROUTER_VENV", CACHE / "vllm-router-venv")),
                            "vllm-router==0.1.17", ("-c", "import vllm_router")),
    # 1.106.12: the newest whose `proxy` extra resolves from the package index here (1.108+ pin
    # litellm-proxy-extras builds it does not have); 1.107.0 was the compromised release.
    "litellm": PeerKind("litellm", Path(os.environ.get("TOKENFLEET_LITELLM_VENV", CACHE / "litellm-venv")),
                        "litellm[proxy]==1.106.12", ("-c", "import litellm.proxy.proxy_server")),
}
MODEL = "bench-model"
API_KEY = "sk-bench-local"
START_TIMEOUT_S = 60.0
FLUSH_TIMEOUT_S = 60.0
PY = sys.executable


# --- processes ------------------------------------------------------------------------


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM if this script dies, even by SIGKILL: no orphans."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    url: str = ""
    extra: dict[str, str] = field(default_factory=dict)

    def log_tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-n:]
        return ""


class Processes:
    """Children started by this script, stopped by PID (SIGTERM, then SIGKILL) in reverse order."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[Proc] = []

    def spawn(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None,
              cwd: Path = REPO) -> Proc:
        log = self.workdir / f"{name}.log"
        with open(log, "wb") as out:  # the child keeps its own descriptor
            popen = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     cwd=cwd, env={**os.environ, **(env or {})},
                                     preexec_fn=_die_with_parent)  # noqa: PLW1509 - no threads here
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def stop(self, proc: Proc, grace_s: float = 5.0) -> None:
        if proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGTERM)
            try:
                proc.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(grace_s)
        if proc in self.procs:
            self.procs.remove(proc)

    def stop_all(self) -> None:
        for proc in reversed(list(self.procs)):
            self.stop(proc)


async def _wait_for_log(proc: Proc, pattern: str, timeout_s: float = START_TIMEOUT_S) -> re.Match[str]:
    """Poll the child's log for `pattern` (children write to files, never to pipes we must drain)."""
    rx = re.compile(pattern, re.MULTILINE)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = rx.search(proc.log_tail(1 << 20))
        if m:
            return m
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log_tail()}")
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{proc.name} not ready after {timeout_s:g} s:\n{proc.log_tail()}")


async def _wait_http(url: str, ok: Any = None, timeout_s: float = START_TIMEOUT_S,
                     headers: dict[str, str] | None = None) -> None:
    """Poll GET `url` until it answers 200 (and `ok(json)` holds, when given)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url, headers=headers or {}) as r:
                    if r.status == 200 and (ok is None or ok(await r.json(content_type=None))):
                        return
                    last = f"HTTP {r.status}"
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                last = repr(e)
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout_s:g} s ({last})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- the pieces -----------------------------------------------------------------------


@dataclass(frozen=True)
class FleetShape:
    """What every worker simulates; the same numbers make the gateway's and the simulator's fleet."""

    workers: int = 4
    spec: str = "llama-3.1-8b"
    gpu: str = "H100"
    tp: int = 1
    time_scale: float = 1.0
    max_model_len: int = 131072
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    admission: str = "fcfs"  # our gateway's admission policy (the peer router has none)


async def start_worker(procs: Processes, shape: FleetShape, i: int) -> Proc:
    argv = [PY, "-m", "engine_adapters.sim.worker", "--served-model-name", MODEL, "--spec", shape.spec,
            "--gpu", shape.gpu, "--tp", str(shape.tp), "--time-scale", repr(shape.time_scale),
            "--max-model-len", str(shape.max_model_len), "--block-size", str(shape.block_size),
            "--max-num-batched-tokens", str(shape.max_num_batched_tokens), "--port", "0",
            "--instance-id", f"w{i}"]
    proc = procs.spawn(f"worker{i}", argv)
    m = await _wait_for_log(proc, r'^\{"event": "ready".*$')
    proc.url = json.loads(m.group(0))["url"]
    return proc


@contextlib.asynccontextmanager
async def fast_worker_session(prefix: str) -> AsyncIterator[tuple[Processes, Proc, FleetShape, Path]]:
    """What the per-request tools start from (`request_wakeups.py`, `callgrind_request.py`): the
    overhead runs' one time_scale-0.001 worker, a work dir, and every child started there
    stopped at the end (procs, worker, shape, work dir)."""
    shape = FleetShape(workers=1, time_scale=0.001)
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp_s:
        tmp = Path(tmp_s)
        procs = Processes(tmp)
        try:
            worker = await start_worker(procs, shape, 0)
            yield procs, worker, shape, tmp
        finally:
            procs.stop_all()


def gateway_fleet(shape: FleetShape, urls: Sequence[str], *, simulated: bool = False) -> dict[str, Any]:
    """The fleet file: `static` over the running workers for the gateway, or the same
    hardware as `sim` instances for the simulator. One site at RTT 0 (all loopback)."""
    engine = {"spec": shape.spec, "max_model_len": shape.max_model_len, "block_size": shape.block_size,
              "max_num_batched_tokens": shape.max_num_batched_tokens}
    dep: dict[str, Any] = {"site": "bench", "model": MODEL, "gpu": shape.gpu, "tp": shape.tp}
    if simulated:
        dep.update(adapter="sim", instances=len(urls))
    else:
        dep.update(adapter="static", urls=list(urls))
    return {"regions": ["local"], "default_region": "local",
            "sites": [{"name": "bench", "region": "local", "jurisdiction": "local", "rtt_ms": {"local": 0}}],
            "models": [{"name": MODEL, "versions": ["v1"], "engine": engine}],
            "deployments": [dep],
            "tenants": [{"name": "bench", "api_keys": [API_KEY], "region": "local"}],
            "admission": {"policy": shape.admission}}


# `python -c GATEWAY_SHIM HTTP LOOP up ...` is `tokenfleet up ...` with uvicorn's HTTP parser
# and/or the event loop forced ("auto": left as `tokenfleet up` has them), and it prints the
# stack it really got once uvicorn has loaded its config on the running loop.
GATEWAY_SHIM = r"""
import asyncio, sys
import uvicorn, uvicorn.config
http, loop = sys.argv[1], sys.argv[2]
del sys.argv[1:3]
if http != "auto":
    uvicorn.config.HTTP_PROTOCOLS["auto"] = uvicorn.config.HTTP_PROTOCOLS[http]
if loop != "auto":
    if loop == "uvloop":
        import uvloop
        factory = uvloop.new_event_loop
    else:
        factory = asyncio.SelectorEventLoop
    def _run(main, *, debug=None):
        with asyncio.Runner(debug=debug, loop_factory=factory) as runner:
            return runner.run(main)
    asyncio.run = _run
_load = uvicorn.Config.load
def _load_and_say(self):
    _load(self)
    got_loop = "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"
    got_http = self.http_protocol_class.__module__.rsplit(".", 1)[-1].removesuffix("_impl")
    print(f"gateway-stack {got_http}+{got_loop}", flush=True)
uvicorn.Config.load = _load_and_say
from tokenfleet.cli import main
sys.exit(main(sys.argv[1:]))
"""
GATEWAY_STACK_HTTP = ("auto", "h11", "httptools")
GATEWAY_STACK_LOOP = ("auto", "asyncio", "uvloop")


def parse_stack(spec: str) -> tuple[str, str]:
    """'auto' or 'HTTP+LOOP' (each part 'auto' or a uvicorn choice) -> (http, loop)."""
    http, _, loop = spec.strip().partition("+")
    loop = loop or "auto"
    if http not in GATEWAY_STACK_HTTP or loop not in GATEWAY_STACK_LOOP:
        raise ValueError(f"gateway stack {spec!r}: expected HTTP+LOOP with HTTP in {GATEWAY_STACK_HTTP} "
                         f"and LOOP in {GATEWAY_STACK_LOOP}, or 'auto'")
    return http, loop


async def start_gateway(procs: Processes, shape: FleetShape, urls: Sequence[str], router: str,
                        name: str = "gateway", stack: str = "auto", tree: Path | None = None) -> Proc:
    """Our gateway over `urls`; `stack` forces uvicorn's HTTP parser/event loop (see
    GATEWAY_SHIM). proc.extra["stack"] is the stack it really runs, e.g. 'httptools+uvloop'.
    `tree`: run the gateway code of that source tree (another commit's, `--baseline-ref`)."""
    return await start_gateway_fleet(procs, gateway_fleet(shape, urls), len(urls), router, name, stack, tree)


async def start_gateway_fleet(procs: Processes, fleet: dict[str, Any], instances: int, router: str,
                              name: str = "gateway", stack: str = "auto", tree: Path | None = None,
                              args: Sequence[str] = (), timeout_s: float = START_TIMEOUT_S) -> Proc:
    """`tokenfleet up` over the fleet file `fleet` (written to the work dir), ready once its
    /health counts `instances` ready instances; `args` go to `up` as well (e.g. `--log-level
    info`: its access log lands in proc.log). The engines a fleet file launches (`adapter: sim`,
    `vllm`) are the gateway's children: stop it with a grace that lets it stop them."""
    http, loop = parse_stack(stack)
    path = procs.workdir / f"{name}-fleet.yaml"
    path.write_text(yaml.safe_dump(fleet, sort_keys=False))
    env = {"PYTHONPATH": str(tree)} if tree is not None else None
    proc = procs.spawn(name, [PY, "-c", GATEWAY_SHIM, http, loop, "up", "--fleet", str(path), "--port", "0",
                              "--router", router, *args], env=env, cwd=tree or REPO)
    m = await _wait_for_log(proc, r"gateway\s+(http://\S+)", timeout_s)
    proc.url = m.group(1)
    await _wait_http(proc.url.removesuffix("/v1") + "/health", lambda j: j.get("ready_instances") == instances,
                     timeout_s)
    proc.extra["stack"] = (await _wait_for_log(proc, r"^gateway-stack (\S+)$")).group(1)
    want = [w for w in (http, loop) if w != "auto"]
    if not set(want) <= set(proc.extra["stack"].split("+")):
        raise RuntimeError(f"{name}: asked for {stack}, runs {proc.extra['stack']}")
    return proc


def ensure_peer(kind: PeerKind, install: bool) -> Path:
    """The peer's venv python with the peer importable; installs it there on first use."""
    py = kind.venv / "bin" / "python"
    if py.exists() and subprocess.run([str(py), *kind.probe], capture_output=True, check=False).returncode == 0:
        return py
    if not install:
        raise RuntimeError(f"{kind.pin} is not installed in {kind.venv} (run without --no-install)")
    print(f"installing {kind.pin} into {kind.venv} (a benchmark-only venv)...", flush=True)
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(kind.venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", kind.pin], check=True)
    return py


def ensure_sglang_router(install: bool) -> Path:
    """The peers venv's python with sglang-router importable; installs it there on first use."""
    return ensure_peer(PEER_KINDS["sglang"], install)


def ensure_peers(names: Sequence[str], install: bool) -> dict[str, Path]:
    """Each named peer's venv python; a peer that does not install on this machine is left out
    with a message saying so (the benchmark reports the others)."""
    out: dict[str, Path] = {}
    for name in names:
        try:
            out[name] = ensure_peer(PEER_KINDS[name], install)
        except (RuntimeError, subprocess.CalledProcessError, OSError) as e:
            print(f"peer      {name}: not available on this machine ({e}); left out", flush=True)
    return out


async def start_vllm_router(procs: Processes, py: Path, urls: Sequence[str], policy: str = "cache_aware") -> Proc:
    """vLLM's router (Rust, PyPI `vllm-router`) in front of `urls`."""
    port, prom = free_port(), free_port()
    exe = py.parent / "vllm-router"
    argv = [str(exe), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom), "--log-level", "warning"]
    proc = procs.spawn("vllm-router", argv)
    proc.url = f"http://127.0.0.1:{port}/v1"
    await _wait_http(f"http://127.0.0.1:{port}/v1/models", lambda j: bool(j.get("data")))
    await asyncio.sleep(1.0)
    return proc


LITELLM_CONFIG = """model_list:
  - model_name: {model}
    litellm_params:
      model: hosted_vllm/{model}
      api_base: {url}/v1
      api_key: none
litellm_settings:
  telemetry: false
general_settings:
  master_key: {key}
"""


async def start_litellm(procs: Processes, py: Path, url: str) -> Proc:
    """LiteLLM's proxy server (one process, no database) with the worker as its one deployment."""
    port = free_port()
    cfg = procs.workdir / "litellm.yaml"
    # it refuses to start without a master key (every request would be accepted): one per run
    key = "sk-" + secrets.token_hex(32)
    cfg.write_text(LITELLM_CONFIG.format(model=MODEL, url=url, key=key))
    # no network here: the model cost map from the package, no telemetry
    env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False", "LITELLM_LOG": "ERROR"}
    argv = [str(py.parent / "litellm"), "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port),
            "--num_workers", "1"]
    proc = procs.spawn("litellm", argv, env=env)
    proc.url = f"http://127.0.0.1:{port}/v1"
    proc.extra["key"] = key
    await _wait_http(f"http://127.0.0.1:{port}/health/liveliness", timeout_s=180.0)
    return proc


async def start_sglang(procs: Processes, py: Path, urls: Sequence[str], policy: str,
                       name: str = "sglang-router") -> Proc:
    port, prom = free_port(), free_port()  # its own Prometheus port: a clash makes it panic
    argv = [str(py), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *urls, "--policy", policy, "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(prom), "--log-level", "warn"]
    proc = procs.spawn(name, argv)
    proc.url = f"http://127.0.0.1:{port}/v1"
    # Workers register asynchronously; /v1/models answers once at least one is in.
    await _wait_http(f"http://127.0.0.1:{port}/v1/models", lambda j: bool(j.get("data")))
    await asyncio.sleep(1.0)  # let the remaining workers' registration land
    return proc


async def flush_caches(urls: Sequence[str], timeout_s: float = FLUSH_TIMEOUT_S) -> None:
    """POST /flush_cache on every worker; engines refuse while requests hold blocks, so retry."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        for url in urls:
            while True:
                async with s.post(f"{url}/flush_cache") as r:
                    if r.status == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{url}/flush_cache still refused after {timeout_s:g} s")
                await asyncio.sleep(0.5)


def _cpu_seconds(procs: Sequence[Proc], include_self: bool = True) -> float:
    """User+system CPU seconds of the given children so far (Linux /proc), plus ours."""
    tick = os.sysconf("SC_CLK_TCK")
    pids = [p.popen.pid for p in procs] + ([os.getpid()] if include_self else [])
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _tree_cpu_seconds(pid: int) -> float:
    """User+system CPU seconds of `pid` and every live process below it (a peer may run its
    work in children: LiteLLM's uvicorn, a launcher's router)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                f = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                stats[int(entry)] = (int(f[1]), (int(f[11]) + int(f[12])) / tick)
    total, todo, seen = 0.0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen or p not in stats:
            continue
        seen.add(p)
        total += stats[p][1]
        todo.extend(c for c, (ppid, _) in stats.items() if ppid == p)
    return total


def _system_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all processes, ours and everyone else's):
    the benchmark shares 2 cores with whatever else runs, and the tables say how much that was."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        cpu = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in cpu[:8])
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    return 0.0


# --- 1. routing -----------------------------------------------------------------------


@dataclass
class RoutingResult:
    rows: list[dict[str, Any]]
    runs: dict[str, LiveRun]
    cpu_frac: dict[str, float]  # CPU seconds per wall second of the whole stack, per run


async def _replay_through(label: str, url: str, key: str | None, wl: Workload, concurrency: int,
                          timeout_s: float, stack: Sequence[Proc], fresh: bool,
                          time_scale: float) -> tuple[dict[str, Any], LiveRun, float]:
    target = Target(url.removesuffix("/v1"), MODEL, key)
    cpu0, busy0 = _cpu_seconds(stack), _system_busy_s()
    async with new_session(concurrency, fresh) as session:
        run = await replay(wl, target, concurrency=concurrency, timeout_s=timeout_s, session=session)
    cpu = (_cpu_seconds(stack) - cpu0) / max(run.wall_s, 1e-9)
    busy = (_system_busy_s() - busy0) / max(run.wall_s, 1e-9)
    row = live_row(label, run, target, time_scale)  # times in physical seconds from here on
    row["live"]["cpu_cores"] = round(cpu, 2)  # this benchmark's stack: workers, router, load generator
    row["live"]["machine_busy_cores"] = round(busy, 2)  # everything on the machine
    lag = row["live"]["send_lag_ms"]
    print(f"ran       {label:<24} wall {run.wall_s:6.1f} s  {row['completed']}/{row['requests']} completed  "
          f"TTFT p50 {row['ttft_ms']['p50'] or 0:.0f} ms  hit {100 * (row['cache_hit_rate'] or 0):.1f}%  "
          f"send lag p99 {lag['p99'] or 0:.1f} ms  loop stall max {row['live']['loop_stall_ms']['max'] or 0:.0f} ms  "
          f"CPU {cpu:.2f} cores (machine {busy:.2f})", flush=True)
    for reason in row["live"]["error_samples"]:
        print(f"          error: {reason}")
    return row, run, cpu


async def run_routing(procs: Processes, shape: FleetShape, wl: Workload, ours: Sequence[str],
                      sglang_policy: str | None, sglang_py: Path | None, concurrency: int,
                      timeout_s: float, fresh: bool = False) -> RoutingResult:
    workers = await asyncio.gather(*(start_worker(procs, shape, i) for i in range(shape.workers)))
    urls = [w.url for w in workers]
    print(f"workers   {len(urls)} x {shape.spec} on {shape.tp}x{shape.gpu}, time_scale {shape.time_scale:g}: "
          f"{' '.join(urls)}", flush=True)
    res = RoutingResult([], {}, {})
    for router in ours:
        await flush_caches(urls)
        gw = await start_gateway(procs, shape, urls, router)
        label = f"tokenfleet/{router}"
        row, run, cpu = await _replay_through(label, gw.url, API_KEY, wl, concurrency, timeout_s, [*workers, gw], fresh,
                                                shape.time_scale)
        procs.stop(gw)
        res.rows.append(row)
        res.runs[label] = run
        res.cpu_frac[label] = cpu
    if sglang_policy and sglang_py:
        await flush_caches(urls)
        sg = await start_sglang(procs, sglang_py, urls, sglang_policy)
        label = f"sglang-router/{sglang_policy}"
        row, run, cpu = await _replay_through(label, sg.url, None, wl, concurrency, timeout_s, [*workers, sg], fresh,
                                                shape.time_scale)
        procs.stop(sg)
        res.rows.append(row)
        res.runs[label] = run
        res.cpu_frac[label] = cpu
    for w in workers:
        procs.stop(w)
    return res


# --- 2. overhead ----------------------------------------------------------------------


def fixed_rate_workload(rate: float, n: int, prompt_tokens: int = 64, output_tokens: int = 4,
                        block_tokens: int = 16) -> Workload:
    """`n` small requests `1/rate` apart, each with its own prompt (no shared prefix, so the
    router's cache bookkeeping cannot make one path cheaper than another)."""
    blocks = -(-prompt_tokens // block_tokens)
    reqs = [TraceRequest(1000.0 * i / rate, prompt_tokens, output_tokens,
                         tuple(range(i * blocks + 1, (i + 1) * blocks + 1)), block_tokens)
            for i in range(n)]
    return Workload(f"fixed-{rate:g}rps", reqs, block_tokens, {"rate_rps": rate})


def _added(path: dict[str, Any], direct: dict[str, Any], metric: str, q: str) -> float | None:
    a, b = path[metric][q], direct[metric][q]
    return None if a is None or b is None else a - b


async def wait_quiet(max_busy: float, timeout_s: float, sample_s: float = 1.0) -> float:
    """Wait (up to `timeout_s`) for a second in which the machine, with our stack idle, is
    busy below `max_busy` cores; returns the last sample. Latency overhead is a few ms, so a
    round that starts while someone else saturates the 2 shared cores measures their load,
    not our gateway."""
    deadline = time.monotonic() + timeout_s
    while True:
        b0, t0 = _system_busy_s(), time.monotonic()
        await asyncio.sleep(sample_s)
        busy = (_system_busy_s() - b0) / (time.monotonic() - t0)
        if busy <= max_busy or time.monotonic() >= deadline:
            return busy


@dataclass(frozen=True)
class _Path:
    name: str
    url: str
    key: str | None
    proc: Proc  # the process whose CPU the path adds (the worker itself for `direct`)


async def run_overhead(procs: Processes, peers: dict[str, Path], sglang_policy: str, rates: Sequence[float], n: int,
                       rounds: int, router: str, modes: Sequence[str], max_busy: float = 0.5,
                       quiet_wait_s: float = 120.0, stacks: Sequence[str] = ("auto",),
                       baseline: tuple[str, Path] | None = None) -> list[dict[str, Any]]:
    """One table per (connection mode, rate); every path measured in the same interleaved rounds."""
    shape = FleetShape(workers=1, time_scale=0.001)
    worker = await start_worker(procs, shape, 99)
    paths = [_Path("direct", worker.url, None, worker)]
    gateways: list[Proc] = []
    if baseline is not None:  # the same gateway at another commit, measured in the same rounds
        ref, tree = baseline
        gw = await start_gateway(procs, shape, [worker.url], router, name="gateway-baseline", tree=tree)
        gateways.append(gw)
        paths.append(_Path(f"tokenfleet/{router} {gw.extra['stack']} @{ref}", gw.url, API_KEY, gw))
        print(f"gateway   baseline {ref}: {gw.extra['stack']} at {gw.url}", flush=True)
    for i, stack in enumerate(stacks):  # one gateway per uvicorn stack, all measured in the same rounds
        gw = await start_gateway(procs, shape, [worker.url], router, name=f"gateway-overhead{i}", stack=stack)
        gateways.append(gw)
        label = f"tokenfleet/{router} {gw.extra['stack']}" + (" (auto)" if stack == "auto" else "")
        paths.append(_Path(label, gw.url, API_KEY, gw))
        print(f"gateway   {stack}: {gw.extra['stack']} at {gw.url}", flush=True)
    if "sglang" in peers:
        sg = await start_sglang(procs, peers["sglang"], [worker.url], sglang_policy, name="sglang-overhead")
        gateways.append(sg)
        paths.append(_Path(f"sglang-router/{sglang_policy}", sg.url, None, sg))
    if "vllm-router" in peers:
        vr = await start_vllm_router(procs, peers["vllm-router"], [worker.url])
        gateways.append(vr)
        paths.append(_Path("vllm-router/cache_aware", vr.url, None, vr))
    if "litellm" in peers:
        ll = await start_litellm(procs, peers["litellm"], worker.url)
        gateways.append(ll)
        paths.append(_Path("litellm-proxy", ll.url, ll.extra["key"], ll))
    tables = []
    for mode in modes:
        async with new_session(1024, fresh_connections=mode == "fresh") as session:
            warm = fixed_rate_workload(min(rates), max(50, n // 10))
            for p in paths:  # warm-up: connections, caches, lazy imports of every path
                await replay(warm, Target(p.url.removesuffix("/v1"), MODEL, p.key), session=session, timeout_s=30)
            collapsed: set[str] = set()
            for rate in rates:
                wl = fixed_rate_workload(rate, n)
                running = [p for p in paths if p.name not in collapsed]
                out: dict[str, list[dict[str, Any]]] = {p.name: [] for p in running}
                for r in range(rounds):  # rounds interleave the paths, so drift hits all of them alike
                    for p in running:
                        quiet = await wait_quiet(max_busy, quiet_wait_s)
                        run = await _overhead_run(p, wl, session, mode, r, rate)
                        run["idle_busy_cores"] = quiet
                        out[p.name].append(run)
                table = _overhead_table(out, rate, n, mode)
                # A path that failed requests or queued for seconds at this rate cannot sustain a higher
                # one: it is not run there (a collapsed proxy would take minutes per round to time out).
                for name, a in table["paths"].items():
                    added = a["added_ms"]["ttft_p50"]
                    if name != "direct" and (a["completed"] < a["requests"] or (added or 0) > COLLAPSED_ADDED_P50_MS):
                        collapsed.add(name)
                table["not_run"] = sorted(p.name for p in paths if p.name not in out)
                tables.append(table)
    for proc in (*reversed(gateways), worker):
        procs.stop(proc)
    return tables


async def _overhead_run(p: _Path, wl: Workload, session: aiohttp.ClientSession, mode: str,
                        r: int, rate: float) -> dict[str, Any]:
    """One fixed-rate run through one path, with the CPU its proxy (or the worker) spent per
    request — a figure contention cannot distort, unlike the latencies beside it."""
    target = Target(p.url.removesuffix("/v1"), MODEL, p.key)
    cpu0, busy0 = _tree_cpu_seconds(p.proc.popen.pid), _system_busy_s()
    run = await replay(wl, target, session=session, timeout_s=30)
    cpu, busy = _tree_cpu_seconds(p.proc.popen.pid) - cpu0, _system_busy_s() - busy0
    s = summarize_all(run.records, DEFAULT_SLOS)  # the bench fleets define no classes of their own
    s["cpu_ms_per_req"] = 1e3 * cpu / max(1, len(run.records))
    s["machine_busy_cores"] = busy / max(run.wall_s, 1e-9)
    s["load_avg_1m"] = os.getloadavg()[0]
    print(f"overhead  {mode:<9} {rate:5g}/s round {r + 1} {p.name:<46} {s['completed']}/{s['requests']} ok  "
          f"TTFT p50 {s['ttft_ms']['p50'] or 0:.2f} p99 {s['ttft_ms']['p99'] or 0:.2f} ms  "
          f"cpu {s['cpu_ms_per_req']:.2f} ms/req  machine busy {s['machine_busy_cores']:.2f} cores  "
          f"load {s['load_avg_1m']:.1f}  send lag p99 {run.live_block(target)['send_lag_ms']['p99'] or 0:.2f} ms",
          flush=True)
    return s


def _overhead_table(out: dict[str, list[dict[str, Any]]], rate: float, n: int, mode: str) -> dict[str, Any]:
    """Per path: TTFT/e2e percentiles (median over rounds) and added latency vs direct."""
    import statistics

    def med(runs: list[dict[str, Any]], metric: str, q: str | None = None) -> float | None:
        vals = [r[metric] if q is None else r[metric][q] for r in runs]
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    agg = {name: {m: {q: med(runs, m, q) for q in ("p50", "p99")} for m in ("ttft_ms", "e2e_ms")}
           | {"completed": sum(r["completed"] for r in runs), "requests": sum(r["requests"] for r in runs),
              "cpu_ms_per_req": med(runs, "cpu_ms_per_req"), "machine_busy_cores": med(runs, "machine_busy_cores"),
              "idle_busy_cores": med(runs, "idle_busy_cores"), "load_avg_1m": med(runs, "load_avg_1m"),
              "cpu_ms_per_req_rounds": [r["cpu_ms_per_req"] for r in runs]}
           for name, runs in out.items()}
    direct = agg["direct"]
    for a in agg.values():
        a["added_ms"] = {f"{m.split('_')[0]}_{q}": _added(a, direct, m, q)
                         for m in ("ttft_ms", "e2e_ms") for q in ("p50", "p99")}
    return {"rate_rps": rate, "requests_per_round": n, "rounds": len(next(iter(out.values()))),
            "connections": mode, "paths": agg}


SUSTAIN_ADDED_P99_MS = 50.0  # issue 14: a rate is sustained with added TTFT p99 below this and no errors
COLLAPSED_ADDED_P50_MS = 5000.0  # past this added median (or with errors) a path is not run at higher rates


def sustained(tables: Sequence[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per connection mode and path (direct left out): the highest rate whose table has the path's
    added TTFT p99 < SUSTAIN_ADDED_P99_MS and every request completed (None: not even the lowest)."""
    out: dict[str, dict[str, float | None]] = {}
    for t in sorted(tables, key=lambda t: t["rate_rps"]):
        for name, a in t["paths"].items():
            if name == "direct":
                continue
            best = out.setdefault(t["connections"], {}).setdefault(name, None)
            p99 = a["added_ms"]["ttft_p99"]
            ok = a["completed"] == a["requests"] and p99 is not None and p99 < SUSTAIN_ADDED_P99_MS
            if ok and (best is None or t["rate_rps"] > best):
                out[t["connections"]][name] = t["rate_rps"]
    return out


def cpu_ratios(t: dict[str, Any], reference: str) -> dict[str, float | None]:
    """Each path's median CPU per request divided by `reference`'s (a path name prefix), same table."""
    ref = next((a["cpu_ms_per_req"] for name, a in t["paths"].items() if name.startswith(reference)), None)
    return {name: (a["cpu_ms_per_req"] / ref if ref and a["cpu_ms_per_req"] is not None else None)
            for name, a in t["paths"].items()}


def format_sustained(tables: Sequence[dict[str, Any]]) -> str:
    lines = [f"highest rate sustained (added TTFT p99 < {SUSTAIN_ADDED_P99_MS:g} ms, no errors) of the rates run "
             f"({', '.join(f'{r:g}' for r in sorted({t['rate_rps'] for t in tables}))} req/s):"]
    for mode, by_path in sustained(tables).items():
        for name, rate in by_path.items():
            lines.append(f"  {mode:<9} {name:<46} {'none' if rate is None else f'{rate:g} req/s'}")
    return "\n".join(lines)


def format_overhead(o: dict[str, Any]) -> str:
    conn = "a new connection per request" if o["connections"] == "fresh" else "keep-alive connections"
    vs_sglang, vs_base = cpu_ratios(o, "sglang-router"), cpu_ratios(o, "tokenfleet/")
    base = next((name for name in o["paths"] if name.startswith("tokenfleet/")), "")
    lines = [(f"gateway overhead at {o['rate_rps']:g} req/s streaming, {conn} ({o['requests_per_round']} "
              f"requests x {o['rounds']} rounds; 64 prompt + 4 output tokens; medians over rounds)"),
             (f"{'path':<46} {'ok':>11}  {'TTFT p50':>9} {'TTFT p99':>9}  {'e2e p50':>8} {'e2e p99':>8}  "
              f"{'added p50':>9} {'added p99':>9}  {'cpu/req':>8} {'/sglang':>7} {'/first':>7} "
              f"{'busy':>5} {'idle':>5} {'load':>5}"),
             "-" * 168]
    for name, a in o["paths"].items():
        add = a["added_ms"]
        lines.append(f"{name:<46} {a['completed']:>5}/{a['requests']:<5}  {_f(a['ttft_ms']['p50'])} "
                     f"{_f(a['ttft_ms']['p99'])}  {_f(a['e2e_ms']['p50'], 8)} {_f(a['e2e_ms']['p99'], 8)}  "
                     f"{_f(add['ttft_p50'])} {_f(add['ttft_p99'])}  {_f(a['cpu_ms_per_req'], 8)} "
                     f"{_f(vs_sglang.get(name), 7)} {_f(vs_base.get(name), 7)} "
                     f"{_f(a['machine_busy_cores'], 5)} {_f(a['idle_busy_cores'], 5)} {_f(a.get('load_avg_1m'), 5)}")
    if o.get("not_run"):
        lines.append(f"not run at this rate (errors or added p50 > {COLLAPSED_ADDED_P50_MS / 1e3:g} s at a lower "
                     f"one): {', '.join(o['not_run'])}")
    lines.append("(ms; added = the path's TTFT percentile minus the direct path's; cpu/req = CPU ms per request "
                 "of the router process and its children (of the worker for direct); /sglang, /first = cpu/req "
                 f"divided by the SGLang router's and by the first tokenfleet row's ({base}), same rounds; "
                 "busy = CPU cores busy machine-wide during the run, idle = the same just before it, with this "
                 "benchmark idle: other users' load; load = 1-minute load average at the run's end)")
    return "\n".join(lines)


def _f(v: float | None, w: int = 9) -> str:
    return f"{'-':>{w}}" if v is None else f"{v:>{w}.2f}"


# --- 3. fidelity ----------------------------------------------------------------------


def simulate_rows(shape: FleetShape, wl: Workload, policies: Sequence[str], seed: int = 0) -> dict[str, dict[str, Any]]:
    """The same fleet (as sim instances) and the same physical workload through the simulator,
    one run per policy. Times are physical seconds, as the live rows' are (`live_row` divides
    the wall-clock measurements by time_scale)."""
    fleet: FleetConfig = parse_fleet(gateway_fleet(shape, ["x"] * shape.workers, simulated=True), "<bench>")
    inputs = prepare(wl.requests, fleet)
    out: dict[str, dict[str, Any]] = {}
    for name in policies:
        res = FleetSimulator(fleet, make_policy(name, seed, fleet)).run(inputs)
        s = summarize_all(res.records, fleet.admission.slos())
        out[name] = {"ttft_ms": s["ttft_ms"], "cache_hit_rate": s["cache_hit_rate"], "completed": s["completed"],
                     "wall_s": round(res.wall_s, 2)}
    return out


# Live run label -> the simulator policy that models it.
SIM_POLICY_OF = {"sglang-router/cache_aware": "sglang_cache_aware"}


def fidelity_rows(shape: FleetShape, wl: Workload, live_rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    pairs = []
    for row in live_rows:
        label = row["policy"]
        policy = label.split("/", 1)[1] if label.startswith("tokenfleet/") else SIM_POLICY_OF.get(label)
        if policy:
            pairs.append((row, policy))
    sims = simulate_rows(shape, wl, sorted({p for _, p in pairs}))
    out = []
    for row, policy in pairs:
        live50, sim50 = row["ttft_ms"]["p50"], sims[policy]["ttft_ms"]["p50"]
        err = None if not live50 or sim50 is None else (sim50 - live50) / live50
        out.append({"live": row["policy"], "sim_policy": policy, "live_ttft_p50_ms": live50,
                    "sim_ttft_p50_ms": sim50, "rel_error": err,
                    "live_ttft_p95_ms": row["ttft_ms"]["p95"], "sim_ttft_p95_ms": sims[policy]["ttft_ms"]["p95"],
                    "live_hit": row["cache_hit_rate"], "sim_hit": sims[policy]["cache_hit_rate"],
                    "sim_wall_s": sims[policy]["wall_s"]})
    return out


def format_fidelity(rows: Sequence[dict[str, Any]], time_scale: float) -> str:
    lines = [(f"fidelity: live vs simulated (same fleet, workload, policy; physical ms, live wall times / "
              f"time_scale {time_scale:g})"),
             (f"{'live run':<28} {'sim policy':<20} {'live p50':>9} {'sim p50':>9} {'error':>7}  "
              f"{'live p95':>9} {'sim p95':>9}  {'live hit':>8} {'sim hit':>8}"),
             "-" * 118]
    for r in rows:
        err = "-" if r["rel_error"] is None else f"{100 * r['rel_error']:+.1f}%"
        lines.append(f"{r['live']:<28} {r['sim_policy']:<20} {_f(r['live_ttft_p50_ms'])} {_f(r['sim_ttft_p50_ms'])} "
                     f"{err:>7}  {_f(r['live_ttft_p95_ms'])} {_f(r['sim_ttft_p95_ms'])}  "
                     f"{_pct(r['live_hit'])} {_pct(r['sim_hit'])}")
    lines.append("(TTFT in ms; error = (sim - live) / live; target |error| <= 15% on p50)")
    return "\n".join(lines)


def _pct(v: float | None) -> str:
    return f"{'-':>8}" if v is None else f"{100 * v:>7.1f}%"


# --- main -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/peers.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="trace file (default: Mooncake conversation)")
    p.add_argument("--window", type=float, default=240.0, metavar="S",
                   help="replay S seconds of the rate-scaled trace, physical time (default 240)")
    p.add_argument("--start", type=float, default=0.0, metavar="S", help="window start, seconds (default 0)")
    p.add_argument("--rate-scale", type=float, default=1.0, metavar="X",
                   help="arrival rate multiplier, physical (default 1)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--spec", default="llama-3.1-8b")
    p.add_argument("--gpu", default="H100")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="workers' wall seconds per physical second (default 1; see the docstring)")
    p.add_argument("--admission", default="fcfs", choices=("fcfs", "slomax"),
                   help="our gateway's admission (default fcfs: admit all, like the peer router and the "
                        "simulator's fidelity runs)")
    p.add_argument("--ours", default="tokenpilot,round_robin",
                   help="our gateway's routers to run, comma-separated (default tokenpilot,round_robin)")
    p.add_argument("--sglang-policy", default="cache_aware", help="SGLang router policy ('' to skip the router)")
    p.add_argument("--parts", default="routing,overhead,fidelity", help="which measurements to run")
    p.add_argument("--concurrency", type=int, default=512)
    p.add_argument("--timeout", type=float, default=300.0, help="client timeout per request (s)")
    p.add_argument("--overhead-rate", default="200,500,1000",
                   help="overhead runs' open-loop rates, req/s, comma-separated (default %(default)s)")
    p.add_argument("--overhead-peers", default="sglang,vllm-router,litellm",
                   help="peer routers of the overhead runs, comma-separated, each installed on first use "
                        "into its own venv under ~/.cache/tokenfleet/ (sglang, vllm-router, litellm; '' for "
                        "none; sglang also needs --sglang-policy)")
    p.add_argument("--overhead-requests", type=int, default=1000)
    p.add_argument("--overhead-rounds", type=int, default=5)
    p.add_argument("--overhead-max-busy", type=float, default=0.5,
                   help="start an overhead round only once the machine is below this many busy cores "
                        "(waiting up to 120 s): the cores are shared")
    p.add_argument("--fresh-connections", action="store_true",
                   help="routing runs open a connection per request (default: keep-alive)")
    p.add_argument("--overhead-connections", default="keepalive,fresh",
                   help="client connection modes of the overhead runs (keepalive, fresh)")
    p.add_argument("--baseline-ref", metavar="REF",
                   help="overhead runs: also our gateway at git commit REF (its tree, same venv), in the same rounds")
    p.add_argument("--overhead-stacks", default="auto",
                   help="our gateway's uvicorn stacks in the overhead runs, comma-separated, one gateway each: "
                        "'auto' (what `tokenfleet up` picks) or HTTP+LOOP, HTTP in auto/h11/httptools, LOOP in "
                        "auto/asyncio/uvloop (e.g. auto,h11+asyncio,httptools+uvloop)")
    p.add_argument("--no-install", action="store_true", help="do not pip-install the peer routers into their venvs")
    p.add_argument("--json", metavar="OUT.json", help="write every table's data as JSON")
    return p


async def amain(args: argparse.Namespace) -> int:
    parts = {s.strip() for s in args.parts.split(",") if s.strip()}
    unknown = parts - {"routing", "overhead", "fidelity"}
    if unknown:
        print(f"unknown part(s) {sorted(unknown)}", file=sys.stderr)
        return 2
    modes = [m.strip() for m in args.overhead_connections.split(",") if m.strip()]
    if not set(modes) <= {"keepalive", "fresh"}:
        print(f"--overhead-connections: expected keepalive and/or fresh, got {args.overhead_connections!r}",
              file=sys.stderr)
        return 2
    stacks = list(dict.fromkeys(s.strip() for s in args.overhead_stacks.split(",") if s.strip())) or ["auto"]
    try:
        for s in stacks:
            parse_stack(s)
    except ValueError as e:
        print(f"--overhead-stacks: {e}", file=sys.stderr)
        return 2
    shape = FleetShape(workers=args.workers, spec=args.spec, gpu=args.gpu, tp=args.tp, time_scale=args.time_scale,
                       admission=args.admission)
    wl = prepare_workload(args.trace, rate_scale=args.rate_scale, window_s=args.window, start_s=args.start)
    # The live replay gets the same arrivals stretched by time_scale (see the module docstring).
    wl_live = scale_rate(wl, 1.0 / shape.time_scale) if shape.time_scale != 1.0 else wl
    d = wl.describe()
    print(f"machine   {os.cpu_count()} CPU cores; python {sys.version.split()[0]}")
    print(f"workload  {d['name']} x{args.rate_scale:g}, {args.window:g} s from {args.start:g} s: {d['requests']} "
          f"requests ({d['mean_rate_rps']:.2f} req/s physical), input mean {d['input_mean']:.0f}, "
          f"output mean {d['output_mean']:.0f}; wall time x{shape.time_scale:g}", flush=True)
    busy0, t0 = _system_busy_s(), time.monotonic()
    await asyncio.sleep(2.0)
    print(f"machine   busy {(_system_busy_s() - busy0) / (time.monotonic() - t0):.2f} of {os.cpu_count()} cores "
          f"before starting (other users' work shares these cores)", flush=True)
    try:
        rates = sorted({float(r) for r in args.overhead_rate.split(",") if r.strip()})
    except ValueError:
        print(f"--overhead-rate: expected numbers, got {args.overhead_rate!r}", file=sys.stderr)
        return 2
    peer_names = [x.strip() for x in args.overhead_peers.split(",") if x.strip()]
    if bad := set(peer_names) - set(PEER_KINDS):
        print(f"--overhead-peers: unknown {sorted(bad)} (known: {', '.join(PEER_KINDS)})", file=sys.stderr)
        return 2
    if not args.sglang_policy:
        peer_names = [x for x in peer_names if x != "sglang"]
    needs_routing = bool(parts & {"routing", "fidelity"})
    sglang_py = ensure_sglang_router(not args.no_install) if args.sglang_policy and needs_routing else None
    peers = ensure_peers(peer_names, not args.no_install) if "overhead" in parts else {}
    report: dict[str, Any] = {"machine": {"cpus": os.cpu_count()}, "workload": d,
                              "fleet": gateway_fleet(shape, ["(worker)"] * shape.workers)}
    ours = [r.strip() for r in args.ours.split(",") if r.strip()]
    with tempfile.TemporaryDirectory(prefix="tokenfleet-peers-") as tmp:
        procs = Processes(Path(tmp))
        try:
            if "routing" in parts or "fidelity" in parts:
                res = await run_routing(procs, shape, wl_live, ours, args.sglang_policy or None, sglang_py,
                                        args.concurrency, args.timeout, args.fresh_connections)
                report["results"] = res.rows
                print()
                print(format_table(res.rows))
                if "fidelity" in parts:
                    fid = fidelity_rows(shape, wl, res.rows)
                    report["fidelity"] = fid
                    print()
                    print(format_fidelity(fid, shape.time_scale))
            if "overhead" in parts:
                router = ours[0] if ours else "tokenpilot"
                baseline = None
                if args.baseline_ref:
                    baseline = (args.baseline_ref, _tree_at(args.baseline_ref, Path(tmp) / "baseline-tree"))
                tables = await run_overhead(procs, peers, args.sglang_policy or "cache_aware",
                                            rates, args.overhead_requests, args.overhead_rounds,
                                            router, modes, args.overhead_max_busy, stacks=stacks,
                                            baseline=baseline)
                report["overhead"] = tables
                report["overhead_sustained"] = sustained(tables)
                for o in tables:
                    print()
                    print(format_overhead(o))
                print()
                print(format_sustained(tables))
        finally:
            procs.stop_all()
    if args.json:
        write_json(report, args.json)
        print(f"\nwrote {args.json}")
    return 0


def _tree_at(ref: str, dest: Path) -> Path:
    """The repository's tree at `ref` (`git archive`), extracted to `dest`."""
    dest.mkdir(parents=True)
    tar = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", ref], check=True,
                         capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=tar, check=True)
    return dest


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return asyncio.run(amain(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
