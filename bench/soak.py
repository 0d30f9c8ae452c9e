"""Soak: tens of thousands of requests through `tokenfleet up` in overload, clients leaving at random.

    .venv/bin/python bench/soak.py [--requests 50000] [--rate 150] [--fleet deploy/local/fleet.yaml]
        [--time-scale 8] [--abort-frac 0.1] [--json soak.json] ...

Starts `tokenfleet up` (the default fleet, or --fleet) as a subprocess on a free port, with
every `sim` deployment's engines slowed to `--time-scale` wall seconds per physical second,
so that a rate the gateway's CPU handles easily is far above what the engines can serve:
the overload lands where production overload lands (admission queues, rejections, long
streams), not in the load generator. Requests go out open loop (Poisson, `--rate` per
second, whatever happened to earlier ones; `--max-inflight` bounds the client's sockets):
chat and completions, streaming and not, both models, every tenant key of the fleet file,
entry regions at random, short prompts with shared prefixes, 1..`--max-tokens` output
tokens, and a few bad requests (unknown model, over-long output budget) for the error
path. `--abort-frac` of the requests are abandoned by their client after a random delay
(closing the connection, whether queued in the gateway or mid-stream).

Every request ends in exactly one outcome:

* ok          200 with a complete JSON body, or a stream that ends in `[DONE]`
* error_event a stream that ends in an OpenAI error event, then `[DONE]`
* rejected    4xx/5xx with an OpenAI error body (`{"error": {"message", "type", ...}}`),
              and `Retry-After` on 429 and 503
* aborted     the client left first (counted apart; `queued` = before the response
              headers, `streaming` = after)
* lost        anything else, listed by kind: a connection reset the client did not ask
              for, a stream or body cut short without an error event, an error without an
              OpenAI body or without Retry-After, no answer within `--timeout`.

Reported: RSS of the gateway process (the `tokenfleet up` process; its engine workers
are separate processes) after warm-up (`--warmup` requests sent) and at the end (once
the gateway has nothing in flight), the longest event-loop stall from the gateway's
`tokenfleet_event_loop_lag_max_seconds` (since start, warm-up included) and the stalls
over 50/100 ms during the measured part (histogram difference), lost requests by kind,
and the client's own send lag and loop stalls (if those are large the load generator,
not the gateway, was the bottleneck). Targets (issue 11): RSS within +50 MB, longest
stall < 100 ms, 0 lost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.peers import Processes, _cpu_seconds, _system_busy_s, _wait_for_log  # noqa: E402
from fleetcore.fleet_config import DEFAULT_FLEET_FILE, FleetConfig, load_fleet_file  # noqa: E402
from fleetcore.sse import StreamReader  # noqa: E402
from fleetsim.live import new_session  # noqa: E402
from fleetsim.metrics import percentiles  # noqa: E402
from gateway.loop_monitor import LAG_BUCKETS, LoopMonitor  # noqa: E402
from workloads import prompt_text  # noqa: E402

TARGETS = {"rss_growth_mb": 50.0, "loop_stall_max_ms": 100.0, "lost": 0}
START_TIMEOUT_S = 180.0  # eight engines start in parallel; on a busy 2-core machine that takes a while
DRAIN_TIMEOUT_S = 120.0
PROMPT_BLOCK = 32  # tokens per prompt block: a shared "system prompt" block, then the request's own
SHARED_PREFIXES = 16


# --- the gateway under test -------------------------------------------------------------


def soak_fleet(src: Path, time_scale: float | None, out: Path) -> Path:
    """`src` with every sim deployment's `time_scale` set (None: as the file says)."""
    raw = yaml.safe_load(src.read_text())
    if time_scale is not None:
        for d in raw.get("deployments", []):
            if d.get("adapter", "sim") == "sim":
                d.setdefault("options", {})["time_scale"] = time_scale
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    load_fleet_file(out)  # fail here, not in the child, on a bad file
    return out


def rss_mb(pid: int) -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


async def scrape(session: aiohttp.ClientSession, url: str, admin_key: str | None) -> dict[str, float]:
    """The gateway's /metrics as {series: value} (labels kept in the key), for the few we read."""
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    async with asyncio.timeout(10):
        async with session.get(f"{url}/metrics", headers=headers) as r:
            text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("tokenfleet_event_loop_lag", "tokenfleet_inflight")):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


def _lag_over(before: Mapping[str, float], after: Mapping[str, float], bound: str) -> int:
    """Ticks with lag above `bound` seconds between two scrapes (histogram difference)."""
    total = "tokenfleet_event_loop_lag_seconds_count"
    le = f'tokenfleet_event_loop_lag_seconds_bucket{{le="{bound}"}}'
    if total not in after or le not in after:
        return -1
    return int((after[total] - after[le]) - (before.get(total, 0) - before.get(le, 0)))


def _lag_bound_after(before: Mapping[str, float], after: Mapping[str, float]) -> str:
    """The smallest histogram bound no tick between the two scrapes exceeded ("<= 50 ms")."""
    for bound in LAG_BUCKETS:
        if _lag_over(before, after, repr(bound)) == 0:
            return f"<= {bound * 1e3:g} ms"
    return f"> {LAG_BUCKETS[-1] * 1e3:g} ms"


# --- the client side --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Spec:
    """One request of the mix, drawn before the run (so a seed reproduces it)."""

    index: int
    at_s: float  # send time from t0
    path: str
    body: bytes
    key: str
    region: str | None
    stream: bool
    abort_after_s: float | None  # the client leaves after this long, if not done by then
    bad: bool  # meant to be refused (4xx)


@dataclass(slots=True)
class Result:
    outcome: str  # ok, error_event, rejected, aborted, lost
    kind: str  # detail: status/code, abort phase, or the kind of loss
    status: int | None = None
    detail: str = ""


def build_mix(n: int, rate: float, config: FleetConfig, args: argparse.Namespace) -> list[Spec]:
    rng = random.Random(args.seed)
    keys = [k for t in config.tenants for k in t.api_keys]
    if not keys:
        raise SystemExit("soak: the fleet file has no tenant with a plain api key to send with")
    models = [m.name for m in config.models]
    regions = [None, *config.regions]
    specs, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        chat = rng.random() < 0.5
        stream = rng.random() < args.stream_frac
        bad = rng.random() < args.bad_frac
        model = rng.choice(models)
        max_tokens = rng.randint(1, args.max_tokens)
        if bad:  # the two cheapest 4xx: a model nobody serves, an output budget past the context
            if rng.random() < 0.5:
                model = "no-such-model"
            else:
                max_tokens = 10_000_000
        text = prompt_text([rng.randrange(SHARED_PREFIXES), 1_000_000 + i],
                           rng.randint(PROMPT_BLOCK // 2, args.prompt_tokens), PROMPT_BLOCK, args.seed)
        body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "ignore_eos": True,
                                "temperature": 0.0, "stream": stream}
        if stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        abort = rng.uniform(0.0, args.abort_max_s) if rng.random() < args.abort_frac else None
        specs.append(Spec(i, t, "/v1/chat/completions" if chat else "/v1/completions",
                          json.dumps(body).encode(), rng.choice(keys), rng.choice(regions), stream, abort, bad))
    return specs


def _openai_error(raw: bytes) -> str | None:
    """The error's code/type if `raw` is an OpenAI error body, else None."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    err = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(err, dict) or not isinstance(err.get("message"), str) or not err.get("type"):
        return None
    return str(err.get("code") or err.get("type"))


@dataclass(slots=True)
class _Progress:
    phase: str = "connecting"  # connecting -> waiting (request sent, no headers) -> streaming


async def _exchange(session: aiohttp.ClientSession, url: str, s: Spec, p: _Progress) -> Result:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {s.key}",
               "X-Request-Id": f"soak-{s.index}"}
    if s.region:
        headers["x-tokenfleet-region"] = s.region
    p.phase = "waiting"
    async with session.post(url + s.path, data=s.body, headers=headers) as resp:
        p.phase = "streaming"
        try:
            return await _read(resp, s)
        except asyncio.CancelledError:
            resp.close()  # an abandoning client closes its connection; it is not returned to the pool
            raise


async def _read(resp: aiohttp.ClientResponse, s: Spec) -> Result:
    if resp.status != 200:
        raw = await resp.read()
        code = _openai_error(raw)
        if code is None:
            return Result("lost", f"{resp.status // 100}xx_without_error_body", resp.status, raw[:200].decode(errors="replace"))
        if resp.status in (429, 503) and not resp.headers.get("Retry-After"):
            return Result("lost", f"{resp.status}_without_retry_after", resp.status, code)
        if resp.status < 400:
            return Result("lost", "unexpected_status", resp.status, code)
        return Result("rejected", f"{resp.status} {code}", resp.status)
    if not s.stream:
        raw = await resp.read()
        try:
            obj = json.loads(raw)
        except ValueError:
            return Result("lost", "non_json_200_body", 200, raw[:200].decode(errors="replace"))
        if not isinstance(obj, dict) or not obj.get("choices"):
            return Result("lost", "200_body_without_choices", 200, raw[:200].decode(errors="replace"))
        return Result("ok", "json", 200)
    reader = StreamReader()
    async for data in resp.content.iter_any():
        reader.feed(data, 0.0)
        if reader.stats.done:  # read on past an error event: it must be followed by [DONE]
            break
    else:
        reader.close(0.0)
    st = reader.stats
    if st.done:
        return Result("error_event", st.error[:80], 200) if st.error else Result("ok", "stream", 200)
    if st.error:
        return Result("lost", "error_event_without_done", 200, st.error)
    return Result("lost", "stream_truncated_without_error_event", 200)


async def send(session: aiohttp.ClientSession, url: str, s: Spec, timeout_s: float) -> Result:
    """One request under the client's own deadline and, for some, an abandonment timer."""
    p = _Progress()
    task = asyncio.create_task(_exchange(session, url, s, p))
    wait = timeout_s if s.abort_after_s is None else min(timeout_s, s.abort_after_s)
    done, _ = await asyncio.wait({task}, timeout=wait)
    if not done:
        task.cancel()  # closes the connection under it: the gateway sees the client go away
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        if s.abort_after_s is not None and s.abort_after_s < timeout_s:
            return Result("aborted", "queued" if p.phase != "streaming" else "streaming")
        return Result("lost", f"client_timeout_{p.phase}", detail=f"no answer in {timeout_s:g} s")
    try:
        return task.result()
    except aiohttp.ServerDisconnectedError as e:
        return Result("lost", f"server_disconnected_{p.phase}", detail=str(e)[:200])
    except aiohttp.ClientPayloadError as e:
        return Result("lost", f"payload_cut_{p.phase}", detail=str(e)[:200])
    except (aiohttp.ClientError, ConnectionError) as e:
        return Result("lost", f"{type(e).__name__}_{p.phase}", detail=str(e)[:200])


@dataclass
class Run:
    results: list[Result | None]
    send_lag_s: list[float] = field(default_factory=list)
    slot_waits: int = 0
    rss: list[tuple[float, float]] = field(default_factory=list)  # (t from t0, MB)
    recent_lag: list[tuple[float, float]] = field(default_factory=list)  # (t, recent max s)
    warm_rss_mb: float | None = None
    warm_scrape: dict[str, float] = field(default_factory=dict)
    warm_at_s: float = 0.0
    wall_s: float = 0.0


async def drive(url: str, specs: Sequence[Spec], pid: int, admin_key: str | None,
                args: argparse.Namespace) -> Run:
    run = Run([None] * len(specs))
    sem = asyncio.Semaphore(args.max_inflight)
    done = 0
    session = new_session(args.max_inflight)  # pooled keep-alive, idle connections dropped at 4 s
    meta = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))

    async def one(s: Spec) -> None:
        nonlocal done
        try:
            run.results[s.index] = await send(session, url, s, args.timeout)
        finally:
            sem.release()
            done += 1

    async def watch() -> None:
        last_print = 0.0
        while True:
            now = time.perf_counter() - t0
            mb = rss_mb(pid)
            if mb is not None:
                run.rss.append((round(now, 1), round(mb, 1)))
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                m = await scrape(meta, url, admin_key)
                run.recent_lag.append((round(now, 1),
                                       m.get("tokenfleet_event_loop_lag_recent_max_seconds", -1.0)))
            if now - last_print >= 10:
                last_print = now
                c = Counter(r.outcome for r in run.results if r is not None)
                print(f"soak: {now:6.0f} s  sent {len(tasks)}/{len(specs)}  done {done}  "
                      f"in flight {len(tasks) - done}  rss {mb or 0:.0f} MB  "
                      + "  ".join(f"{k} {v}" for k, v in sorted(c.items())), file=sys.stderr, flush=True)
            await asyncio.sleep(args.sample_s)

    tasks: list[asyncio.Task[None]] = []
    warm: asyncio.Task[dict[str, float]] | None = None
    t0 = time.perf_counter()
    watcher = asyncio.create_task(watch())
    try:
        for s in specs:
            delay = t0 + s.at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem.locked():
                run.slot_waits += 1
            await sem.acquire()
            run.send_lag_s.append(max(0.0, time.perf_counter() - t0 - s.at_s))
            tasks.append(asyncio.create_task(one(s)))
            if len(tasks) == args.warmup:
                run.warm_at_s = time.perf_counter() - t0
                run.warm_rss_mb = rss_mb(pid)
                warm = asyncio.create_task(scrape(meta, url, admin_key))  # not in the sender's way
        await asyncio.gather(*tasks)
        if warm is not None:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                run.warm_scrape = await warm
        run.wall_s = time.perf_counter() - t0
    finally:
        watcher.cancel()
        for t in tasks:
            t.cancel()
        await session.close()
        await meta.close()
    return run


async def settle(url: str, admin_key: str | None, timeout_s: float = DRAIN_TIMEOUT_S) -> dict[str, float]:
    """Wait until the gateway reports nothing in flight (aborted relays wind down too); the last
    scrape, with `_inflight_left` (NaN when the gateway never answered: then it died)."""
    deadline = time.monotonic() + timeout_s
    last: dict[str, float] = {"_inflight_left": float("nan")}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        while time.monotonic() < deadline:
            try:
                m = await scrape(s, url, admin_key)
            except (aiohttp.ClientError, TimeoutError, OSError):
                await asyncio.sleep(0.5)
                continue
            m["_inflight_left"] = sum(v for k, v in m.items() if k.startswith("tokenfleet_inflight"))
            last = m
            if m["_inflight_left"] <= 0:
                break
            await asyncio.sleep(0.5)
    return last


# --- report -----------------------------------------------------------------------------


def _git_commit() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    return "unknown"


def _machine() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        m = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
        cpu = m.group(1) if m else ""
    mem_gib = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem_gib = round(int(Path("/proc/meminfo").read_text().split()[1]) / 2**20, 1)
    return {"cores": os.cpu_count(), "cpu": cpu, "mem_gib": mem_gib, "python": platform.python_version(),
            "aiohttp": aiohttp.__version__}


def build_report(args: argparse.Namespace, specs: Sequence[Spec], run: Run, end_scrape: Mapping[str, float],
                 end_rss: float | None, gateway_cpu_s: float, busy_cores: float,
                 client_lag: LoopMonitor) -> dict[str, Any]:
    results = [r if r is not None else Result("lost", "never_finished") for r in run.results]
    by = Counter(r.outcome for r in results)
    lost = Counter(r.kind for r in results if r.outcome == "lost")
    lost_samples: dict[str, list[str]] = {}
    for s, r in zip(specs, results):
        if r.outcome == "lost" and len(lost_samples.setdefault(r.kind, [])) < 3:
            lost_samples[r.kind].append(f"#{s.index} {s.path} stream={s.stream} {r.detail}".strip())
    stall_max = end_scrape.get("tokenfleet_event_loop_lag_max_seconds")
    warm = run.warm_rss_mb
    growth = None if warm is None or end_rss is None else end_rss - warm
    peak = max((mb for _, mb in run.rss), default=None)
    n = len(specs)
    return {
        "command": shlex.join([sys.executable, *sys.argv]),
        "commit": args.commit,
        "machine": _machine(),
        "when_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "fleet": str(args.fleet or DEFAULT_FLEET_FILE), "time_scale": args.time_scale,
        "requests": n, "rate_rps": args.rate, "offered_s": round(specs[-1].at_s, 1) if specs else 0,
        "wall_s": round(run.wall_s, 1), "achieved_rps": round(n / run.wall_s, 1) if run.wall_s else None,
        "mix": {"stream": sum(s.stream for s in specs), "chat": sum(s.path.endswith("chat/completions") for s in specs),
                "bad": sum(s.bad for s in specs), "abort_planned": sum(s.abort_after_s is not None for s in specs)},
        "outcomes": dict(sorted(by.items())),
        "ok_kinds": dict(Counter(r.kind for r in results if r.outcome == "ok")),
        "rejected": dict(sorted(Counter(r.kind for r in results if r.outcome == "rejected").items())),
        "error_events": dict(Counter(r.kind for r in results if r.outcome == "error_event").most_common(10)),
        "aborted": dict(Counter(r.kind for r in results if r.outcome == "aborted")),
        "lost": by.get("lost", 0), "lost_by_kind": dict(lost.most_common()), "lost_samples": lost_samples,
        "rss_mb": {"after_warmup": warm, "end": end_rss, "growth": None if growth is None else round(growth, 1),
                   "peak": peak, "warmup_requests": args.warmup, "warmup_at_s": round(run.warm_at_s, 1)},
        "loop_stall": {
            "max_ms": None if stall_max is None else round(stall_max * 1e3, 1),
            "busy_max_ms": None if "tokenfleet_event_loop_lag_busy_max_seconds" not in end_scrape
            else round(end_scrape["tokenfleet_event_loop_lag_busy_max_seconds"] * 1e3, 1),
            "max_after_warmup": _lag_bound_after(run.warm_scrape, end_scrape),
            "ticks_over_50ms": _lag_over(run.warm_scrape, end_scrape, "0.05"),
            "ticks_over_100ms": _lag_over(run.warm_scrape, end_scrape, "0.1"),
            "ticks": int(end_scrape.get("tokenfleet_event_loop_lag_seconds_count", 0)
                         - run.warm_scrape.get("tokenfleet_event_loop_lag_seconds_count", 0)),
            "recent_max_series": run.recent_lag,
        },
        "gateway_cpu_s": round(gateway_cpu_s, 1), "machine_busy_cores": round(busy_cores, 2),
        "gateway_inflight_at_end": end_scrape.get("_inflight_left"),
        "client": {"send_lag_ms": percentiles(run.send_lag_s, (50, 99), 1e3),
                   "loop_stall_max_ms": round(client_lag.max_lag_s * 1e3, 1), "slot_waits": run.slot_waits},
        "rss_series": run.rss,
        "targets": TARGETS,
        "pass": {"rss": growth is not None and growth <= TARGETS["rss_growth_mb"],
                 "loop_stall": stall_max is not None and stall_max * 1e3 < TARGETS["loop_stall_max_ms"],
                 "lost": by.get("lost", 0) == TARGETS["lost"]},
    }


def format_report(r: Mapping[str, Any]) -> str:
    m = r["machine"]
    o = r["outcomes"]
    rss, st = r["rss_mb"], r["loop_stall"]
    ok = {True: "ok", False: "MISSED"}

    def f(v: Any, fmt: str = "{:.1f}") -> str:
        return "-" if v is None else fmt.format(v)

    lines = [
        f"command   {r['command']}",
        f"commit    {r['commit']}   machine {m['cores']} cores, {m['cpu']}, {m['mem_gib']} GiB, "
        f"Python {m['python']}   {r['when_utc']} UTC",
        f"load      {r['requests']} requests, offered {r['rate_rps']:g}/s over {r['offered_s']} s, "
        f"wall {r['wall_s']} s; engines at time_scale {r['time_scale']}; machine busy "
        f"{r['machine_busy_cores']} cores, gateway CPU {r['gateway_cpu_s']} s",
        f"client    send lag p50/p99 {f(r['client']['send_lag_ms']['p50'])}/{f(r['client']['send_lag_ms']['p99'])} ms, "
        f"own loop stall max {r['client']['loop_stall_max_ms']} ms, {r['client']['slot_waits']} in-flight-cap waits",
        "",
        "| figure | value | target | |",
        "|---|---:|---:|---|",
        f"| RSS after warm-up ({rss['warmup_requests']} req) -> end, MB | {f(rss['after_warmup'])} -> {f(rss['end'])} "
        f"(peak {f(rss['peak'])}) | | |",
        f"| RSS growth, MB | {f(rss['growth'], '{:+.1f}')} | <= +{TARGETS['rss_growth_mb']:g} | {ok[r['pass']['rss']]} |",
        f"| longest event-loop stall (since start), ms | {f(st['max_ms'])} | < {TARGETS['loop_stall_max_ms']:g} "
        f"| {ok[r['pass']['loop_stall']]} |",
        f"| longest stall after warm-up (histogram bound) | {st['max_after_warmup']} | | |",
        f"| longest stall, on-CPU part (since start), ms | {f(st['busy_max_ms'])} | | |",
        f"| loop ticks late > 50 / > 100 ms after warm-up | {st['ticks_over_50ms']} / {st['ticks_over_100ms']} "
        f"of {st['ticks']} | | |",
        f"| lost | {r['lost']} | {TARGETS['lost']} | {ok[r['pass']['lost']]} |",
        "",
        "| outcome | requests |",
        "|---|---:|",
        *(f"| {k} | {v} |" for k, v in o.items()),
        "",
        "rejected   " + (", ".join(f"{k}: {v}" for k, v in r["rejected"].items()) or "-"),
        "aborted    " + (", ".join(f"{k}: {v}" for k, v in r["aborted"].items()) or "-"),
        "err events " + (", ".join(f"{k}: {v}" for k, v in r["error_events"].items()) or "-"),
        "lost       " + (", ".join(f"{k}: {v}" for k, v in r["lost_by_kind"].items()) or "-"),
    ]
    for kind, samples in r["lost_samples"].items():
        lines += [f"  {kind}: {s}" for s in samples]
    return "\n".join(lines)


# --- main -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/soak.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--fleet", default=None, help=f"fleet file (default {DEFAULT_FLEET_FILE})")
    p.add_argument("--requests", type=int, default=50_000)
    p.add_argument("--rate", type=float, default=150.0, help="offered requests per second (Poisson)")
    p.add_argument("--time-scale", type=float, default=20.0,
                   help="wall seconds per physical second of every sim engine (default 20: the default "
                        "fleet's engines then serve about half of --rate 150); 0 keeps the fleet file's")
    p.add_argument("--max-tokens", type=int, default=24, help="output budget drawn from 1..N")
    p.add_argument("--prompt-tokens", type=int, default=96, help="prompt length drawn from 16..N tokens")
    p.add_argument("--stream-frac", type=float, default=0.5)
    p.add_argument("--abort-frac", type=float, default=0.1, help="share of requests their client abandons")
    p.add_argument("--abort-max-s", type=float, default=3.0, help="abandon after 0..S seconds")
    p.add_argument("--bad-frac", type=float, default=0.01, help="share of requests meant to get a 4xx")
    p.add_argument("--timeout", type=float, default=120.0, help="client deadline per request (a hang past it is lost)")
    p.add_argument("--max-inflight", type=int, default=4000, help="client sockets at most (the open loop waits past it)")
    p.add_argument("--warmup", type=int, default=None, help="RSS baseline after this many sent (default 10%%, <= 5000)")
    p.add_argument("--sample-s", type=float, default=2.0, help="RSS and /metrics sampling period")
    p.add_argument("--planner", action=argparse.BooleanOptionalAction, default=None,
                   help="FleetMind's planner on/off (default: the fleet file's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="write the report as JSON")
    p.add_argument("--workdir", default=None, help="keep the gateway log and fleet file here (default: a temp dir)")
    return p


async def amain(args: argparse.Namespace) -> int:
    src = Path(args.fleet) if args.fleet else DEFAULT_FLEET_FILE
    config = load_fleet_file(src)
    specs = build_mix(args.requests, args.rate, config, args)
    admin_key = config.admin_api_keys[0] if getattr(config, "admin_api_keys", None) else None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tokenfleet-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    fleet = soak_fleet(src, args.time_scale or None, workdir / "fleet.yaml")
    procs = Processes(workdir)
    argv = [sys.executable, "-m", "tokenfleet", "up", "--fleet", str(fleet), "--port", "0"]
    if args.planner is not None:
        argv.append("--planner" if args.planner else "--no-planner")
    print(f"soak: starting {shlex.join(argv)} (log {workdir / 'gateway.log'})", file=sys.stderr, flush=True)
    gw = procs.spawn("gateway", argv, env={"PYTHONPATH": str(REPO)})
    client_lag = LoopMonitor()
    client_lag.start()
    try:
        url = (await _wait_for_log(gw, r"gateway\s+(http://\S+)/v1", START_TIMEOUT_S)).group(1)
        pid = gw.popen.pid
        busy0, cpu0 = _system_busy_s(), _cpu_seconds([gw], include_self=False)
        t0 = time.monotonic()
        run = await drive(url, specs, pid, admin_key, args)
        end_scrape = await settle(url, admin_key)
        end_rss = rss_mb(pid)
        busy = (_system_busy_s() - busy0) / max(1e-9, time.monotonic() - t0)
        cpu = _cpu_seconds([gw], include_self=False) - cpu0
        if gw.popen.poll() is not None:
            print(f"soak: the gateway exited with {gw.popen.returncode}:\n{gw.log_tail()}", file=sys.stderr)
    finally:
        client_lag.stop()
        procs.stop(gw, grace_s=30.0)
    report = build_report(args, specs, run, end_scrape, end_rss, cpu, busy, client_lag)
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"\nwrote {args.json}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.requests < 1 or not args.rate > 0 or args.max_inflight < 1 or args.max_tokens < 1:
        raise SystemExit("soak: --requests, --rate, --max-inflight and --max-tokens must be positive")
    args.commit = _git_commit()  # at the start: the code that runs, whatever changes meanwhile
    if args.warmup is None:
        args.warmup = min(5000, max(1, args.requests // 10))
    # One socket per request in flight on our side, two in the gateway (client + upstream): the
    # gateway inherits this soft limit.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with asyncio.Runner() as runner:
        return runner.run(amain(args))


if __name__ == "__main__":
    raise SystemExit(main())
