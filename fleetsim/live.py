"""`tokenfleet bench live`: replay a trace against a running OpenAI-compatible endpoint.

    tokenfleet bench live --trace FILE --target URL [--key K] [--model M]
        [--concurrency N] [--window S] [--rate-scale X] [--json OUT]
        [--endpoint completions|chat] [--start S] [--max-requests N] [--timeout S]
        [--time-scale S] [--fresh-connections] [--label L] [--allow-remote]

The live counterpart of `simulate`: the same workloads, the same metric
arithmetic (`fleetsim.metrics`) and the same JSON shape (`fleetsim.report`), but
measured on the client side of a real HTTP endpoint — our gateway, a peer router
(SGLang, vLLM router), or a bare engine. Runnable on its own:
`python -m fleetsim.live --trace FILE --target URL ...`.

How a trace row becomes a request:

* Prompt: `workloads.prompt_text(hash_ids, input_length, block_tokens, seed)` —
  equal leading block ids give byte-identical leading text, so the engines'
  prefix caches see exactly the reuse the trace describes. `/v1/completions`
  (the default) sends that text as is, so the engine counts `input_length`
  prompt tokens under the shared tokenizer; `--endpoint chat` wraps it in one
  user message (the chat template adds a few tokens).
* Output: `max_tokens = output_length` with `ignore_eos: true`, so every engine
  generates exactly the trace's output length (vLLM, SGLang and the simulated
  worker honour `ignore_eos`). Streaming, with `stream_options.include_usage` so
  the final usage chunk reports prompt, completion and cached tokens.

Arrivals are open-loop: request i is sent at t0 + timestamp_i (after
`--rate-scale`), whatever happened to earlier ones, except that at most
`--concurrency` requests are in flight; past that the dispatcher waits for a
free slot (and later requests wait behind it, in order). `--window S` keeps the
requests arriving in the first S seconds (after `--start`) of the rate-scaled
trace, so S bounds the sending phase. Against simulated engines running at
`--time-scale s` (wall seconds per physical second), arrivals are sent s times
further apart and every measured time is divided by s before the metrics, so
the report is in the engines' physical seconds, comparable with `simulate` and
the class SLOs; `wall_s` and the `live` block stay in wall time.

What is measured, per request, on the client (times from the moment the request
was written, as vLLM's and SGLang's serving benchmarks do):

* TTFT: until the first streamed chunk that carries output: text, reasoning or a
  tool call, read as the gateway reads it (`fleetcore.sse`).
* TPOT: (last token chunk - first token chunk) / (completion_tokens - 1).
* end-to-end: until the stream ended ([DONE]).
* `queue_s` holds the *client-side* wait for a concurrency slot (the endpoint's
  own queueing is inside TTFT); the `live` block of a result row reports it
  with the dispatcher's lateness (`send_lag_ms`), which should stay near zero —
  if not, the load generator itself was the bottleneck.
* cached tokens: `usage.prompt_tokens_details.cached_tokens`.

Outcomes: HTTP errors before the stream starts count as `rejected` (the reason
keeps the status and message); a stream that breaks, reports an error event, or
exceeds `--timeout` counts as `cancelled`.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from fleetcore.slo import DEFAULT_SLOS
from fleetcore.sse import StreamReader, StreamStats
from workloads import Workload, head, load_trace, prompt_text, scale_rate, window

from .metrics import RequestRecord, percentiles, summarize_all
from .report import build_report, format_table, result_row, write_json

DEFAULT_CONCURRENCY = 256
DEFAULT_TIMEOUT_S = 300.0
ENDPOINTS = ("completions", "chat")
_ERROR_SAMPLES = 5
_KEEPALIVE_S = 4.0


# --- target ---------------------------------------------------------------------------


class TargetError(ValueError):
    """The target URL is unusable (malformed, or not loopback without --allow-remote)."""


def base_url(url: str, allow_remote: bool = False) -> str:
    """`http://host:port[/v1]` → `http://host:port` (the API paths are appended here).

    A load generator pointed at the wrong host is a denial-of-service tool, so
    anything but a loopback address needs an explicit opt-in.
    """
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TargetError(f"target must be an http(s) URL, got {url!r}")
    if not allow_remote and not _is_loopback(parts.hostname):
        raise TargetError(f"target {parts.hostname!r} is not a loopback address; "
                          "pass --allow-remote to load a remote endpoint")
    path = parts.path.rstrip("/").removesuffix("/v1")
    return f"{parts.scheme}://{parts.netloc}{path}"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class Target:
    """Where and how to send: base URL (no /v1), bearer key, model name, API flavour."""

    url: str
    model: str
    key: str | None = None
    endpoint: str = "completions"  # or "chat"
    extra_headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json", **self.extra_headers}
        if self.key:
            h["Authorization"] = f"Bearer {self.key}"
        return h


async def discover_model(session: aiohttp.ClientSession, url: str, key: str | None) -> str:
    """The first model `GET /v1/models` lists (what a client would pick without being told)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with session.get(f"{url}/v1/models", headers=headers) as resp:
        if resp.status != 200:
            raise TargetError(f"GET {url}/v1/models answered {resp.status}: {(await resp.text())[:200]}")
        data = (await resp.json()).get("data") or []
    if not data or not isinstance(data[0], dict) or not data[0].get("id"):
        raise TargetError(f"GET {url}/v1/models lists no model; pass --model")
    return str(data[0]["id"])


# --- request bodies -------------------------------------------------------------------


def request_body(row: Any, target: Target, seed: int = 0) -> dict[str, Any]:
    """The OpenAI body of one trace row: deterministic prompt text, exact output length."""
    text = prompt_text(row.hash_ids, row.input_length, row.block_tokens, seed)
    body: dict[str, Any] = {
        "model": row.model or target.model,
        "max_tokens": max(1, int(row.output_length)),
        "ignore_eos": True,  # exact output length on every engine: the trace decides, not the sampler
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


# --- one request ----------------------------------------------------------------------


@dataclass(slots=True)
class _Sent:
    """Dispatcher bookkeeping of one request (seconds from the replay's t0)."""

    index: int
    row: Any
    scheduled: float
    sent: float = 0.0
    slot_wait: float = 0.0


async def _send_one(session: aiohttp.ClientSession, target: Target, s: _Sent, data: bytes, t0: float,
                    run_id: str, timeout_s: float | None) -> RequestRecord:
    row = s.row
    rec = RequestRecord(request_id=f"{run_id}-{s.index}", arrival_s=s.scheduled,
                        prompt_tokens=int(row.input_length), status="cancelled",
                        tenant=row.tenant or "anonymous", request_class=row.request_class,
                        queue_s=s.slot_wait, deadline_s=row.deadline_s)
    headers = target.headers()
    headers["X-Request-Id"] = rec.request_id
    if row.region:
        headers["x-tokenfleet-region"] = row.region
    reader = StreamReader()
    clock = time.perf_counter
    start = clock()
    s.sent = start - t0
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(target.url + target.path, data=data, headers=headers) as resp:
                rec.site = resp.headers.get("x-tokenfleet-site")
                rec.instance = resp.headers.get("x-tokenfleet-instance")
                if resp.status != 200:
                    rec.status = "rejected"
                    rec.reason = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return _ended(rec, clock() - t0)
                async for data in resp.content.iter_any():
                    reader.feed(data, clock())
                    if reader.finished:
                        break
                else:
                    reader.close(clock())
    except TimeoutError:
        rec.reason = f"client timeout after {timeout_s:g} s"
    except (aiohttp.ClientError, ConnectionError) as e:
        rec.reason = f"{type(e).__name__}: {e}"[:300]
    end = clock()
    _fill(rec, reader.stats, start, end)
    return _ended(rec, end - t0)


def _fill(rec: RequestRecord, st: StreamStats, start: float, end: float) -> None:
    """Timings and token counts from the stream; the status is completed only on a clean end."""
    counts = st.counts()
    if counts.prompt_tokens is not None:
        rec.prompt_tokens = counts.prompt_tokens
    rec.cached_tokens = counts.cached_tokens
    rec.output_tokens = st.output_tokens()
    first, last = st.first_token_at, st.last_token_at
    if first is not None:
        rec.ttft_s = first - start
    if st.error:
        rec.reason = f"stream error: {st.error[:300]}"
        return
    if rec.reason is not None:
        return
    if not (st.done or st.finish_reason) or first is None:
        rec.reason = "stream ended without output" if first is None else "stream ended early"
        return
    rec.status = "completed"
    rec.e2e_s = end - start
    if rec.output_tokens > 1 and last is not None:
        rec.tpot_s = (last - first) / (rec.output_tokens - 1)


def _ended(rec: RequestRecord, at: float) -> RequestRecord:
    rec.end_s = at
    return rec


# --- the replay -----------------------------------------------------------------------


@dataclass(slots=True)
class LiveRun:
    """Records of one replay plus what the load generator knows about itself."""

    records: list[RequestRecord]
    wall_s: float
    send_lag_s: list[float]
    slot_waits: int
    loop_stalls_s: list[float] = field(default_factory=list)

    def live_block(self, target: Target) -> dict[str, Any]:
        """The `live` block of a result row: the target and the client's own health."""
        errors = [r.reason for r in self.records if r.status != "completed" and r.reason]
        instances = Counter(r.instance for r in self.records if r.instance)
        return {
            "target": target.url, "endpoint": target.path, "model": target.model,
            "send_lag_ms": percentiles(self.send_lag_s, (50, 99), 1e3),
            "loop_stall_ms": {"p99": percentiles(self.loop_stalls_s, (99,), 1e3)["p99"],
                              "max": max(self.loop_stalls_s) * 1e3 if self.loop_stalls_s else None},
            "slot_waits": self.slot_waits,
            "errors": len(errors), "error_samples": errors[:_ERROR_SAMPLES],
            "by_instance": dict(sorted(instances.items())),
        }


ProgressFn = Callable[[int, int], None]

# Bodies are encoded this far (replay seconds) ahead of their send time: a burst of
# same-timestamp rows (Mooncake's arrive in 3-second batches) then goes out back to
# back instead of waiting on each other's prompt building, and memory stays bounded
# by one look-ahead's worth of prompts rather than the whole trace.
_LOOKAHEAD_S = 1.0


class _Bodies:
    """Encoded request bodies, built in trace order up to a look-ahead horizon."""

    def __init__(self, rows: Sequence[Any], scheduled: Sequence[float], target: Target, seed: int) -> None:
        self.rows, self.scheduled, self.target, self.seed = rows, scheduled, target, seed
        self.next = 0
        self.ready: dict[int, bytes] = {}

    def build_until(self, horizon_s: float) -> None:
        while self.next < len(self.rows) and self.scheduled[self.next] <= horizon_s:
            self.ready[self.next] = json.dumps(request_body(self.rows[self.next], self.target, self.seed)).encode()
            self.next += 1

    def take(self, i: int) -> bytes:
        self.build_until(self.scheduled[i])
        return self.ready.pop(i)


async def replay(workload: Workload, target: Target, *, concurrency: int = DEFAULT_CONCURRENCY,
                 timeout_s: float | None = DEFAULT_TIMEOUT_S, seed: int = 0,
                 session: aiohttp.ClientSession | None = None,
                 progress: ProgressFn | None = None) -> LiveRun:
    """Send every request of `workload` at its timestamp (open loop, at most `concurrency`
    in flight) and wait for all of them; returns one record per request, in trace order."""
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    own = session is None
    if session is None:
        session = new_session(concurrency)
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    sem = asyncio.Semaphore(concurrency)
    rows = workload.requests
    total = len(rows)
    done = 0
    slot_waits = 0
    base_ms = rows[0].timestamp_ms if total else 0.0
    scheduled = [(r.timestamp_ms - base_ms) / 1000.0 for r in rows]
    bodies = _Bodies(rows, scheduled, target, seed)

    async def one(s: _Sent, data: bytes) -> RequestRecord:
        nonlocal done
        try:
            return await _send_one(session, target, s, data, t0, run_id, timeout_s)
        finally:
            sem.release()
            done += 1
            if progress is not None:
                progress(done, total)

    tasks: list[asyncio.Task[RequestRecord]] = []
    sents: list[_Sent] = []
    stalls: list[float] = []
    bodies.build_until(_LOOKAHEAD_S)  # before the clock starts: the first burst is ready at t0
    t0 = time.perf_counter()
    monitor = asyncio.create_task(_watch_loop(stalls))
    try:
        for i, row in enumerate(rows):
            s = _Sent(i, row, scheduled[i])
            bodies.build_until(s.scheduled + _LOOKAHEAD_S)
            delay = t0 + s.scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem.locked():
                slot_waits += 1
                waited = time.perf_counter()
                await sem.acquire()
                s.slot_wait = time.perf_counter() - waited
            else:
                await sem.acquire()
            sents.append(s)
            tasks.append(asyncio.create_task(one(s, bodies.take(i))))
        records = list(await asyncio.gather(*tasks))
    finally:
        monitor.cancel()
        for t in tasks:
            t.cancel()  # only matters when the replay itself was cancelled
        if own:
            await session.close()
    wall = time.perf_counter() - t0
    lag = [max(0.0, s.sent - s.scheduled - s.slot_wait) for s in sents]
    return LiveRun(records, wall, lag, slot_waits, stalls)


_WATCH_TICK_S = 0.05


async def _watch_loop(stalls: list[float]) -> None:
    """Record how late each 50 ms tick of the event loop wakes up. Large values mean the load
    generator itself was blocked or starved of CPU (its numbers then include its own delay)."""
    clock = time.perf_counter
    while True:
        before = clock()
        await asyncio.sleep(_WATCH_TICK_S)
        stalls.append(max(0.0, clock() - before - _WATCH_TICK_S))


def new_session(concurrency: int, fresh_connections: bool = False) -> aiohttp.ClientSession:
    """A pooled session sized for the replay: one kept-alive connection per in-flight request,
    or (`fresh_connections`) a new TCP connection per request, as a client without keep-alive."""
    # Idle connections are dropped after 4 s, before uvicorn's default 5 s keep-alive timeout
    # closes them server-side: reusing a connection the server is closing at that instant
    # fails the request ("Server disconnected") — a client/server race, not a routing result.
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=0, force_close=fresh_connections,
                                     keepalive_timeout=None if fresh_connections else _KEEPALIVE_S)
    # No total timeout here: `replay` bounds each request with its own.
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))


def to_physical(records: Sequence[RequestRecord], time_scale: float) -> list[RequestRecord]:
    """Records with every time divided by `time_scale` (wall seconds per physical second of
    the target's simulated engines), so latencies meet the class SLOs in the engines' own
    seconds; identity at 1.0."""
    if time_scale == 1.0:
        return list(records)

    def sc(v: float | None) -> float | None:
        return None if v is None else v / time_scale

    return [replace(r, arrival_s=r.arrival_s / time_scale, ttft_s=sc(r.ttft_s), tpot_s=sc(r.tpot_s),
                    e2e_s=sc(r.e2e_s), queue_s=sc(r.queue_s), end_s=sc(r.end_s)) for r in records]


def live_row(label: str, run: LiveRun, target: Target, time_scale: float = 1.0) -> dict[str, Any]:
    """One `results` entry in `simulate`'s shape (times in physical seconds when the target's
    engines run at `time_scale`), plus the `live` block; `wall_s` stays wall-clock."""
    # The target's fleet file is not known here (any OpenAI endpoint): its classes are judged
    # by the vocabulary's default SLOs.
    summary = summarize_all(to_physical(run.records, time_scale), DEFAULT_SLOS)
    row = result_row(label, summary, run.wall_s)
    row["span_s"] = round(summary["span_s"], 3)
    row["live"] = run.live_block(target)
    row["live"]["time_scale"] = time_scale
    return row


# --- workload -------------------------------------------------------------------------


def prepare_workload(trace: str | Path, fmt: str = "auto", *, rate_scale: float = 1.0,
                     window_s: float | None = None, max_requests: int | None = None,
                     start_s: float = 0.0, time_scale: float = 1.0) -> Workload:
    """Load, rate-scale, keep `window_s` seconds from `start_s` (seconds of the scaled trace,
    counted from its first request) and at most `max_requests`; times are rebased to start
    at 0. Last, arrivals are stretched by `time_scale`: engines that play their physics s
    times slower must get requests s times further apart to see the same load."""
    wl = load_trace(trace, fmt)
    if not len(wl):
        return wl
    first = wl.requests[0].timestamp_ms / 1000.0
    if rate_scale != 1.0:
        wl = scale_rate(wl, rate_scale)
        first /= rate_scale
    if window_s is not None or start_s:
        wl = window(wl, first + start_s, window_s if window_s is not None else float("inf"))
    if max_requests is not None:
        wl = head(wl, max_requests)
    if time_scale != 1.0:
        wl = scale_rate(wl, 1.0 / time_scale)
    return wl


# --- command line ---------------------------------------------------------------------


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, metavar="FILE",
                   help="request trace (Mooncake JSONL, canonical, Azure CSV)")
    p.add_argument("--trace-format", default="auto",
                   choices=("auto", "mooncake", "azure", "canonical"), help="trace format (default: auto)")
    p.add_argument("--target", required=True, metavar="URL",
                   help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8080/v1")
    p.add_argument("--key", default=None, metavar="K", help="bearer API key, if the target needs one")
    p.add_argument("--model", default=None, metavar="M",
                   help="model name (default: the trace's, else the first of GET /v1/models)")
    p.add_argument("--endpoint", default="completions", choices=ENDPOINTS,
                   help="API to call (default: completions, whose prompt is exactly input_length tokens)")
    p.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY, metavar="N",
                   help=f"most requests in flight (default {DEFAULT_CONCURRENCY})")
    p.add_argument("--window", type=float, default=None, metavar="S",
                   help="only requests arriving in the first S seconds of the (rate-scaled) replay")
    p.add_argument("--rate-scale", type=float, default=1.0, metavar="X", help="multiply the arrival rate by X")
    p.add_argument("--start", type=float, default=0.0, metavar="S",
                   help="skip the first S seconds of the (rate-scaled) trace")
    p.add_argument("--time-scale", type=float, default=1.0, metavar="S",
                   help="the target's engines are simulated at S wall seconds per physical second: "
                        "send S times slower and report times divided by S (default 1: real engines)")
    p.add_argument("--max-requests", type=int, default=None, metavar="N", help="at most the first N requests")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help=f"client gives up on a request after S seconds (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="prompt text seed (default 0)")
    p.add_argument("--label", default=None, help="name of the result row (default: live@HOST:PORT)")
    p.add_argument("--json", metavar="OUT.json", help="write the report as JSON (simulate's shape)")
    p.add_argument("--fresh-connections", action="store_true",
                   help="open a new connection per request (default: keep-alive, as SDK clients do)")
    p.add_argument("--allow-remote", action="store_true", help="allow a target that is not a loopback address")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `bench` (with its `live` subcommand) on `tokenfleet`'s subparsers; dispatch with
    `run_bench(args)`."""
    # The one-line help is tokenfleet.cli's (it lists commands without importing them).
    bench = subparsers.add_parser("bench", description="Benchmarks against running endpoints.")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    live = sub.add_parser("live", help="replay a trace against an OpenAI-compatible endpoint",
                          description=__doc__.split("\n\n")[0])
    _add_arguments(live)
    bench.set_defaults(func=run_bench)
    live.set_defaults(func=run_bench)
    return bench


def _err(msg: str) -> int:
    print(f"tokenfleet bench live: error: {msg}", file=sys.stderr)
    return 2


def _check_args(args: argparse.Namespace) -> str | None:
    if args.concurrency < 1:
        return "--concurrency must be at least 1"
    if not args.rate_scale > 0:
        return "--rate-scale must be positive"
    if args.window is not None and not args.window > 0:
        return "--window must be positive"
    if args.max_requests is not None and args.max_requests < 1:
        return "--max-requests must be at least 1"
    if not args.timeout > 0:
        return "--timeout must be positive"
    if not args.time_scale > 0 or args.start < 0:
        return "--time-scale must be positive and --start not negative"
    if not Path(args.trace).is_file():
        return f"trace file not found: {args.trace}"
    return None


def run_bench(args: argparse.Namespace) -> int:
    if getattr(args, "bench_command", "live") != "live":
        return _err(f"unknown bench command {args.bench_command!r}")
    problem = _check_args(args)
    if problem:
        return _err(problem)
    try:
        url = base_url(args.target, args.allow_remote)
        wl = prepare_workload(args.trace, args.trace_format, rate_scale=args.rate_scale,
                              window_s=args.window, max_requests=args.max_requests, start_s=args.start,
                              time_scale=args.time_scale)
    except (TargetError, ValueError, OSError) as e:
        return _err(str(e))
    if not len(wl):
        return _err(f"{args.trace}: no requests in the selected window")
    try:
        return asyncio.run(_bench(args, url, wl))
    except TargetError as e:
        return _err(str(e))
    except aiohttp.ClientError as e:
        return _err(f"cannot reach {url}: {e}")


async def _bench(args: argparse.Namespace, url: str, wl: Workload) -> int:
    from .cli import Progress  # the simulate progress bar; imported late (it pulls in the policies)

    async with new_session(args.concurrency, args.fresh_connections) as session:
        model = args.model or await discover_model(session, url, args.key)
        target = Target(url, model, args.key, args.endpoint)
        desc = wl.describe()
        desc.update({"trace": str(args.trace), "rate_scale": args.rate_scale, "window_s": args.window,
                     "start_s": args.start, "time_scale": args.time_scale,
                     "max_requests": args.max_requests, "seed": args.seed, "timeout_s": args.timeout,
                     "concurrency": args.concurrency})
        print(f"workload  {desc['name']}: {desc['requests']} requests over {desc['duration_s']:.0f} s "
              f"({desc['mean_rate_rps']:.2f} req/s, rate-scale {args.rate_scale:g}), "
              f"input mean {desc['input_mean']:.0f}, output mean {desc['output_mean']:.0f} tokens", flush=True)
        print(f"target    {url}{target.path}  model {model}  concurrency {args.concurrency}", flush=True)
        label = args.label or f"live@{urlsplit(url).netloc}"
        run = await replay(wl, target, concurrency=args.concurrency, timeout_s=args.timeout, seed=args.seed,
                           session=session, progress=Progress(label, enabled=not args.no_progress))
    row = live_row(label, run, target, args.time_scale)
    _print_run(row)
    if args.json:
        report = build_report(desc, {"target": url, "model": model, "endpoint": target.path}, [row])
        try:
            write_json(report, args.json)
        except OSError as e:
            return _err(f"cannot write {args.json}: {e.strerror}")
        print(f"\nwrote {args.json}")
    return 0


def _print_run(row: Mapping[str, Any]) -> None:
    live = row["live"]
    lag = live["send_lag_ms"]
    print(f"ran       {row['policy']}: wall {row['wall_s']:.1f} s, {row['completed']}/{row['requests']} completed, "
          f"send lag p50 {_ms(lag['p50'])} / p99 {_ms(lag['p99'])} ms, loop stall max "
          f"{_ms(live['loop_stall_ms']['max'])} ms, {live['slot_waits']} concurrency waits")
    for reason in live["error_samples"]:
        print(f"          error: {reason}")
    print()
    print(format_table([row]))


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["bench", "live"]:
        argv = argv[2:]
    elif argv[:1] == ["live"]:
        argv = argv[1:]
    p = argparse.ArgumentParser(prog="tokenfleet bench live", description=__doc__.split("\n\n")[0])
    _add_arguments(p)
    args = p.parse_args(argv)
    args.bench_command = "live"
    return run_bench(args)


if __name__ == "__main__":
    raise SystemExit(main())
