"""`tokenfleet` command line: `up` runs a fleet and its gateway; `simulate` replays a trace through
the routing policies in virtual time; `check` validates a fleet file."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import uvicorn

from engine_adapters.base import AdapterError, EngineAdapter
from engine_adapters.registry import build_adapters, launch_all, stop_all
from fleetsim.cli import add_simulate_parser, run_simulate
from fleetsim.live import add_bench_parser, run_bench
from fleetcore.fleet_config import DEFAULT_FLEET_FILE, FleetConfig, FleetConfigError, load_fleet_file
from gateway.listener import ListenerCollector, build_listeners, protocol_class, raise_fd_limit
from gateway.routing import DEFAULT_ROUTER, build_router
from gateway.shutdown import Shutdown
from tokenpilot.registry import ROUTER_NAMES

log = logging.getLogger("tokenfleet")


def _say(msg: str) -> None:
    print(f"tokenfleet: {msg}", flush=True)


def _load(path: str | None) -> tuple[FleetConfig, list[EngineAdapter]]:
    fleet_path = Path(path) if path else DEFAULT_FLEET_FILE
    config = load_fleet_file(fleet_path)
    return config, build_adapters(config)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and
    # without it Nagle holds each small SSE event behind the client's delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


# uvicorn's own graceful timeout runs this much past the gateway's grace, so that it never cancels a
# stream before the gateway has ended it with an error event (it still bounds a client that stops reading).
SHUTDOWN_MARGIN_S = 5.0


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM after serving, which would kill us before the engines are
    stopped; here a signal only asks the server to finish, and `_up` cleans up after it.

    The first SIGTERM/SIGINT starts the gateway's graceful shutdown (`gateway.shutdown`: readiness
    off, streams get the grace, then an error event) while uvicorn stops accepting; a second one
    forces: whatever is still open is ended with its error event at once and the server exits."""

    def __init__(self, config: uvicorn.Config, shutdown: Shutdown | None = None) -> None:
        super().__init__(config)
        self.drain = shutdown  # not `shutdown`: uvicorn.Server has a method of that name

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

    config, adapters = _load(args.fleet)
    ops_port = args.ops_port if args.ops_port is not None else config.gateway.ops_port
    try:
        sock = _bind(args.host, args.port)
    except OSError as e:
        _say(f"cannot listen on {args.host}:{args.port}: {e.strerror}")
        return 2
    try:
        ops_sock = _bind(args.ops_host or args.host, ops_port) if ops_port is not None else None
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
        shutdown = app.state.tokenfleet.relay.shutdown
        server = _Server(uvicorn.Config(app, log_level=args.log_level, access_log=False,
                                        timeout_graceful_shutdown=math.ceil(shutdown.grace_s + SHUTDOWN_MARGIN_S),
                                        # header/body deadlines, connection caps, header limits
                                        http=protocol_class(listeners), ws="none",
                                        # longer than clients' pools keep idle connections (the
                                        # OpenAI SDK: 5 s), so a reused connection is never
                                        # closed under a request in flight
                                        timeout_keep_alive=config.gateway.keep_alive_timeout_s), shutdown)
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
        budgets = sum(1 for t in config.tenants if t.budgets is not None)
        _say(f"admission {config.admission.policy} (classes {', '.join(sorted(config.admission.class_names))}; "
             f"{budgets} tenant(s) with budgets); goodput report at /v1/reports/goodput")
        placement = app.state.tokenfleet.placement
        _say(f"planner  every {placement.core.settings.cycle_s:g} s; log at /admin/v1/planner" if placement
             else "planner  off (replicas stay where the fleet file puts them)")
        _say("stop with Ctrl-C")
        await server.serve(sockets=[sock] if ops_sock is None else [sock, ops_sock])
    finally:
        # Runs on a signal, a launch failure or a crash alike: no engine outlives the gateway.
        _say("stopping engines...")
        await asyncio.shield(stop_all(adapters))
        sock.close()
        if ops_sock is not None:
            ops_sock.close()
        _say("stopped")
    return 0


def _check(args: argparse.Namespace) -> int:
    config, _ = _load(args.fleet)
    n = sum(d.instance_count for d in config.deployments)
    print(f"{args.fleet or DEFAULT_FLEET_FILE}: ok — {len(config.sites)} site(s), "
          f"{len(config.models)} model(s), {n} instance(s), {len(config.tenants)} tenant(s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenfleet", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="launch the fleet's engines and the gateway in front of them")
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
                    choices=["critical", "error", "warning", "info", "debug"])
    chk = sub.add_parser("check", help="validate a fleet file")
    chk.add_argument("--fleet", help=f"fleet file (default: {DEFAULT_FLEET_FILE})")
    add_simulate_parser(sub)
    add_bench_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.command == "up":
            with asyncio.Runner(loop_factory=_loop_factory()) as runner:
                return runner.run(_up(args))
        if args.command == "simulate":
            return run_simulate(args)
        if args.command == "bench":
            return run_bench(args)
        return _check(args)
    except FleetConfigError as e:
        print(e, file=sys.stderr)
        return 2
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 130


if __name__ == "__main__":
    sys.exit(main())
