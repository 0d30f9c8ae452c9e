"""What the server cycle costs per streamed request, in one process: the gateway's listener under
uvicorn's ASGI cycle against a bare asyncio protocol that writes the same bytes.

    .venv/bin/python bench/server_cycle_floor.py [--requests 4000] [--rounds 5] [--concurrency 8] [--chunks 3]
        [--fresh] [--tree DIR]

Three servers on loopback in this process (uvloop), each answering every `POST /v1/completions`
with the same streamed response: an SSE head (the relay's headers), `--chunks` body chunks with
a loop turn between them (as upstream reads arrive), the chunked end with the last:

- `uvicorn`: uvicorn's own httptools protocol (no caps, deadlines or header limits), the same
  ASGI app: what the listener's guards add is `asgi` less this;
- `asgi`: the real listener (`gateway.listener.GuardedHttpToolsProtocol` over uvicorn's
  httptools protocol, with uvicorn's `ProxyHeadersMiddleware` as `tokenfleet up` loads it),
  and an ASGI app that does what the /v1 path does at the ASGI level: reads the body with
  `receive`, sends `http.response.start` and one `http.response.body` per chunk;
- `direct`: the same listener and app, the response written by the scope's `DirectSend`
  (`gateway.direct_send`: the relay's way under this listener) instead of ASGI messages;
  left out when this tree has no `gateway.direct_send`;
  With a tree whose listener puts a `HeadHold` in the scope (before `gateway.direct_send`),
  `asgi` holds the head for the first chunk's write as that tree's relay did, and
  `asgi-nohold` does not (the head in a write of its own: what one more write costs);
- `bare`: an asyncio protocol with httptools' parser that writes the same bytes (head with the
  first chunk, then each chunk) from a task per request: the floor of a Python server on this
  loop, with no caps, deadlines or ASGI at all; `bare-notask` the same from loop callbacks
  (`call_soon`), without the task.

A client of raw sockets in the same process sends `--requests` per round, closed loop at
`--concurrency` keep-alive connections (`--fresh`: a new connection per request, which the
server closes after its answer), and checks every answer (byte for byte against the
first answer of that server, less its Date header). Rounds alternate over the servers; CPU is
this process's (`time.process_time`), client included (the same client for every server, so
the differences are the servers'). Printed: median CPU per request per server, and each one's
difference from `bare`. No input files.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# `--tree DIR` (before anything is imported): measure the listener of that source tree (another
# commit's, from `git archive`), with this script
TREE = Path(sys.argv[sys.argv.index("--tree") + 1]) if "--tree" in sys.argv[:-1] else REPO
sys.path.insert(0, str(TREE))
sys.path.insert(1, str(REPO / "bench"))  # raw_client (bench/ is a folder of scripts, not a package)

import httptools  # noqa: E402
import uvloop  # noqa: E402
from uvicorn.config import Config  # noqa: E402
from uvicorn.server import ServerState  # noqa: E402

from fleetcore.fleet_config import GatewaySettings  # noqa: E402
from gateway.listener import bind_socket, build_listeners, protocol_class  # noqa: E402
from raw_client import StreamClient  # noqa: E402

# (asked of the tree itself: the venv's editable install can answer for modules it lacks)
DIRECT_SEND = "tokenfleet.direct_send" if (TREE / "gateway" / "direct_send.py").exists() else None
HEAD_HOLD = "tokenfleet.head_hold"  # an older tree's listener: the head kept for the first chunk's write

HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"), (b"x-request-id", b"r-0123456789abcdef"),
           (b"x-tokenfleet-instance", b"w0"), (b"content-type", b"text/event-stream; charset=utf-8")]
DATE = re.compile(rb"\r\ndate: [^\r]*")


def chunks_of(n: int) -> list[bytes]:
    out = [b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" t%d"}]}\n\n' % i
           for i in range(n - 1)]
    out.append(b'data: {"id":"cmpl-1","choices":[],"usage":{"prompt_tokens":64,"completion_tokens":4}}\n\n'
               b"data: [DONE]\n\n")
    return out


def asgi_app(chunks: list[bytes], direct: bool, hold_head: bool = True) -> Callable[..., Any]:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        more = True
        while more:
            m = await receive()
            more = m.get("more_body", False)
        out = scope.get(DIRECT_SEND) if direct and DIRECT_SEND else None
        if out is not None and out.serves(send):
            out.start(200, HEADERS, hold=True)
            for i, c in enumerate(chunks):
                if i:
                    await asyncio.sleep(0)
                out.body(c, i < len(chunks) - 1)
            return
        hold = scope.get(HEAD_HOLD) if hold_head else None
        if hold is not None:  # as that tree's relay: the head waits for the first chunk's write
            hold.hold()
        await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
        for i, c in enumerate(chunks):
            if i:
                await asyncio.sleep(0)
            await send({"type": "http.response.body", "body": c, "more_body": i < len(chunks) - 1})
            if hold is not None and i == 0:
                hold.release()
    return app


def bare_protocol(chunks: list[bytes], task: bool = True, close: bool = False) -> type[asyncio.Protocol]:
    framed = [b"%x\r\n%s\r\n" % (len(c), c) for c in chunks]
    framed[-1] += b"0\r\n\r\n"
    head = (b"HTTP/1.1 200 OK\r\nserver: uvicorn\r\n" + b"".join(b"%s: %s\r\n" % h for h in HEADERS)
            + (b"connection: close\r\n" if close else b"") + b"transfer-encoding: chunked\r\n\r\n")

    class Bare(asyncio.Protocol):
        def __init__(self) -> None:
            self.parser = httptools.HttpRequestParser(self)
            self.transport: asyncio.Transport | None = None
            self.body = bytearray()

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport  # type: ignore[assignment]

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_body(self, body: bytes) -> None:
            self.body += body

        def on_message_complete(self) -> None:
            self.body.clear()
            if task:
                asyncio.get_running_loop().create_task(self._answer())
            else:
                self._next(0)

        def _next(self, i: int) -> None:  # no task: each chunk from a callback of the loop's next turn
            assert self.transport is not None
            self.transport.write(head + framed[0] if i == 0 else framed[i])
            if i + 1 < len(framed):
                asyncio.get_running_loop().call_soon(self._next, i + 1)
            elif close:
                self.transport.close()

        async def _answer(self) -> None:
            assert self.transport is not None
            self.transport.write(head + framed[0])
            for c in framed[1:]:
                await asyncio.sleep(0)
                self.transport.write(c)
            if close:
                self.transport.close()

    return Bare


async def drive(port: int, request: bytes, n: int, concurrency: int, expect: list[bytes], fresh: bool) -> None:
    loop = asyncio.get_running_loop()
    todo = iter(range(n))

    async def worker() -> None:
        if fresh:  # a connection per request: the server closes it after the answer
            for _ in todo:
                _, c = await loop.create_connection(StreamClient, "127.0.0.1", port)
                assert isinstance(c, StreamClient) and c.transport is not None
                got = DATE.sub(b"", await c.ask(request, 10))
                await asyncio.wait_for(c.closed, 10)
                if not expect:
                    expect.append(got)
                elif got != expect[0]:
                    raise RuntimeError(f"answer differs:\n{got!r}\n{expect[0]!r}")
            return
        _, c = await loop.create_connection(StreamClient, "127.0.0.1", port)
        assert isinstance(c, StreamClient) and c.transport is not None
        try:
            for _ in todo:
                got = DATE.sub(b"", await c.ask(request, 10))
                if not expect:
                    expect.append(got)
                elif got != expect[0]:
                    raise RuntimeError(f"answer differs:\n{got!r}\n{expect[0]!r}")
        finally:
            c.transport.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def amain(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    chunks = chunks_of(args.chunks)
    state = ServerState()
    state.default_headers = [(b"date", b"Thu, 03 Dec 2026 13:00:00 GMT"), (b"server", b"uvicorn")]
    servers: dict[str, int] = {}
    kinds = ["bare", "bare-notask", "uvicorn", "asgi"] + (["asgi-nohold"] if (TREE / "gateway" / "head_hold.py").exists() else []) + (["direct"] if DIRECT_SEND else [])
    for kind in kinds:
        sock = bind_socket("127.0.0.1", 0)
        if kind.startswith("bare"):
            srv = await loop.create_server(bare_protocol(chunks, task=kind == "bare", close=args.fresh), sock=sock)
        else:
            listeners, _ = build_listeners(GatewaySettings(), sock, None, 4096)
            http = "httptools" if kind == "uvicorn" else protocol_class(listeners)
            config = Config(asgi_app(chunks, kind == "direct", kind != "asgi-nohold"), http=http, ws="none",
                            lifespan="off", access_log=False, log_level="warning")
            config.load()
            proto = config.http_protocol_class
            srv = await loop.create_server(lambda p=proto, c=config: p(c, state, {}, loop), sock=sock)  # type: ignore[misc]
        servers[kind] = srv.sockets[0].getsockname()[1]
    body = b'{"model":"bench-model","prompt":"' + b"word " * 64 + b'","max_tokens":4,"stream":true}'
    req = {k: (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
               b"Authorization: Bearer sk-bench-local\r\nAccept: text/event-stream\r\n%sContent-Length: %d\r\n\r\n%s"
               % (p, b"Connection: close\r\n" if args.fresh else b"", len(body), body)) for k, p in servers.items()}
    expect: dict[str, list[bytes]] = {k: [] for k in servers}
    for k in servers:  # warm-up
        await drive(servers[k], req[k], 500, args.concurrency, expect[k], args.fresh)
    per: dict[str, list[float]] = {k: [] for k in servers}
    for r in range(args.rounds):
        for k in servers:
            t0 = time.process_time()
            await drive(servers[k], req[k], args.requests, args.concurrency, expect[k], args.fresh)
            per[k].append(1e6 * (time.process_time() - t0) / args.requests)
        print(f"round {r + 1}: " + ", ".join(f"{k} {per[k][-1]:.1f} us" for k in servers), flush=True)
    same = all(DATE.sub(b"", expect[k][0]) == expect["bare"][0] for k in servers)
    print(f"\ntree {TREE}; {args.requests} requests x {args.rounds} rounds, concurrency {args.concurrency}, {args.chunks} chunks, "
          f"{'a connection per request' if args.fresh else 'keep-alive'}; "
          f"process CPU per request (client included), median; answers byte-identical across servers: {same}")
    base = statistics.median(per["bare"])
    for k in servers:
        med = statistics.median(per[k])
        print(f"  {k:<12} {med:7.1f} us   over bare {med - base:+7.1f} us   {med / base:5.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=3)
    ap.add_argument("--fresh", action="store_true", help="a new connection per request (Connection: close)")
    ap.add_argument("--tree", metavar="DIR", help="the source tree whose listener to measure (default: this one)")
    args = ap.parse_args()
    uvloop.run(amain(args))


if __name__ == "__main__":
    main()
