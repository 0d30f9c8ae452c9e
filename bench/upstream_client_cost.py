"""CPU per streamed request of the relay's upstream client: aiohttp vs `gateway.upstream_http`.

    .venv/bin/python bench/upstream_client_cost.py [--requests 2000] [--rounds 7] [--concurrency 8] [--events 16]
        [--loop uvloop|asyncio]

One loopback SSE server in its own process (an engine's shape: chunked, one chunk per event, the
terminator in a write of its own after `[DONE]`) answers every POST at once. This process sends
`--requests` streamed POSTs per round at `--concurrency`, reading each as the relay does
(`content.readany()` until `[DONE]` has passed, then `release()`), through aiohttp's session
as the gateway configured it (`TCPConnector(limit=0, keepalive_timeout=30)`, connect timeout)
and through `UpstreamClient`, alternating the two round by round in the same run. CPU is this
process's (`time.process_time`: the client's own work and its event loop), per request; the
medians over rounds and their ratio are printed, with the connections each client opened
(keep-alive reuse). `--loop`: the client's event loop (default uvloop, what `tokenfleet up` runs;
the server always runs asyncio's). No input files: the server's events are generated.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402

from gateway.upstream_http import UpstreamClient  # noqa: E402

BODY = b'{"model":"m","prompt":"hello","max_tokens":16,"stream":true}'
HEADERS = {"Content-Type": "application/json", "X-Request-Id": "bench", "Accept": "text/event-stream"}


# --- the server (its own process) ---

async def serve(events: int) -> None:
    evs = [b'data: {"id":"c","choices":[{"index":0,"text":"tok%d"}]}\n\n' % i for i in range(events)]
    evs.append(b"data: [DONE]\n\n")
    chunks = [b"%x\r\n%s\r\n" % (len(e), e) for e in evs]
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                h = await reader.readuntil(b"\r\n\r\n")
                n = 0
                for line in h.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        n = int(line[15:])
                await reader.readexactly(n)
                writer.write(head)
                for c in chunks:  # one write per event, as an engine streams them
                    writer.write(c)
                    await writer.drain()
                    await asyncio.sleep(0)
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=1024)
    print(srv.sockets[0].getsockname()[1], flush=True)
    await srv.serve_forever()


# --- the client (this process) ---

async def one(client: Any, url: str) -> None:
    resp = await client.post(url, data=BODY, headers=HEADERS)
    got = b""
    while b"[DONE]" not in got:
        data = await resp.content.readany()
        if not data:
            raise RuntimeError("stream ended before [DONE]")
        got = got[-8:] + data  # enough to see the marker across reads
    resp.release()


async def run_round(client: Any, url: str, requests: int, concurrency: int) -> float:
    """CPU seconds per request of this process for one round."""
    left = requests

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await one(client, url)

    c0 = time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return (time.process_time() - c0) / requests


def aiohttp_session(connect_timeout_s: float, opened: dict[str, int]) -> aiohttp.ClientSession:
    """The gateway's session before this client (gateway.app `_client_session` at 1173092), with
    its new connections counted into `opened["aiohttp"]`."""
    trace = aiohttp.TraceConfig()

    async def created(*_: Any) -> None:
        opened["aiohttp"] += 1

    trace.on_connection_create_end.append(created)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=None, connect=2 * connect_timeout_s,
                                    sock_connect=connect_timeout_s)
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
    return aiohttp.ClientSession(timeout=timeout, connector=connector, trace_configs=[trace])


async def bench(port: int, args: argparse.Namespace) -> None:
    url = f"http://127.0.0.1:{port}/v1/completions"
    opened = {"aiohttp": 0}
    session = aiohttp_session(5.0, opened)
    lean = UpstreamClient(5.0)
    clients = {"aiohttp": session, "upstream_http": lean}
    for client in clients.values():  # warm-up: connections, lazy imports
        await run_round(client, url, 200, args.concurrency)
    opened_before = lean.connections_opened
    opened["aiohttp"] = 0
    cpu: dict[str, list[float]] = {name: [] for name in clients}
    for r in range(args.rounds):
        order = list(clients) if r % 2 == 0 else list(reversed(clients))
        for name in order:
            cpu[name].append(await run_round(clients[name], url, args.requests, args.concurrency))
        print(f"round {r + 1}: " + "  ".join(f"{n} {cpu[n][-1] * 1e6:.0f} us" for n in clients), flush=True)
    assert session.connector is not None
    med = {n: statistics.median(v) for n, v in cpu.items()}
    total = args.rounds * args.requests
    print(f"\nCPU per streamed request ({args.events} events + [DONE], concurrency {args.concurrency}, "
          f"{args.requests} requests x {args.rounds} rounds, medians):")
    for n in clients:
        print(f"  {n:14s} {med[n] * 1e6:7.1f} us   (min {min(cpu[n]) * 1e6:.1f}, max {max(cpu[n]) * 1e6:.1f})")
    print(f"  ratio upstream_http / aiohttp: {med['upstream_http'] / med['aiohttp']:.2f}x")
    print(f"  aiohttp connections opened during the rounds: {opened['aiohttp']} for {total} requests")
    print(f"  upstream_http connections opened during the rounds: {lean.connections_opened - opened_before} "
          f"for {total} requests")
    await session.close()
    await lean.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--events", type=int, default=16, help="token events per stream before [DONE]")
    p.add_argument("--loop", default="uvloop", choices=("uvloop", "asyncio"), help="the client's event loop")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        asyncio.run(serve(args.events))
        return
    server = subprocess.Popen([sys.executable, __file__, "--serve", "--events", str(args.events)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        print(f"client loop: {args.loop}", flush=True)
        if args.loop == "uvloop":
            import uvloop
            uvloop.run(bench(port, args))
        else:
            asyncio.run(bench(port, args))
    finally:
        server.terminate()
        server.wait(timeout=10)


if __name__ == "__main__":
    main()
