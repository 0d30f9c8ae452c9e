"""Bytecodes a streamed request executes, per layer of the gateway: where the interpreter's work goes.

    .venv/bin/python bench/opcode_layers.py [--requests 200] [--chunks 4] [--top 40] [--listener]

callgrind (`bench/callgrind_request.py`) counts instructions exactly but sees only C functions:
every Python function is `_PyEval_EvalFrameDefault`. This script names them. It runs the
gateway of `bench/profile_gateway.py` (`create_app` over one static instance, TokenPilot, FCFS,
uvicorn's own protocol, or with `--listener` the gateway's listener as `tokenfleet up` serves
(its caps and deadlines, the /v1 lane of `gateway.lane_cycle`), a stub engine in this process streaming `--chunks` token chunks, then usage and
[DONE]) and, after a warm-up of 60 requests, counts every bytecode the event loop's thread
executes (`sys.settrace` with `f_trace_opcodes`) while `--requests` requests run one at a time.
It prints bytecodes per request by layer (a function's layer is where its code lives; the
table `LAYERS` below, first match wins) and the functions with the most. The frames of
dataclasses' generated `__init__` are named by their caller. What C does inside a call (json,
the regex, httptools, numpy, object allocation) is not a bytecode: callgrind's `--top` and
`callgrind_annotate --inclusive=yes` on a `--keep` dump give those. Counts do not move with the
machine's load. Linux (as profile_gateway.py).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import otel_overhead as oo  # noqa: E402  (bench/ is not a package)

ROOT = oo.ROOT

# (layer, substrings of the code's file, function names or None for all); first match wins
LAYERS: tuple[tuple[str, tuple[str, ...], tuple[str, ...] | None], ...] = (
    ("server protocol (uvicorn, listener)", ("/uvicorn/", "/gateway/listener.py", "/gateway/head_hold.py",
                                             "/gateway/lane_cycle.py"), None),
    ("ASGI lane (FastLane, body read, Request)", ("/gateway/fast_path.py", "/gateway/body_limit.py",
                                                  "/gateway/overload.py", "/starlette/"), None),
    ("parse + tokenize", ("/gateway/requests.py", "/gateway/json_body.py", "/fleetcore/prefix.py",
                          "/fleetcore/tokens.py", "/fleetcore/model_tokenizer.py", "/json/",
                          "/gateway/openai_fields.py"), None),
    ("dataclasses.replace (telemetry's record, admission's class)", ("/dataclasses.py", "<string>:dataclasses.py",
                                                                      "/fleetcore/fast_replace.py",
                                                                      "<string>:fast_replace.py"), None),
    ("handler skeleton, auth, request id", ("/gateway/serving.py", "/gateway/aliases.py", "/gateway/app.py",
                                            "/gateway/auth.py", "/gateway/keys.py"), None),
    ("admission", ("/gateway/admission.py", "/slomax/", "<string>:fcfs.py", "<string>:admission.py"), None),
    ("decision (place, site, instance)", ("/fleetmind/", "/tokenpilot/", "/gateway/fleet_state.py",
                                          "/fleetcore/region_policy.py", "/gateway/policy_sync.py",
                                          "/fleetcore/fleet_config.py", "/fleetcore/types.py",
                                          "/gateway/routing.py", "/numpy/", "<string>:router.py",
                                          "<string>:place.py", "<string>:site_choice.py"), None),
    ("upstream client (write, read)", ("/gateway/upstream_http.py",), None),
    ("SSE per-event work", ("/fleetcore/sse.py",), None),
    ("SSE per-event work", ("/gateway/relay.py",), ("_process",)),
    ("response writes", ("/gateway/relay.py",), ("_write", "raw_headers", "<listcomp>", "__call__")),
    ("task / future plumbing, deadlines", ("/gateway/relay.py",), ("race", "aclose", "_start", "take_gone",
                                                                    "_read", "iter_bytes", "_leg",
                                                                    "take_pending", "_checked", "_finish_due")),
    ("task / future plumbing, deadlines", ("/asyncio/", "/gateway/deadlines.py", "contextlib.py",
                                           "_weakrefset.py", "/fleetcore/first_byte.py"), None),
    ("attempt bookkeeping (finish, outcome, policy feedback)", ("/gateway/relay.py",),
     ("finish", "_outcome", "observe", "close_upstream", "first_token", "headers", "close", "end_leg")),
    ("relay: the rest (dispatch, attempts, new objects)", ("/gateway/relay.py", "<string>:relay.py",
                                                           "/gateway/shutdown.py"), None),
    ("telemetry, metrics, logs", ("/gateway/telemetry.py", "/gateway/metrics.py", "/prometheus_client/",
                                  "/logging/", "/gateway/logs.py", "/gateway/slo_log.py",
                                  "<string>:telemetry.py", "/gateway/dashboard.py", "/fleetcore/slo.py"), None),
    ("continuation", ("/gateway/continuation.py", "/gateway/resume.py", "/fleetcore/continuation.py"), None),
    ("loop monitor", ("/gateway/loop_monitor.py",), None),
)


def layer_of(filename: str, name: str) -> str:
    for label, files, names in LAYERS:
        if any(f in filename for f in files) and (names is None or name in names):
            return label
    return "other"


def _serve_through_listener() -> None:
    """`uvicorn.run` as `tokenfleet up` serves (gateway/cli.py): the listener's protocol
    (`GuardedHttpToolsProtocol`, caps, deadlines, the /v1 lane) on a socket bound by
    `bind_socket`, uvicorn's default proxy-headers middleware in front of the app."""
    import uvicorn

    from fleetcore.fleet_config import GatewaySettings
    from gateway.listener import bind_socket, build_listeners, protocol_class

    def run(app: Any, *, host: str, port: int, **kwargs: Any) -> None:
        sock = bind_socket(host, port)
        listeners, _ = build_listeners(GatewaySettings(), sock, None, 4096)
        server = uvicorn.Server(uvicorn.Config(app, http=protocol_class(listeners), ws="none", **kwargs))
        server.run(sockets=[sock])  # the loop uvicorn picks (uvloop), as `tokenfleet up`

    uvicorn.run = run  # type: ignore[assignment]


def child(port: int, engine_url: str, out: str, listener: bool = False) -> None:
    counts: collections.Counter[Any] = collections.Counter()

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            code = frame.f_code
            if code.co_filename == "<string>" and frame.f_back is not None:  # dataclasses' __init__: its caller
                back = frame.f_back.f_code
                counts[(f"<string>:{Path(back.co_filename).name}", f"{code.co_name} from {back.co_name}", 0)] += 1
            else:
                counts[(code.co_filename, code.co_name, code.co_firstlineno)] += 1
        return local

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event == "call":
            frame.f_trace_opcodes = True
            return local
        return None

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGUSR1, lambda signum, frame: sys.settrace(tracer))  # the loop's thread
    signal.signal(signal.SIGTERM, _exit)
    sys.path.insert(0, str(ROOT))
    import gateway.app
    import slomax

    make = slomax.make_admission
    gateway.app.make_admission = lambda _policy, cfg=None: make("fcfs", cfg)  # type: ignore[assignment]
    if listener:
        _serve_through_listener()
    try:
        oo.child(port, engine_url)
    finally:
        sys.settrace(None)
        with open(out, "w") as f:
            json.dump([[*k, n] for k, n in counts.items()], f)


async def run(args: argparse.Namespace, out: str) -> None:
    runner, engine_url = await oo.serve(oo.engine_app(args.chunks))
    port = oo.free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--child", str(port), engine_url, out,
                             *(["--listener"] if args.listener else [])], cwd=ROOT)
    try:
        url = f"http://127.0.0.1:{port}"
        await oo.wait_ready(url, proc)
        async with aiohttp.ClientSession() as session:
            await oo.round_of(session, url, 60, 1)  # warm-up: lazy imports, caches
            proc.send_signal(signal.SIGUSR1)
            await asyncio.sleep(0.5)
            await oo.round_of(session, url, args.requests, 1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        await runner.cleanup()


def report(out: str, requests: int, top: int) -> None:
    with open(out) as f:
        rows = json.load(f)
    by_layer: collections.Counter[str] = collections.Counter()
    by_fn: collections.Counter[tuple[str, str, int]] = collections.Counter()
    for filename, name, line, n in rows:
        by_layer[layer_of(filename, name)] += n
        by_fn[(filename.split("site-packages/")[-1].replace(str(ROOT) + "/", ""), name, line)] += n
    total = sum(by_layer.values())
    print(f"bytecodes per request: {total / requests:,.0f} ({requests} requests)")
    for label, n in by_layer.most_common():
        print(f"  {n / requests:8,.0f}  {100 * n / total:5.1f}%  {label}")
    print(f"top {top} functions (bytecodes per request):")
    for (filename, name, line), n in by_fn.most_common(top):
        print(f"  {n / requests:8,.0f}  {filename}:{line}({name})")


def main() -> int:
    p = argparse.ArgumentParser(description="Bytecodes per streamed request, per layer of the gateway.")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--chunks", type=int, default=4, help="token chunks per answer from the stub engine")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--listener", action="store_true",
                   help="serve through the gateway's listener as `tokenfleet up` does (default: uvicorn's own protocol)")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(int(args.child[0]), args.child[1], args.child[2], args.listener)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "opcodes.json")
        asyncio.run(run(args, out))
        report(out, args.requests, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
