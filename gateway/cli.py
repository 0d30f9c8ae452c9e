"""`tokenfleet up`: launch the fleet's engines and serve the gateway in front of them.

The live composition root's command; `tokenfleet.cli` imports this module only for `up`,
so nothing here may import the simulator or the load generator."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import uvicorn

from engine_adapters.base import AdapterError, EngineAdapter
from engine_adapters.registry import build_adapters, launch_all, stop_all
from fleetcore.fleet_config import DEFAULT_FLEET_FILE, FleetConfig, load_fleet_file
from gateway.listener import ListenerCollector, bind_socket, build_listeners, protocol_class, raise_fd_limit
from gateway.liveness import heartbeat
from gateway.logs import LOG_FORMATS, configure_logging
from gateway.routing import DEFAULT_ROUTER, build_router
from gateway.shutdown import Shutdown
from tokenpilot.registry import ROUTER_NAMES

log = logging.getLogger("tokenfleet")


def _say(msg: str) -> None:
    print(f"tokenfleet: {msg}", flush=True)


def _load(path: str | None, attach: str | None = None) -> tuple[FleetConfig, list[EngineAdapter]]:
    fleet_path = Path(path) if path else DEFAULT_FLEET_FILE
    config = load_fleet_file(fleet_path)
    if attach:  # a replica of `up --replicas`: attach to the workers its parent launched
        from gateway.replicas import apply_attach
        config = apply_attach(config, attach)
    return config, build_adapters(config)


# uvicorn's own graceful timeout runs this much past the gateway's grace, so that it never cancels a
# stream before the gateway has ended it with an error event (it still bounds a client that stops reading).
SHUTDOWN_MARGIN_S = 5.0
# How often the server's main loop wakes with nothing to do: the Date header's refresh (uvicorn's own).
DATE_REFRESH_S = 1.0


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM after serving, which would kill us before the engines are
    stopped; here a signal only asks the server to finish, and `_up` cleans up after it.

    The first SIGTERM/SIGINT starts the gateway's graceful shutdown (`gateway.shutdown`: readiness
    off, streams get the grace, then an error event) while uvicorn stops accepting; a second one
    forces: whatever is still open is ended with its error event at once and the server exits."""

    def __init__(self, config: uvicorn.Config, shutdown: Shutdown | None = None,
                 on_serving: Callable[[], None] | None = None) -> None:
        self._exit_wake: asyncio.Event | None = None
        super().__init__(config)
        self.drain = shutdown  # not `shutdown`: uvicorn.Server has a method of that name
        self.on_serving = on_serving  # once the app's start-up is done and its sockets accept

    # uvicorn's main loop wakes every 0.1 s to see whether it should exit (and refreshes the Date
    # header every tenth time): 10 of an idle gateway's ~50 wakeups a second, ~100 us of CPU each
    # on a small VM (bench/README.md, "What the gateway spends with no request"). Here asking it to
    # exit wakes it, and it wakes on its own once a second, for the Date header.
    @property  # type: ignore[override]
    def should_exit(self) -> bool:
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._should_exit = value
        if value and self._exit_wake is not None:
            self._exit_wake.set()

    async def main_loop(self) -> None:
        # uvicorn runs it once start-up is over (the app's lifespan, the sockets served): the
        # moment the gateway may say it is ready
        if self.on_serving is not None:
            self.on_serving()
        self._exit_wake = asyncio.Event()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            if not self._should_exit:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._exit_wake.wait(), DATE_REFRESH_S)
            counter = (counter + 10) % 864000  # uvicorn refreshes the Date header when counter % 10 == 0
            should_exit = await self.on_tick(counter)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    def _on_signal(self) -> None:
        if self.should_exit:
            self.force_exit = True
            if self.drain is not None:
                self.drain.expire()
        elif self.drain is not None:
            self.drain.begin()
        self.should_exit = True


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop where it exists: ~7% less CPU per relayed request than asyncio's own loop
    (bench/README.md, "Gateway overhead"); uvicorn only picks it for loops it creates itself."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _dev_key(config: FleetConfig) -> str | None:
    for t in config.tenants:
        if t.api_keys:
            return t.api_keys[0]
    return None


async def _up(args: argparse.Namespace) -> int:
    from gateway.app import create_app

    config, adapters = _load(args.fleet, args.attach_instances)
    # --log-level reaches the gateway's own loggers too (tokenfleet.access, tokenfleet.audit)
    configure_logging(args.log_level, args.log_format or config.gateway.log_format)
    ops_port = args.ops_port if args.ops_port is not None else config.gateway.ops_port
    try:
        sock = bind_socket(args.host, args.port, reuse_port=args.worker_index is not None)
    except OSError as e:
        _say(f"cannot listen on {args.host}:{args.port}: {e.strerror}")
        return 2
    try:
        ops_sock = bind_socket(args.ops_host or args.host, ops_port) if ops_port is not None else None
    except OSError as e:
        sock.close()
        _say(f"cannot listen on {args.ops_host or args.host}:{ops_port} (ops): {e.strerror}")
        return 2
    # Connection caps below the open-file limit, so a flood is refused, not fatal.
    listeners, fd_warning = build_listeners(config.gateway, sock, ops_sock, raise_fd_limit())
    if fd_warning:
        log.warning(fd_warning)
    n = sum(d.instance_count for d in config.deployments)
    _say(f"launching {n} instance(s) in {len(config.sites)} site(s)...")
    # Until the server takes over signals, Ctrl-C or SIGTERM cancels the launch cleanly.
    loop, main_task = asyncio.get_running_loop(), asyncio.current_task()
    assert main_task is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, main_task.cancel)
    # A member of `--workers`/`--replicas`: its loop beats for its supervisor (gateway.liveness) from
    # here until the very end, through the graceful drain and the engines' stop, so a member still
    # finishing its streams is never taken for a hung one.
    beats = None if args.heartbeat_fd is None else asyncio.ensure_future(heartbeat(args.heartbeat_fd, args.heartbeat_s))
    try:
        try:
            instances = await launch_all(adapters)
        except AdapterError as e:
            _say(f"launch failed: {e}")
            return 1
        store = None
        if args.redis_url:
            # Several gateway replicas serving one fleet share region policies through Redis.
            from gateway.policy_store import RedisPolicyStore
            store = RedisPolicyStore(args.redis_url, config.region_policies,
                                     timeout_s=config.gateway.store_timeout_s)
        app = create_app(config, adapters, router=build_router(args.router, instances), policy_store=store,
                         planner=args.planner)
        app.state.tokenfleet.metrics.registry.register(ListenerCollector(listeners))
        if args.worker_index is not None:  # one of `--workers N`: answers say which one served them
            app.state.tokenfleet.relay.worker = f"worker{args.worker_index}"
        shutdown = app.state.tokenfleet.relay.shutdown

        def announce() -> None:
            # Said once the app has started (its lifespan: the engines' state, the fitter's import, the
            # collector's freeze; ~2 s) and accepts: said before, a client that believed it waited in the
            # listen backlog for that long (`--replicas`/`--workers` take this line for readiness).
            host, port = sock.getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            sites = sorted({i.site for i in instances})
            _say(f"{len(instances)} instance(s) ready in {len(sites)} site(s): {', '.join(sites)}")
            _say(f"gateway  http://{shown}:{port}/v1")
            if ops_sock is not None:
                ops_host, ops_bound = ops_sock.getsockname()[:2]
                _say(f"ops      http://{f'[{ops_host}]' if ':' in ops_host else ops_host}:{ops_bound}")
            key = _dev_key(config)
            _say(f"api key  {key}" if key else "api key  (none needed: the fleet file has no tenants)")
            if args.fleet is None and config.admin_api_keys:
                # Only the embedded local fleet's plain dev key: a real fleet file's keys are never echoed.
                _say(f"admin key {config.admin_api_keys[0]}  (dev only: /admin/v1/..., /dashboard, /docs)")
            budgets = sum(1 for t in config.tenants if t.budgets is not None)
            _say(f"admission {config.admission.policy} (classes {', '.join(sorted(config.admission.class_names))}; "
                 f"{budgets} tenant(s) with budgets); goodput report at /v1/reports/goodput")
            placement = app.state.tokenfleet.placement
            _say(f"planner  every {placement.core.settings.cycle_s:g} s; log at /admin/v1/planner" if placement
                 else "planner  off (replicas stay where the fleet file puts them)")
            _say("stop with Ctrl-C")

        server = _Server(uvicorn.Config(app, log_level=args.log_level, access_log=False,
                                        timeout_graceful_shutdown=math.ceil(shutdown.grace_s + SHUTDOWN_MARGIN_S),
                                        # header/body deadlines, connection caps, header limits
                                        http=protocol_class(listeners), ws="none",
                                        # longer than clients' pools keep idle connections (the
                                        # OpenAI SDK: 5 s), so a reused connection is never
                                        # closed under a request in flight
                                        timeout_keep_alive=config.gateway.keep_alive_timeout_s), shutdown,
                         on_serving=announce)
        await server.serve(sockets=[sock] if ops_sock is None else [sock, ops_sock])
    finally:
        # Runs on a signal, a launch failure or a crash alike: no engine outlives the gateway.
        _say("stopping engines...")
        await asyncio.shield(stop_all(adapters))
        sock.close()
        if ops_sock is not None:
            ops_sock.close()
        _say("stopped")
        if beats is not None:
            beats.cancel()
    return 0


def add_up_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `up` on `tokenfleet`'s subparsers; `args.func` runs it."""
    up = subparsers.add_parser("up", description=__doc__.split("\n\n")[0])
    up.add_argument("--fleet", help=f"fleet file (default: {DEFAULT_FLEET_FILE})")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    up.add_argument("--ops-port", type=int, default=None,
                    help="also serve /health, /metrics and /admin on this port, with connection caps of "
                         "its own, so a flood on --port cannot starve them (default: the fleet file's "
                         "gateway.ops_port; none: no ops listener; 0 picks a free port)")
    up.add_argument("--ops-host", help="the ops listener's address (default: --host)")
    up.add_argument("--redis-url", default=os.environ.get("TOKENFLEET_REDIS_URL"),
                    help="share region policies with other gateway replicas through this Redis "
                         "(default: $TOKENFLEET_REDIS_URL; none: in-process)")
    up.add_argument("--router", default=DEFAULT_ROUTER, choices=ROUTER_NAMES,
                    help="instance routing policy (default: %(default)s)")
    up.add_argument("--planner", action=argparse.BooleanOptionalAction, default=None,
                    help="FleetMind's replica planner on or off (default: the fleet file's planner.enabled)")
    up.add_argument("--log-level", default="warning",
                    choices=["critical", "error", "warning", "info", "debug"],
                    help="info shows one access line per request (tokenfleet.access) and admin changes "
                         "(tokenfleet.audit)")
    up.add_argument("--log-format", choices=LOG_FORMATS, default=None,
                    help="text, or one JSON object per line (default: the fleet file's gateway.log_format)")
    # Several replicas (gateway.replicas, README "Several replicas").
    up.add_argument("--replicas", type=int, default=1,
                    help="run N gateway replicas on consecutive ports from --port, in front of the fleet's "
                         "workers launched once; they share state through --redis-url, else a private "
                         "redis-server (default: %(default)s)")
    up.add_argument("--haproxy-config", metavar="PATH",
                    help="with --replicas: write an HAProxy config for the replicas here")
    up.add_argument("--haproxy-bind", default="*:8000", metavar="ADDR:PORT",
                    help="where that HAProxy listens (default: %(default)s)")
    up.add_argument("--workers", type=int, default=1,
                    help="run N gateway processes on the one --port (SO_REUSEPORT: the kernel spreads "
                         "connections over them), in front of the fleet's workers launched once; they "
                         "share budgets, ledger and load as replicas do, through --redis-url, else a "
                         "private redis-server (default: %(default)s)")
    up.add_argument("--attach-instances", metavar="PATH", help=argparse.SUPPRESS)  # set by --replicas/--workers
    up.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)  # set by --workers
    # set by --replicas/--workers: where and how often this process's event loop beats (gateway.liveness)
    up.add_argument("--heartbeat-fd", type=int, default=None, help=argparse.SUPPRESS)
    up.add_argument("--heartbeat-s", type=float, default=1.0, help=argparse.SUPPRESS)
    up.set_defaults(func=run_up)
    return up


def run_up(args: argparse.Namespace) -> int:
    if args.replicas < 1 or args.workers < 1:
        _say("--replicas and --workers must be at least 1")
        return 2
    if args.replicas > 1 and args.workers > 1:
        _say("--replicas and --workers do not combine: each replica is one process on its own port; "
             "--workers puts N processes on one port (run one `up --workers N` per host instead)")
        return 2
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        if args.replicas > 1 or args.workers > 1:
            from gateway.replicas import up_replicas
            config, adapters = _load(args.fleet)
            return runner.run(up_replicas(args, config, adapters))
        return runner.run(_up(args))
