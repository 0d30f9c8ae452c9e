"""CPU per relayed streaming request of the gateway's server side: this tree against another commit's.

    .venv/bin/python bench/server_cycle_cost.py --baseline-ref main [--rate 1000] [--requests 3000]
        [--rounds 5] [--connections keepalive|fresh] [--tokens 4]

Two gateway processes (`tokenfleet up --router tokenpilot`, FCFS admission, over one `adapter:
static` instance: the real listener, `GuardedHttpToolsProtocol`, with its caps and deadlines),
one running this tree's code and one `--baseline-ref`'s (`git archive`), both in front of the
same stub engine (its own process: a bare asyncio + httptools server, so that the engine costs
the gateways' rounds little; each `/v1/completions` is answered with `--tokens` token events, a
usage event and `[DONE]`, one chunked write each with a loop turn between, as an engine streams
them). This process sends `--requests` streamed completions per round, open loop at `--rate`
(64-word prompts, `max_tokens` = `--tokens`), over keep-alive connections (a pool that grows
when every connection is busy) or a new connection per request (`--connections fresh`), with a
client of raw sockets (no HTTP library: it costs the 2 shared cores little and adds no
connection handling of its own). Rounds alternate between the two gateways (A B A B ...), so a
neighbour's load hits both alike. CPU is each gateway process's user + system time
(/proc/<pid>/stat) over its round, per request; every answer is checked (status 200, chunked,
ends with `[DONE]` and the chunked terminator). Printed per round and as medians, with the ratio
this tree / baseline and the machine's busy cores during the rounds. No input files (the
prompts are generated: word `i % 50` of a fixed list).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path


HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import peers  # noqa: E402  (bench/ is not a package)
from raw_client import StreamClient  # noqa: E402

WORDS = ("the of and to in is that for it as with was on be by at this from or an are not fleet token "
         "gateway stream route cache prefix block engine model request answer queue admit decide place "
         "price budget class tenant region site replica worker core loop event chunk").split()


# --- the stub engine (its own process) -------------------------------------------------

def engine_main(port_file: str, tokens: int) -> None:
    import httptools
    import uvloop

    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"

    def chunk(ev: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(ev), ev)

    events = [chunk(b'data: {"id":"cmpl-1","object":"text_completion","model":"bench-model","choices":'
                    b'[{"index":0,"text":" t%d","finish_reason":%s}]}\n\n'
                    % (i, b'"length"' if i == tokens - 1 else b"null")) for i in range(tokens)]
    events.append(chunk(b'data: {"id":"cmpl-1","object":"text_completion","model":"bench-model","choices":[],'
                        b'"usage":{"prompt_tokens":64,"completion_tokens":%d,"total_tokens":%d}}\n\n'
                        % (tokens, 64 + tokens)))
    events.append(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    plain = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"
    missing = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"

    class Engine(asyncio.Protocol):
        def __init__(self) -> None:
            self.parser = httptools.HttpRequestParser(self)
            self.url = b""
            self.transport: asyncio.Transport | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport  # type: ignore[assignment]

        def data_received(self, data: bytes) -> None:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                assert self.transport is not None
                self.transport.close()

        def on_message_begin(self) -> None:
            self.url = b""

        def on_url(self, url: bytes) -> None:
            self.url += url

        def on_message_complete(self) -> None:
            assert self.transport is not None
            method = self.parser.get_method()
            if method == b"POST" and self.url.startswith(b"/v1/completions"):
                asyncio.get_running_loop().create_task(self._stream(self.transport))
            elif method == b"GET" and self.url in (b"/health", b"/metrics"):
                self.transport.write(plain)
            else:
                self.transport.write(missing)

        async def _stream(self, transport: asyncio.Transport) -> None:
            transport.write(head + events[0])
            for ev in events[1:]:
                await asyncio.sleep(0)  # one event per loop turn: separate segments, as an engine's
                if transport.is_closing():
                    return
                transport.write(ev)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        srv = await loop.create_server(Engine, "127.0.0.1", 0, backlog=2048)
        Path(port_file).write_text(str(srv.sockets[0].getsockname()[1]))
        await srv.serve_forever()

    uvloop.run(serve())


# --- the client (this process) ---------------------------------------------------------

def _requests(port: int, n: int, tokens: int, keepalive: bool) -> list[bytes]:
    out = []
    for i in range(n):
        prompt = " ".join(WORDS[(i + k) % len(WORDS)] + str(i % 97) for k in range(64))
        body = json.dumps({"model": peers.MODEL, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True,
                           "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}).encode()
        out.append(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nAuthorization: Bearer %s\r\n"
                   b"Content-Type: application/json\r\nAccept: text/event-stream\r\n%sContent-Length: %d\r\n\r\n%s"
                   % (port, peers.API_KEY.encode(), b"" if keepalive else b"Connection: close\r\n", len(body), body))
    return out


def _check(answer: bytes) -> None:
    if not answer.startswith(b"HTTP/1.1 200 ") or b"data: [DONE]" not in answer:
        raise RuntimeError(f"bad answer: {answer[:300]!r}")


async def one_round(port: int, requests: Sequence[bytes], rate: float, keepalive: bool,
                    max_connections: int) -> tuple[float, int]:
    """Send `requests` open loop at `rate` over at most `max_connections` at once (a request
    waits for a free one past that); return the wall time and the connections opened. Every
    answer is checked."""
    loop = asyncio.get_running_loop()
    idle: asyncio.Queue[StreamClient] = asyncio.Queue()
    pool: list[StreamClient] = []
    slots = asyncio.Semaphore(max_connections)

    async def send(req: bytes) -> None:
        async with slots:
            conn = idle.get_nowait() if not idle.empty() else None
            if conn is None:
                _, conn = await loop.create_connection(StreamClient, "127.0.0.1", port)  # type: ignore[assignment]
                pool.append(conn)  # type: ignore[arg-type]
            assert conn is not None
            _check(await conn.ask(req))
            if keepalive:
                idle.put_nowait(conn)
            else:
                await asyncio.wait_for(conn.closed, 10)  # the gateway closes (Connection: close)

    t0 = loop.time()
    tasks = []
    for i, req in enumerate(requests):
        delay = t0 + i / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(loop.create_task(send(req)))
    await asyncio.gather(*tasks)
    wall = loop.time() - t0
    for conn in pool:
        if conn.transport is not None:
            conn.transport.close()
    return wall, len(pool)


async def amain(args: argparse.Namespace) -> int:
    import uvloop  # noqa: F401

    keepalive = args.connections == "keepalive"
    with tempfile.TemporaryDirectory(prefix="tokenfleet-server-cycle-") as tmp:
        procs = peers.Processes(Path(tmp))
        try:
            port_file = Path(tmp) / "engine.port"
            engine = procs.spawn("engine", [sys.executable, __file__, "--engine", str(port_file), str(args.tokens)])
            deadline = time.monotonic() + 30
            while not port_file.exists() or not port_file.read_text():
                if engine.popen.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"stub engine did not start:\n{engine.log_tail()}")
                await asyncio.sleep(0.05)
            url = f"http://127.0.0.1:{port_file.read_text()}"
            sides: list[tuple[str, Path | None]] = [("this tree", None)]
            if args.baseline_ref:
                sides.insert(0, (f"@{args.baseline_ref}", peers._tree_at(args.baseline_ref, Path(tmp) / "baseline")))
            gws = {}
            shape = peers.FleetShape(workers=1)
            for i, (name, tree) in enumerate(sides):
                gws[name] = await peers.start_gateway(procs, shape, [url], "tokenpilot", name=f"gateway{i}", tree=tree)
            ports = {name: int(gw.url.removesuffix("/v1").rsplit(":", 1)[1]) for name, gw in gws.items()}
            reqs = {name: _requests(ports[name], args.requests, args.tokens, keepalive) for name in gws}
            for name in gws:  # warm-up: imports, pools, the first fit's thread
                await one_round(ports[name], reqs[name][: max(200, args.requests // 5)], args.rate, keepalive,
                                args.max_connections)
            per_req: dict[str, list[float]] = {name: [] for name in gws}
            busy: list[float] = []
            print(f"{args.requests} streamed completions per round at {args.rate:g}/s, {args.connections}, "
                  f"{args.tokens} tokens each; load average {os.getloadavg()[0]:.2f} before the rounds", flush=True)
            for r in range(args.rounds):
                line = []
                for name, gw in gws.items():
                    cpu0, busy0 = peers._tree_cpu_seconds(gw.popen.pid), peers._system_busy_s()
                    wall, opened = await one_round(ports[name], reqs[name], args.rate, keepalive,
                                                   args.max_connections)
                    cpu = peers._tree_cpu_seconds(gw.popen.pid) - cpu0
                    busy.append((peers._system_busy_s() - busy0) / wall)
                    per_req[name].append(1e6 * cpu / args.requests)
                    line.append(f"{name} {per_req[name][-1]:.0f} us (wall {wall:.2f} s, {opened} connections, "
                                f"machine busy {busy[-1]:.2f})")
                print(f"round {r + 1}: " + ", ".join(line), flush=True)
            print(f"\ngateway CPU per request, median of {args.rounds} rounds (machine busy {min(busy):.2f}-"
                  f"{max(busy):.2f} cores, load average {os.getloadavg()[0]:.2f} after):")
            meds = {name: statistics.median(v) for name, v in per_req.items()}
            first = next(iter(meds.values()))
            for name, med in meds.items():
                print(f"  {name:<24} {med:8.0f} us   {med / first:6.3f}x")
            if args.baseline_ref:
                a, b = per_req[sides[0][0]], per_req["this tree"]
                print(f"  lower in {sum(y < x for x, y in zip(a, b))} of {len(a)} rounds")
        except Exception:
            for proc in procs.procs:
                print(f"--- {proc.name}'s log (tail):\n{proc.log_tail(3000)}", file=sys.stderr)
            raise
        finally:
            procs.stop_all()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-ref", metavar="REF", help="also run that commit's gateway, in alternate rounds")
    ap.add_argument("--rate", type=float, default=1000.0, help="requests per second, open loop")
    ap.add_argument("--requests", type=int, default=3000, help="per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--connections", choices=("keepalive", "fresh"), default="keepalive")
    ap.add_argument("--max-connections", type=int, default=128, help="client connections open at once, at most")
    ap.add_argument("--tokens", type=int, default=4, help="token events per answer")
    ap.add_argument("--engine", nargs=2, metavar=("PORT_FILE", "TOKENS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        engine_main(args.engine[0], int(args.engine[1]))
        return 0
    import uvloop

    return uvloop.run(amain(args))


if __name__ == "__main__":
    raise SystemExit(main())
