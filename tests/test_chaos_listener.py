"""Chaos on the client-facing listener of a real `tokenfleet up`: slow-header and slow-body
floods, per-address and total connection caps, header limits, idle keep-alive, the ops listener.

The floods come from loopback aliases (127.0.0.2 ...), the well-behaved client from 127.0.0.1;
small deadlines and caps in the fleet file keep each test within a few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from gateway.listener import FD_RESERVE, ListenerLimits, client_key, fit_to_fd_limit
from fleetcore.fleet_config import GatewaySettings

KEY = "sk-test-acme"
FLEET = """\
sites:
  - {name: east, region: us-east, jurisdiction: us}
models:
  - name: llama-3.1-8b
    versions: ["v1"]
    engine: {spec: llama-3.1-8b, max_model_len: 8192, block_size: 16}
deployments:
  - {site: east, model: llama-3.1-8b, instances: 1, gpu: H100, adapter: sim, options: {time_scale: 0.05}}
tenants:
  - {name: acme, api_keys: [sk-test-acme]}
"""

# The public gateway's knobs: deadlines short enough for a test, caps small enough to reach.
HEADER_TIMEOUT_S = 3.0
BODY_TIMEOUT_S = 3.0
KEEP_ALIVE_S = 2.0
PER_CLIENT = 100
MAX_HEADERS = 40
MAX_HEADER_BYTES = 8192
# How late after its deadline a connection may still be closed (a loaded 2-core CI machine).
SLACK_S = 2.5
# A request from the well-behaved client must be answered within this during a flood.
PROBE_BOUND_S = 2.0
CHAT = {"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@dataclass
class Gateway:
    proc: subprocess.Popen[bytes]
    port: int
    ops_port: int | None
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _wait_for_line(proc: subprocess.Popen[bytes], log: Path, pattern: str, timeout_s: float) -> re.Match[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = re.search(pattern, log.read_text())
        if m:
            return m
        if proc.poll() is not None:
            raise AssertionError(f"tokenfleet up exited ({proc.returncode}): {log.read_text()}")
        time.sleep(0.05)
    raise AssertionError(f"no {pattern!r} in output: {log.read_text()}")


@contextlib.contextmanager
def tokenfleet_up(tmp: Path, gateway: str, *args: str,
                  preexec_fn: Callable[[], None] | None = None) -> Iterator[Gateway]:
    fleet = tmp / "fleet.yaml"
    fleet.write_text(FLEET + f"gateway: {gateway}\n")
    log = tmp / "out.txt"
    # Output to a file, not a pipe: a gateway blocked on a full pipe would fake a hang.
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tokenfleet", "up", "--fleet", str(fleet), "--port", "0", *args],
                                stdout=out, stderr=subprocess.STDOUT, preexec_fn=preexec_fn)
    try:
        port = int(_wait_for_line(proc, log, r"gateway\s+http://127\.0\.0\.1:(\d+)/v1", 60).group(1))
        ops = None
        if "--ops-port" in args:
            ops = int(_wait_for_line(proc, log, r"ops\s+http://127\.0\.0\.1:(\d+)", 5).group(1))
        _wait_for_line(proc, log, r"stop with Ctrl-C", 10)
        yield Gateway(proc, port, ops, log)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """One public gateway (no ops listener) for the deadline and limit tests; each test floods
    from its own loopback address, so the per-address caps do not interfere."""
    knobs = (f"{{header_timeout_s: {HEADER_TIMEOUT_S}, body_timeout_s: {BODY_TIMEOUT_S}, "
             f"keep_alive_timeout_s: {KEEP_ALIVE_S}, max_connections: 1000, "
             f"max_connections_per_client: {PER_CLIENT}, max_header_count: {MAX_HEADERS}, "
             f"max_header_bytes: {MAX_HEADER_BYTES}}}")
    with tokenfleet_up(tmp_path_factory.mktemp("gw"), knobs) as g:
        yield g


# --- raw clients ---

@dataclass
class Outcome:
    lifetime_s: float  # connect to closed by the server (or to our give-up)
    status: int | None  # the status line the server sent, if any
    body: bytes = b""
    closed: bool = True  # False: still open when we gave up


async def read_response(reader: asyncio.StreamReader) -> bytes:
    """One whole response with a Content-Length body (the gateway's JSON answers)."""
    head = await reader.readuntil(b"\r\n\r\n")
    m = re.search(rb"content-length: (\d+)", head, re.IGNORECASE)
    return head + (await reader.readexactly(int(m.group(1))) if m else b"")


def _status(data: bytes) -> int | None:
    m = re.match(rb"HTTP/1\.[01] (\d{3})", data)
    return int(m.group(1)) if m else None


async def slow_client(port: int, source: str, first: bytes, trickle: bytes, every_s: float,
                      give_up_s: float) -> Outcome:
    """Connect from `source`, send `first`, then `trickle` every `every_s` until the server
    answers or closes (or `give_up_s` passes); return what the server did and when."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    t0 = time.monotonic()
    read = asyncio.ensure_future(reader.read(65536))
    try:
        writer.write(first)
        while not read.done() and time.monotonic() - t0 < give_up_s:
            await asyncio.wait([read], timeout=every_s)
            if not read.done():
                try:
                    writer.write(trickle)
                    await writer.drain()
                except ConnectionError:
                    break
        done, _ = await asyncio.wait([read], timeout=max(0.0, give_up_s - (time.monotonic() - t0)))
        if not done:
            return Outcome(time.monotonic() - t0, None, closed=False)
        try:
            data = read.result()
        except ConnectionError:
            data = b""  # reset: closed without (or before we read) an answer
        # Read to EOF: an answer is only a close when the server also ends the connection.
        with contextlib.suppress(ConnectionError, asyncio.TimeoutError):
            while True:
                more = await asyncio.wait_for(reader.read(65536), timeout=1.0)
                if not more:
                    break
                data += more
        return Outcome(time.monotonic() - t0, _status(data), data)
    finally:
        read.cancel()
        writer.close()


@dataclass
class Probes:
    """A well-behaved client from 127.0.0.1 asking /health and a chat completion in a loop."""

    results: list[tuple[str, int | str, float]] = field(default_factory=list)

    async def run(self, base: str, stop: asyncio.Event) -> None:
        # A fresh connection per request: a flood must not block new connections of others.
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=base, limits=limits, timeout=10) as client:
            while not stop.is_set():
                for what in ("health", "chat"):
                    t0 = time.monotonic()
                    try:
                        if what == "health":
                            r = await client.get("/health")
                        else:
                            r = await client.post("/v1/chat/completions", json=CHAT,
                                                  headers={"Authorization": f"Bearer {KEY}"})
                        status: int | str = r.status_code
                    except httpx.HTTPError as e:
                        status = type(e).__name__
                    self.results.append((what, status, time.monotonic() - t0))
                await asyncio.sleep(0.1)

    def check(self) -> None:
        assert len(self.results) >= 4, self.results
        bad = [r for r in self.results if r[1] != 200 or r[2] > PROBE_BOUND_S]
        assert not bad, f"well-behaved requests failed or were slow during the flood: {bad}"


async def flood_with_probes(gw: Gateway, clients: list[asyncio.Future[Outcome]]) -> tuple[list[Outcome], Probes]:
    probes, stop = Probes(), asyncio.Event()
    probing = asyncio.create_task(probes.run(gw.url, stop))
    try:
        outcomes = await asyncio.gather(*clients)
    finally:
        stop.set()
        await probing
    return outcomes, probes


# --- tests ---

@pytest.mark.slow
async def test_slow_header_flood_is_closed_by_the_deadline_and_capped_per_address(gw: Gateway) -> None:
    n = PER_CLIENT + 50
    give_up = HEADER_TIMEOUT_S + SLACK_S + 2
    clients = [asyncio.ensure_future(slow_client(gw.port, "127.0.0.2", b"GET /health HTTP/1.1\r\nHost: x\r\n",
                                                 b"X-Slow: 1\r\n", 0.3, give_up)) for _ in range(n)]
    outcomes, probes = await flood_with_probes(gw, clients)

    still_open = [o for o in outcomes if not o.closed]
    assert not still_open, f"{len(still_open)} trickling connections were never closed"
    # Over the per-address cap: refused at once (503, or reset when our bytes crossed the close).
    # Told apart by what the server said, not by when: on a loaded machine the flood's own client
    # loop reads the refusals late (1.8 s, once), yet still well before any header deadline.
    held = [o for o in outcomes if o.status == 408]
    refused = [o for o in outcomes if o.status != 408]
    assert len(refused) == n - PER_CLIENT, sorted((round(o.lifetime_s, 2), o.status) for o in outcomes)
    assert max(o.lifetime_s for o in refused) < min(o.lifetime_s for o in held)
    assert min(o.lifetime_s for o in held) >= HEADER_TIMEOUT_S / 2  # the deadline, not a refusal
    assert all(o.status in (503, None) for o in refused)
    assert any(o.status == 503 and b"too_many_connections" in o.body for o in refused)
    # The rest: held until the header deadline, then answered 408 and closed.
    assert len(held) == PER_CLIENT
    assert all(o.status == 408 and b"header_timeout" in o.body for o in held), {o.status for o in held}
    assert max(o.lifetime_s for o in held) < HEADER_TIMEOUT_S + SLACK_S
    assert min(o.lifetime_s for o in held) > HEADER_TIMEOUT_S - 0.5
    probes.check()


@pytest.mark.slow
async def test_slow_body_flood_gets_408_at_the_deadline(gw: Gateway) -> None:
    n = 60
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
            b"\r\nContent-Type: application/json\r\nContent-Length: 4000\r\n\r\n{")
    give_up = BODY_TIMEOUT_S + SLACK_S + 2
    clients = [asyncio.ensure_future(slow_client(gw.port, "127.0.0.3", head, b" ", 0.3, give_up)) for _ in range(n)]
    outcomes, probes = await flood_with_probes(gw, clients)

    still_open = [o for o in outcomes if not o.closed]
    assert not still_open, f"{len(still_open)} slow-body connections were never closed"
    assert all(o.status == 408 and b'"code": "body_timeout"' in o.body for o in outcomes), \
        {(o.status, o.body[-120:]) for o in outcomes}
    lifetimes = [o.lifetime_s for o in outcomes]
    assert BODY_TIMEOUT_S - 0.5 < min(lifetimes) and max(lifetimes) < BODY_TIMEOUT_S + SLACK_S
    probes.check()


async def test_too_many_or_too_large_headers_get_431_not_a_hang(gw: Gateway) -> None:
    async def ask(request: bytes) -> Outcome:
        return await asyncio.wait_for(slow_client(gw.port, "127.0.0.4", request, b"", 0.2, 5), 10)

    many = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(MAX_HEADERS + 10))
    o = await ask(many + b"\r\n")
    assert o.status == 431 and b"too_many_headers" in o.body, o

    large = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 1000) + b"\r\n\r\n"
    o = await ask(large)
    assert o.status == 431 and b"headers_too_large" in o.body, o

    long_target = b"GET /health?" + b"q" * (MAX_HEADER_BYTES + 1000) + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    o = await ask(long_target)
    assert o.status == 431, o

    # Within the limits: served (no false positive on an ordinary rich request).
    fine = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 100)
                                                          for i in range(MAX_HEADERS - 2)) + b"\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port, local_addr=("127.0.0.4", 0))
    writer.write(fine)
    data = await asyncio.wait_for(read_response(reader), 5)
    writer.close()
    assert _status(data) == 200, data


async def test_a_header_line_that_never_ends_is_cut_off_at_the_size_limit(gw: Gateway) -> None:
    """One header value streamed without a line end: the parser would buffer it without bound."""
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port, local_addr=("127.0.0.4", 0))
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Endless: ")
    sent, answer = 0, b""
    read = asyncio.ensure_future(reader.read(65536))
    try:
        while sent < 1 << 20 and not read.done():
            try:
                writer.write(b"a" * 1024)
                await writer.drain()
            except ConnectionError:
                break
            sent += 1024
            await asyncio.wait([read], timeout=0.01)
        with contextlib.suppress(ConnectionError):
            answer = await asyncio.wait_for(read, 5)
    finally:
        read.cancel()
        writer.close()
    assert _status(answer) == 431, (sent, answer[:200])
    # Answered once the limit was crossed, not after the client gave up.
    assert sent < 8 * MAX_HEADER_BYTES, sent


@pytest.mark.slow
async def test_idle_keep_alive_connection_is_closed(gw: Gateway) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port, local_addr=("127.0.0.4", 0))
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        data = await asyncio.wait_for(read_response(reader), 5)
        assert _status(data) == 200
        t0 = time.monotonic()
        rest = await asyncio.wait_for(reader.read(), KEEP_ALIVE_S + SLACK_S)
        assert rest == b""  # closed by the server, nothing else sent
        assert time.monotonic() - t0 > KEEP_ALIVE_S - 0.5
    finally:
        writer.close()


@pytest.mark.slow
async def test_ops_listener_answers_while_the_public_port_is_saturated(tmp_path: Path) -> None:
    total, per_client = 40, 20
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]

    def low_soft_limit() -> None:  # as a default shell gives it; `tokenfleet up` must raise it
        resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))

    knobs = (f"{{header_timeout_s: 20, max_connections: {total}, max_connections_per_client: {per_client}}}")
    with tokenfleet_up(tmp_path, knobs, "--ops-port", "0", preexec_fn=low_soft_limit) as g:
        limits = Path(f"/proc/{g.proc.pid}/limits").read_text()
        soft = int(re.search(r"Max open files\s+(\d+)", limits).group(1))  # type: ignore[union-attr]
        assert soft == hard, limits

        # Fill the public port: idle connections from two addresses, each at its per-address cap.
        flood = [await asyncio.open_connection("127.0.0.1", g.port, local_addr=(src, 0))
                 for src in ("127.0.0.5", "127.0.0.6") for _ in range(per_client)]
        ops = httpx.AsyncClient(base_url=f"http://127.0.0.1:{g.ops_port}", timeout=5)
        try:
            deadline = time.monotonic() + 10
            while True:  # until the gateway has accepted them all
                m = re.search(r'tokenfleet_client_connections\{listener="public"\} (\d+)',
                              (await ops.get("/metrics")).text)
                if m and int(m.group(1)) == total:
                    break
                assert time.monotonic() < deadline, m and m.group(0)
                await asyncio.sleep(0.05)

            # The public port refuses a newcomer at once instead of letting it wait...
            reader, writer = await asyncio.open_connection("127.0.0.1", g.port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            with contextlib.suppress(ConnectionError):
                data = await asyncio.wait_for(reader.read(), 5)
                assert _status(data) in (503, None), data
            writer.close()
            # ...while the ops listener answers, and serves only the operator paths.
            for _ in range(5):
                t0 = time.monotonic()
                r = await ops.get("/health")
                assert r.status_code == 200 and time.monotonic() - t0 < PROBE_BOUND_S
            assert (await ops.get("/metrics")).status_code == 200
            r = await ops.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"
            metrics = (await ops.get("/metrics")).text
            assert re.search(r'tokenfleet_client_connections_closed_total\{listener="public",'
                             r'reason="max_connections"\} [1-9]', metrics), metrics
        finally:
            for _, w in flood:
                w.close()
            await ops.aclose()

        # The flood gone, the public port serves again.
        async with httpx.AsyncClient(base_url=g.url, timeout=5) as client:
            deadline = time.monotonic() + 5
            while (status := await _health_status(client)) != 200 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert status == 200


async def _health_status(client: httpx.AsyncClient) -> int | str:
    try:
        return (await client.get("/health")).status_code
    except httpx.HTTPError as e:
        return type(e).__name__


def test_connection_cap_is_lowered_below_the_open_file_limit() -> None:
    limits = ListenerLimits.public(GatewaySettings(max_connections=8192, max_connections_per_client=4096))
    fitted, warning = fit_to_fd_limit(limits, nofile=1024, reserved=320)
    assert fitted.max_connections == (1024 - 320) // 2
    assert fitted.max_connections_per_client == fitted.max_connections
    assert warning and "8192" in warning and "1024" in warning
    same, none = fit_to_fd_limit(limits, nofile=1 << 20, reserved=320)
    assert same == limits and none is None


@pytest.mark.slow
async def test_tokenfleet_up_fits_its_connection_cap_under_a_low_open_file_limit(tmp_path: Path) -> None:
    """Hard limit 700: the default cap of 8192 cannot fit; it is lowered, said so, and enforced."""
    def low_hard_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, 700))

    with tokenfleet_up(tmp_path, "{}", preexec_fn=low_hard_limit) as g:
        cap = (700 - FD_RESERVE) // 2
        assert f"gateway.max_connections 8192 lowered to {cap}" in g.log.read_text()
        limits = Path(f"/proc/{g.proc.pid}/limits").read_text()
        assert re.search(r"Max open files\s+700\s+700", limits), limits
        held = [await asyncio.open_connection("127.0.0.1", g.port, local_addr=("127.0.0.7", 0)) for _ in range(cap)]
        try:
            # One more from another address: over the total cap, refused at once.
            o = await asyncio.wait_for(slow_client(g.port, "127.0.0.8", b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
                                                   b"", 0.2, 5), 10)
            assert o.closed and o.status in (503, None) and o.lifetime_s < 2, o
        finally:
            for _, w in held:
                w.close()


def test_per_client_cap_counts_an_ipv6_client_by_its_64() -> None:
    assert client_key("2001:db8:1:2::1") == client_key("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert client_key("2001:db8:1:3::1") != client_key("2001:db8:1:2::1")
    assert client_key("::ffff:127.0.0.2") == "127.0.0.2" == client_key("127.0.0.2")


class _RefusedTransport:
    """What a refused connection's transport sees: writes, the FIN, the close."""

    def __init__(self, can_eof: bool = True) -> None:
        self.events: list[str] = []
        self._can_eof = can_eof

    def write(self, data: bytes) -> None:
        self.events.append("503" if b" 503 " in data.split(b"\r\n", 1)[0] else "write")

    def can_write_eof(self) -> bool:
        return self._can_eof

    def write_eof(self) -> None:
        self.events.append("eof")

    def close(self) -> None:
        self.events.append("close")


async def test_a_refused_connection_sends_its_fin_and_waits_for_the_client_before_closing() -> None:
    # Closing at once with the client's first bytes unread makes the kernel reset the connection,
    # which can destroy the 503 before the client reads it: the answer, then our FIN, then the
    # close when the client closes or the linger ends; bounded, past which it closes at once.
    from gateway import listener as lst

    class _Proto(lst.GuardedHttpToolsProtocol):
        def __init__(self) -> None:  # only what _close_refused reads
            self.loop = asyncio.get_running_loop()
            self._timer = None
            self._lingering = False
            self._listener = None

    before = lst._Lingering.count
    t = _RefusedTransport()
    p = _Proto()
    t.write(b"HTTP/1.1 503 Service Unavailable\r\n\r\n")
    p._close_refused(t)  # type: ignore[arg-type]
    assert t.events == ["503", "eof"] and lst._Lingering.count == before + 1
    p.data_received(b"GET / HTTP/1.1\r\n")  # the client's bytes: read and dropped
    p.connection_lost(None)  # the client closed (eof_received closed the transport)
    assert lst._Lingering.count == before and p._timer is None

    slow = _RefusedTransport()
    p2 = _Proto()
    loop = asyncio.get_running_loop()
    closed = loop.create_future()
    slow.close = lambda: (slow.events.append("close"), closed.set_result(None))  # type: ignore[method-assign]
    old = lst.REFUSED_LINGER_S
    lst.REFUSED_LINGER_S = 0.05
    try:
        p2._close_refused(slow)  # type: ignore[arg-type]
        await asyncio.wait_for(closed, 5)  # a client that never closes: closed at the linger's end
    finally:
        lst.REFUSED_LINGER_S = old
    assert slow.events == ["eof", "close"]
    p2.connection_lost(None)
    assert lst._Lingering.count == before

    lst._Lingering.count = lst.REFUSED_LINGER_MAX  # the bound: past it, closed at once as before
    try:
        full = _RefusedTransport()
        _Proto()._close_refused(full)  # type: ignore[arg-type]
        assert full.events == ["close"]
    finally:
        lst._Lingering.count = before
    no_eof = _RefusedTransport(can_eof=False)
    _Proto()._close_refused(no_eof)  # type: ignore[arg-type]
    assert no_eof.events == ["close"] and lst._Lingering.count == before


def test_client_key_skips_the_address_parse_only_where_it_would_give_the_host() -> None:
    """`client_key` returns a host without a colon unparsed. That is exact: such a host is no IPv6
    address, so the parse finds IPv4 (counted as given) or nothing (counted as given too); IPv6,
    mapped IPv4 included, still takes the parse (`test_per_client_cap_counts_an_ipv6_client_by_its_64`)."""
    import ipaddress

    hosts = ["127.0.0.1", "10.1.2.3", "255.255.255.255", "0.0.0.0", "1.2.3", "01.2.3.4", "1.2.3.4.5", "300.1.1.1",
             "", "testclient", "/run/tokenfleet.sock", "1.2.3.4/32", " 1.2.3.4"]
    for host in hosts:
        try:
            parsed = ipaddress.ip_address(host)
        except ValueError:
            parsed = None
        assert parsed is None or isinstance(parsed, ipaddress.IPv4Address), host
        assert client_key(host) == host
