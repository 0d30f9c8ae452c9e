"""`tokenfleet up --replicas N` / `--workers N`: the fleet's workers once, N gateway processes in front.

`--replicas`: each process on its own port (a load balancer in front: `--haproxy-config`).
`--workers`: every process on the one `--port`, bound with SO_REUSEPORT, so the kernel spreads
connections over them — one host's several cores without a balancer. Both share state the same
way (each process is a replica to Redis: budgets, ledger, load, policies) and are run, restarted
and stopped the same way, below.

This process launches (and supervises) the simulated workers, then starts each replica as
`tokenfleet up --attach-instances FILE` on its own port: the file gives every sim deployment its
workers' URLs, so a replica attaches to them (`engine_adapters.sim` attach mode: same instance
ids, KV events still streamed) and never launches or supervises them itself. Region policies are
shared through Redis: `--redis-url`, else a private `redis-server` this process runs.

Stopping (SIGTERM/Ctrl-C): every replica gets SIGTERM (its own graceful shutdown), a second
signal forces them; then the workers are stopped, then the private Redis. A replica that dies
is started again on its port after a backoff that doubles up to the fleet file's
`engine_restart_backoff_max_s`. So is one that hangs: each replica's event loop beats on a pipe
of its own (`gateway.liveness`), and one silent for `gateway.liveness_timeout_s` is SIGKILLed
(its process group) and then restarted the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import math
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine_adapters.base import AdapterError, EngineAdapter
from engine_adapters.process import kill, spawn, terminate
from engine_adapters.registry import launch_all, stop_all
from fleetcore.fleet_config import FleetConfig
from gateway.liveness import BeatPipe, Pulse, beat_interval

log = logging.getLogger("tokenfleet.replicas")

READY_TIMEOUT_S = 60.0  # a replica loads the fleet file and binds; far less than this
REDIS_READY_TIMEOUT_S = 10.0
STOP_EXTRA_S = 10.0  # past the replicas' own grace + margin before they are killed
_KEEP_LINES = 50  # of each replica's output, for the message when it fails


def _say(msg: str) -> None:
    print(f"tokenfleet: {msg}", flush=True)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _url(host: str, port: int) -> str:
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def unattachable(config: FleetConfig) -> list[str]:
    """Deployments replicas cannot share: engines launched by vLLM/SGLang adapters (attach them
    with `options.urls` instead, so whoever runs them owns them)."""
    return [f"{d.site}/{d.model} ({d.adapter})" for d in config.deployments
            if d.adapter in ("vllm", "sglang") and not d.options.get("urls")]


def attach_view(config: FleetConfig, adapters: list[EngineAdapter]) -> dict[str, list[str]]:
    """Deployment index -> its launched workers' URLs (`build_adapters` keeps the file's order)."""
    return {str(i): [inst.url for inst in a.instances]
            for i, (d, a) in enumerate(zip(config.deployments, adapters, strict=True))
            if d.adapter == "sim" and not d.options.get("urls")}


def apply_attach(config: FleetConfig, path: str) -> FleetConfig:
    """The fleet with each sim deployment named in `path` attached to the URLs given there."""
    try:
        view = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise SystemExit(f"tokenfleet: cannot read --attach-instances {path}: {e}") from None
    deployments = list(config.deployments)
    for key, urls in view.items():
        d = deployments[int(key)]
        deployments[int(key)] = d.model_copy(update={"instances": len(urls), "options": {**d.options, "urls": urls}})
    return config.model_copy(update={"deployments": deployments})


@contextlib.asynccontextmanager
async def private_redis() -> collections.abc.AsyncIterator[str]:
    """A redis-server of our own: loopback, a free port, data in a temp dir, no persistence."""
    exe = shutil.which("redis-server")
    assert exe is not None
    port = _free_port("127.0.0.1")
    with tempfile.TemporaryDirectory(prefix="tokenfleet-redis-") as d:
        proc = await spawn([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                            "--dir", d], stdout=asyncio.subprocess.DEVNULL,
                            own_group=True)  # a signal to our process group must not stop it before the replicas
        try:
            deadline = time.monotonic() + REDIS_READY_TIMEOUT_S
            while True:
                try:
                    _, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 1.0)
                    w.close()
                    break
                except (OSError, asyncio.TimeoutError):
                    if proc.returncode is not None or time.monotonic() > deadline:
                        raise AdapterError(f"private redis-server did not start on port {port}") from None
                    await asyncio.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            await terminate([proc], 5.0)


@dataclass
class Replica:
    index: int
    port: int
    argv: list[str]
    kind: str = "replica"  # or "worker" (`--workers`): how messages name it
    # Killed when its event loop sends no heartbeat for this long (None: no heartbeat asked of it).
    liveness_timeout_s: float | None = None
    proc: asyncio.subprocess.Process | None = None
    restarts: int = 0
    hangs: int = 0  # kills for a missed heartbeat (each then restarted like an exit)
    pulse: Pulse | None = None  # its heartbeat, once it said it is ready
    lines: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=_KEEP_LINES))
    _beats: BeatPipe | None = None

    async def start(self) -> str:
        """Spawn and wait for the line giving its URL; returns that URL."""
        self.close_beats()  # the last start's pipe, if any
        self.pulse = None
        try:
            return await self._start()
        except BaseException:
            self.close_beats()
            raise

    def _with_heartbeat(self) -> tuple[list[str], tuple[int, ...]]:
        """Its command line and the descriptors it keeps: with a timeout, a heartbeat pipe of this start's own."""
        if self.liveness_timeout_s is None:
            return self.argv, ()
        self._beats = BeatPipe()
        fd = self._beats.write_fd
        return [*self.argv, "--heartbeat-fd", str(fd), "--heartbeat-s", f"{beat_interval(self.liveness_timeout_s):g}"], (fd,)

    async def _start(self) -> str:
        argv, pass_fds = self._with_heartbeat()
        # own_group: a Ctrl-C in the terminal reaches only us, so each replica gets one SIGTERM
        # (a second would force it); die_with_parent (in spawn): no replica outlives us.
        try:
            self.proc = await spawn(argv, own_group=True, pass_fds=pass_fds)
        except OSError as e:  # EAGAIN/ENOMEM/EMFILE: an AdapterError, so a restart is tried again
            raise AdapterError(f"{self.kind} {self.index}: cannot start {self.argv[0]}: {e}") from None
        finally:
            if self._beats is not None:
                self._beats.handed_over()
        assert self.proc.stdout is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            left = deadline - time.monotonic()
            try:
                raw = await asyncio.wait_for(self.proc.stdout.readline(), max(left, 0.001))
            except asyncio.TimeoutError:
                raise AdapterError(f"{self.kind} {self.index} did not start in {READY_TIMEOUT_S:.0f} s") from None
            if not raw:
                code = await self.proc.wait()
                tail = "; ".join(list(self.lines)[-3:])
                raise AdapterError(f"{self.kind} {self.index} exited with code {code} while starting: {tail}")
            line = raw.decode(errors="replace").rstrip()
            self.lines.append(line)
            if line.startswith("tokenfleet: gateway "):
                asyncio.get_running_loop().create_task(self._drain())
                if self._beats is not None and self.liveness_timeout_s is not None:
                    self._beats.arrived()  # beats from its start-up do not count: the clock starts now
                    self.pulse = Pulse(self.liveness_timeout_s, time.monotonic())
                return line.split()[-1]

    async def _drain(self) -> None:
        # Keep reading, so a replica never blocks on a full pipe; the tail explains a crash.
        assert self.proc is not None and self.proc.stdout is not None
        async for raw in self.proc.stdout:
            self.lines.append(raw.decode(errors="replace").rstrip())

    def beaten(self) -> bool:
        """Whether its loop beat since the last look."""
        return self._beats is not None and self._beats.arrived()

    def close_beats(self) -> None:
        if self._beats is not None:
            self._beats.close()
            self._beats = None


def replica_argv(args: argparse.Namespace, port: int, ops_port: int | None, redis_url: str,
                 attach_file: str, worker_index: int | None = None) -> list[str]:
    """`worker_index`: one of `--workers` (binds `port` with SO_REUSEPORT, says which worker it is)."""
    argv = [sys.executable, "-m", "tokenfleet.cli", "up", "--host", args.host, "--port", str(port),
            "--redis-url", redis_url, "--attach-instances", attach_file, "--router", args.router,
            "--log-level", args.log_level]
    if worker_index is not None:
        argv += ["--worker-index", str(worker_index)]
    if args.fleet:
        argv += ["--fleet", str(Path(args.fleet).resolve())]
    if ops_port is not None:
        argv += ["--ops-port", str(ops_port)]
    if args.ops_host:
        argv += ["--ops-host", args.ops_host]
    if args.planner is not None:
        argv.append("--planner" if args.planner else "--no-planner")
    return argv


def workers_mode(args: argparse.Namespace) -> bool:
    """`--workers N`: N processes on one port (else `--replicas N`: a port each)."""
    return getattr(args, "workers", 1) > 1


async def up_replicas(args: argparse.Namespace, config: FleetConfig, adapters: list[EngineAdapter]) -> int:
    workers = workers_mode(args)
    n, flag, what = (args.workers, "--workers", "workers") if workers else (args.replicas, "--replicas", "replicas")
    if bad := unattachable(config):
        _say(f"{flag} {n}: these deployments launch engines a gateway process cannot share: {', '.join(bad)}; "
             "run the engines yourself and attach them with `options: {urls: [...]}`")
        return 2
    if not args.redis_url and shutil.which("redis-server") is None:
        _say(f"{flag} {n} needs a Redis the {what} share budgets, ledger, load and region policies through: "
             "give --redis-url (or $TOKENFLEET_REDIS_URL), or install redis-server to have a private one started")
        return 2
    if workers and args.haproxy_config:
        _say("--haproxy-config is for --replicas (a port each); --workers share one port: no balancer needed")
        return 2
    base_ops = args.ops_port if args.ops_port is not None else config.gateway.ops_port
    # Consecutive ports from --port (0: free ones); each checked now, before anything is launched.
    # Workers: all on the one port (SO_REUSEPORT); their ops listeners still a port each, so that
    # /metrics and /health answer for one known process.
    if workers:
        ports = [_free_port(args.host) if args.port == 0 else args.port] * n
    else:
        ports = [_free_port(args.host) for _ in range(n)] if args.port == 0 else [args.port + i for i in range(n)]
    ops_ports: list[int | None] = [None] * n if base_ops is None else (
        [_free_port(args.ops_host or args.host) for _ in range(n)] if base_ops == 0 else [base_ops + i for i in range(n)])
    for p in sorted({*ports, *(q for q in ops_ports if q is not None)}):
        try:
            with socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET) as s:
                s.bind((args.host, p))
        except OSError as e:
            _say(f"cannot listen on {args.host}:{p}: {e.strerror}")
            return 2

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        stop.set()
        if signals > 1:  # the second signal forces every replica, as it does a single gateway
            for r in replicas:
                if r.proc is not None and r.proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        r.proc.send_signal(signal.SIGTERM)

    replicas: list[Replica] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        return await _run(args, config, adapters, n, ports, ops_ports, stop, replicas)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _run(args: argparse.Namespace, config: FleetConfig, adapters: list[EngineAdapter], n: int,
               ports: list[int], ops_ports: list[int | None], stop: asyncio.Event, replicas: list[Replica]) -> int:
    """`replicas` is filled in place: the signal handler forwards a second signal to its members."""
    grace_s = config.gateway.shutdown_grace_s
    from gateway.cli import SHUTDOWN_MARGIN_S
    async with contextlib.AsyncExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="tokenfleet-replicas-"))
        if args.redis_url:
            redis_url = args.redis_url
        else:
            redis_url = await stack.enter_async_context(private_redis())
            _say(f"redis    {redis_url} (private: stopped with the fleet)")
        total = sum(d.instance_count for d in config.deployments)
        workers = workers_mode(args)
        what = "workers" if workers else "replicas"
        _say(f"launching {total} instance(s) in {len(config.sites)} site(s), once for {n} {what}...")
        stack.push_async_callback(_stop_workers, adapters)
        launch = asyncio.ensure_future(launch_all(adapters))
        waiter = asyncio.ensure_future(stop.wait())
        await asyncio.wait({launch, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if not launch.done():
            launch.cancel()
            with contextlib.suppress(BaseException):
                await launch
            return 130
        try:
            instances = launch.result()
        except AdapterError as e:
            _say(f"launch failed: {e}")
            return 1
        attach_file = str(Path(tmp) / "attach.json")
        Path(attach_file).write_text(json.dumps(attach_view(config, adapters)), encoding="utf-8")
        replicas.extend(Replica(i, ports[i], replica_argv(args, ports[i], ops_ports[i], redis_url, attach_file,
                                                          i if workers else None), "worker" if workers else "replica",
                                liveness_timeout_s=config.gateway.liveness_timeout_s)
                        for i in range(n))
        stack.push_async_callback(_stop_replicas, replicas, grace_s + SHUTDOWN_MARGIN_S + STOP_EXTRA_S)
        try:
            urls = await asyncio.gather(*(r.start() for r in replicas))
        except AdapterError as e:
            _say(f"{what[:-1]} failed: {e}")
            return 1
        sites = sorted({i.site for i in instances})
        _say(f"{len(instances)} instance(s) ready in {len(sites)} site(s): {', '.join(sites)}")
        for r, url in zip(replicas, urls, strict=True):
            assert r.proc is not None
            _say(f"gateway  {r.kind} {r.index} (pid {r.proc.pid})  {url}")
        if args.haproxy_config:
            from gateway.haproxy_config import render
            Path(args.haproxy_config).write_text(
                render([(args.host, p) for p in ports], args.haproxy_bind,
                       keep_alive_s=math.ceil(config.gateway.keep_alive_timeout_s)), encoding="utf-8")
            _say(f"haproxy  config for {n} replicas at {args.haproxy_config} (listens on {args.haproxy_bind})")
        key = next((t.api_keys[0] for t in config.tenants if t.api_keys), None)
        _say(f"api key  {key}" if key else "api key  (none needed: the fleet file has no tenants)")
        _say("stop with Ctrl-C")
        watchers = [asyncio.ensure_future(_watch(r, config, stop)) for r in replicas]
        await stop.wait()
        for w in watchers:
            w.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        _say(f"stopping {what}...")
        # The exit stack unwinds in reverse: replicas (graceful), then workers, then the private Redis.
    _say("stopped")
    return 0


async def _watch(r: Replica, config: FleetConfig, stop: asyncio.Event) -> None:
    """Restart a replica that died or hung, on its port, after a backoff (reset once it stayed up)."""
    backoff = config.gateway.engine_restart_backoff_s
    backoff_max = max(config.gateway.engine_restart_backoff_max_s, backoff)
    while not stop.is_set():
        assert r.proc is not None
        started = time.monotonic()
        code = await _until_exit(r)
        if stop.is_set():
            return
        if time.monotonic() - started > backoff_max:
            backoff = config.gateway.engine_restart_backoff_s
        _say(f"{r.kind} {r.index} (port {r.port}) exited with code {code}; restarting in {backoff:g} s" if code is not None
             else f"{r.kind} {r.index} (port {r.port}) outlived its SIGKILL; starting another in {backoff:g} s")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), backoff)
        if stop.is_set():
            return
        backoff = min(backoff * 2, backoff_max)
        try:
            url = await r.start()
        except AdapterError as e:
            _say(f"{r.kind} {r.index} restart failed: {e}")
            # One that never said it was ready (READY_TIMEOUT_S: hung loading or binding) is still
            # running: the wait above waited on it for ever and the worker was never tried again.
            if r.proc is not None and r.proc.returncode is None:
                await terminate([r.proc], STOP_EXTRA_S, groups=True)
            continue
        r.restarts += 1
        assert r.proc is not None
        hung = f"; {r.hangs} after a missed heartbeat" if r.hangs else ""
        _say(f"gateway  {r.kind} {r.index} (pid {r.proc.pid})  {url} (restart {r.restarts}{hung})")


async def _until_exit(r: Replica) -> int | None:
    """Wait for `r` to exit, killing it first if its heartbeat stops; its exit code (None: it
    outlived even SIGKILL, in uninterruptible sleep, and is left to the kernel).

    Wakes only to look at the heartbeat pipe (a few times per timeout), never per beat; a
    cancel (the fleet's stop) ends the wait at once."""
    assert r.proc is not None
    exited = asyncio.ensure_future(r.proc.wait())
    try:
        if r.pulse is None:
            return await exited
        while not exited.done():
            wait_s = r.pulse.look(time.monotonic(), r.beaten())
            if wait_s <= 0:
                await _kill_hung(r)
                break
            await asyncio.wait({exited}, timeout=wait_s)
        return r.proc.returncode
    finally:
        exited.cancel()


async def _kill_hung(r: Replica) -> None:
    assert r.proc is not None and r.pulse is not None
    r.hangs += 1
    _say(f"{r.kind} {r.index} (pid {r.proc.pid}) sent no heartbeat for "
         f"{r.pulse.silent_for(time.monotonic()):.0f} s: killed")
    # Its whole group: it cannot stop what it started when its loop does not run.
    await kill(r.proc, group=True)


async def _stop_replicas(replicas: list[Replica], timeout_s: float) -> None:
    # Each replica drains on its own SIGTERM; past its grace it is killed, never waited on forever.
    # (Their heartbeats are no longer judged: the watchers were cancelled before this.)
    await terminate([r.proc for r in replicas if r.proc is not None], timeout_s, groups=True)
    for r in replicas:
        r.close_beats()


async def _stop_workers(adapters: list[EngineAdapter]) -> None:
    _say("stopping engines...")
    await asyncio.shield(stop_all(adapters))
