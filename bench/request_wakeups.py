"""What one relayed request costs in wakeups, context switches, syscalls and timers, at a fixed rate.

    .venv/bin/python bench/request_wakeups.py [--rate 200] [--requests 1000] [--rounds 3]
        [--baseline-ref REF] [--strace] [--stamps] [--json OUT.json]

The gateway and worker `bench/peers.py --parts overhead` runs (`tokenfleet up`, TokenPilot, FCFS,
one static instance in front of one simulated worker at time_scale 0.001), the same open-loop load
(`peers.fixed_rate_workload`: 64-token prompts, 4 output tokens, streamed, keep-alive). Around each
round of `--requests` requests at `--rate`, it reads, per request:

- every thread of the gateway process (and of the worker): run time (`/proc/PID/task/TID/schedstat`,
  ns) and voluntary / involuntary context switches (`status`), by thread name: the gateway's
  Python threads are named from `threading.enumerate()` (the event loop is `MainThread`; a thread
  pool's threads are grouped by their prefix), a thread Python did not start is `native`;
- the event loop's callbacks, counted in the gateway by a subclass of uvloop's loop: `call_soon`
  (task steps and wakeups, future callbacks) and timers armed (`call_later`, `call_at`) and fired,
  by callback, and `call_soon_threadsafe` (a thread handing a result back: a wakeup of the loop);
- with `--strace`: afterwards one more round per gateway under `strace -f -c` (all threads),
  system calls by kind per request (strace slows the process: the counts, not the times);
- with `--stamps`: in every round, a bench-only hook (module patches in the gateway's start-up
  shim, nothing in the gateway's code; its calls are in the round's CPU) that stamps each request's
  arrival (first bytes read) -> request complete (parsed by the HTTP parser) -> the endpoint
  entered (`serve_endpoint`: uvicorn's task, the fast path) -> body parsed and tokenized -> relay
  entered -> admitted -> routed -> upstream write called -> returned -> first upstream bytes -> upstream
  head -> first body bytes -> first event read (prefetch) -> response object called -> client
  write called -> returned; per step the median over rounds of its per-round median, and the
  direct path's TTFT (one round of its own after the others). A write's
  step is wall time: on loopback the woken peer (worker, client) often runs on the writer's core
  before the write returns (the gateway's involuntary switches).

Only requests that ran alone are kept by `--stamps` (at 200 req/s, 5 ms apart, nearly all).
`--baseline-ref REF` also starts the gateway of git commit REF (`git archive`, this venv), rounds
alternating the order. The counting loop is in every measured gateway (both commits alike); it adds
a Python call per callback, so read the CPU figures as relative. Counts are far less noisy than
times on a shared machine. Linux only (/proc). No input files.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402  (bench/ is not a package: the same worker, gateway and load as the overhead runs)
from idle_cpu import ctx_switches, run_ns  # noqa: E402  (one reader of a thread's /proc figures)
from fleetsim.live import Target, new_session, replay  # noqa: E402

# Prepended to peers.GATEWAY_SHIM: uvloop's loop with counted callbacks; SIGUSR1 writes the counts
# and the Python threads' native ids to $WAKE_COUNTS_OUT (a signal handler runs on the main thread).
COUNTING_PRELUDE = r"""
import collections as _col, json as _json, os as _os, signal as _sig, threading as _th
import uvloop as _uv
_soon, _armed, _fired = _col.Counter(), _col.Counter(), _col.Counter()
def _cbname(cb):
    f = getattr(cb, "__func__", cb)
    n = getattr(f, "__qualname__", None) or type(cb).__name__
    m = getattr(f, "__module__", None) or ""
    return f"{m}.{n}" if m else n
def _counted(name, cb):
    def fire(*a):
        _fired[name] += 1
        return cb(*a)
    return fire
class _CountingLoop(_uv.Loop):
    def call_soon(self, cb, *args, context=None):
        _soon[_cbname(cb)] += 1
        return super().call_soon(cb, *args, context=context)
    def call_soon_threadsafe(self, cb, *args, context=None):
        _soon["threadsafe:" + _cbname(cb)] += 1
        return super().call_soon_threadsafe(cb, *args, context=context)
    def call_later(self, delay, cb, *args, context=None):
        n = _cbname(cb)
        _armed[n] += 1
        return super().call_later(delay, _counted(n, cb), *args, context=context)
    def call_at(self, when, cb, *args, context=None):
        n = _cbname(cb)  # uvloop's call_at calls self.call_later: count once, here
        _armed[n] += 1
        return _uv.Loop.call_later(self, when - self.time(), _counted(n, cb), *args, context=context)
_uv.new_event_loop = _CountingLoop  # what gateway.cli's loop factory calls
def _dump(*_a):
    out = {"soon": dict(_soon), "armed": dict(_armed), "fired": dict(_fired),
           "threads": {str(t.native_id): t.name for t in _th.enumerate() if t.native_id is not None}}
    path = _os.environ["WAKE_COUNTS_OUT"]
    with open(path + ".tmp", "w") as f:
        _json.dump(out, f)
    _os.replace(path + ".tmp", path)
_sig.signal(_sig.SIGUSR1, _dump)
"""

# Prepended after COUNTING_PRELUDE for --stamps: perf_counter_ns stamps of one request's steps,
# patched onto the classes the gateway uses (the listener's protocol, the relay, the upstream
# client, the head hold); SIGUSR2 writes the finished records to $WAKE_STAMPS_OUT.
STAMPS_PRELUDE = r"""
import inspect as _insp, time as _t
_cur, _recs = {}, []
def _st(step):
    if "arrived" in _cur and step not in _cur:
        _cur[step] = _t.perf_counter_ns()
def _wrap(owner, attr, before=None, after=None):
    # owner.attr stamped `before` it runs and `after` it returns (a coroutine function: awaited)
    f = getattr(owner, attr)
    if _insp.iscoroutinefunction(f):
        async def w(*a, **k):
            if before:
                _st(before)
            r = await f(*a, **k)
            if after:
                _st(after)
            return r
    else:
        def w(*a, **k):
            if before:
                _st(before)
            r = f(*a, **k)
            if after:
                _st(after)
            return r
    setattr(owner, attr, w)
def _stamp_patches():
    import gateway.listener as L, gateway.relay as R, gateway.upstream_http as U, gateway.head_hold as H
    import gateway.app as APP
    P = L.GuardedHttpToolsProtocol
    dr = P.data_received
    def data_received(self, data):
        if getattr(self, "_listener", None) is not None and self._listener.limits.name == "public":
            if not _cur:
                _cur["arrived"], _cur["conn"] = _t.perf_counter_ns(), id(self)
            elif _cur["conn"] != id(self):
                _cur["overlap"] = 1  # another request while this one is in flight: not kept
        return dr(self, data)
    P.data_received = data_received
    _wrap(P, "on_message_complete", before="parsed")
    _wrap(APP, "serve_endpoint", before="endpoint")  # looked up in gateway.app's globals at each request
    _wrap(APP, "parse_off_loop", after="body_parsed")
    _wrap(R.Relay, "handle", before="handler")
    _wrap(R.Relay, "choose", before="admitted", after="routed")
    _wrap(U._Connection, "send", before="upstream_send", after="upstream_written")
    _wrap(U._Connection, "data_received", before="upstream_first_bytes")
    _wrap(U._Connection, "on_headers_complete", before="upstream_head")  # httptools binds callbacks per parser
    _wrap(U._Connection, "on_body", before="upstream_body")
    _wrap(R.RelayStream, "prefetch", after="prefetched")
    _wrap(R.RelayStreamingResponse, "__call__", before="response_called")
    hw = H.HeadHold.write
    def _hw(self, data):
        if self._held is not None and "upstream_body" in _cur:
            _st("client_write_call")  # the write that puts the head and first events on the wire
        r = hw(self, data)
        if self._held is None and "upstream_body" in _cur and "arrived" in _cur:  # on the wire, not held back
            _cur["client_first_write"] = _t.perf_counter_ns()
            _recs.append(dict(_cur))
            _cur.clear()
        return r
    H.HeadHold.write = _hw
_stamp_patches()
def _dump_stamps(*_a):
    path = _os.environ["WAKE_STAMPS_OUT"]
    with open(path + ".tmp", "w") as f:
        _json.dump(_recs, f)
    _os.replace(path + ".tmp", path)
    _recs.clear()
_sig.signal(_sig.SIGUSR2, _dump_stamps)
"""

STEPS = ("arrived", "parsed", "endpoint", "body_parsed", "handler", "admitted", "routed", "upstream_send",
         "upstream_written",
         "upstream_first_bytes", "upstream_head", "upstream_body", "prefetched", "response_called",
         "client_write_call", "client_first_write")


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _thread_stats(pid: int) -> dict[int, tuple[int, int, int, float]]:
    """tid -> (run ns, voluntary switches, involuntary switches, system-time share) for every
    thread alive now; the last in `stat`'s 10 ms ticks (utime, stime): only the share is fine enough."""
    out: dict[int, tuple[int, int, int, float]] = {}
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            ns = run_ns(t)
            stat = (t / "stat").read_text().rpartition(")")[2].split()
            stime = int(stat[12]) * _TICK_S  # field 15 of stat, counted after the ")" of the name
            vol, invol = ctx_switches(t)
        except (OSError, ValueError, IndexError):
            continue  # ended between listing and reading
        out[int(t.name)] = (ns, vol, invol, stime)
    return out


def _group(name: str) -> str:
    """A thread pool's threads as one row: 'ThreadPoolExecutor-0_3' -> 'ThreadPoolExecutor-0'."""
    return re.sub(r"_\d+$", "", name)


def thread_deltas(a: dict[int, tuple[int, int, int, float]], b: dict[int, tuple[int, int, int, float]],
                  names: dict[str, str], pid: int, n: int) -> dict[str, dict[str, float]]:
    """Per thread group, per request: run us, of it in the kernel (system time, 10 ms ticks),
    voluntary and involuntary switches, threads seen."""
    rows: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"run_us": 0.0, "sys_us": 0.0, "vol": 0.0,
                                                                         "invol": 0.0, "threads": 0})
    for tid, (ns1, v1, i1, s1) in b.items():
        ns0, v0, i0, s0 = a.get(tid, (0, 0, 0, 0.0))  # a thread started during the round counts from zero
        name = "MainThread" if tid == pid else _group(names.get(str(tid), "native"))
        r = rows[name]
        r["run_us"] += (ns1 - ns0) / 1e3 / n
        r["sys_us"] += (s1 - s0) * 1e6 / n
        r["vol"] += (v1 - v0) / n
        r["invol"] += (i1 - i0) / n
        r["threads"] += 1
    return dict(rows)


def counter_deltas(a: dict[str, int], b: dict[str, int], n: int) -> dict[str, float]:
    return {k: (v - a.get(k, 0)) / n for k, v in b.items() if v != a.get(k, 0)}


async def _signal_and_read(pid: int, sig: int, path: Path, timeout_s: float = 10.0) -> Any:
    """Ask the gateway's shim for its file (SIGUSR1: counts, SIGUSR2: stamps) and read it."""
    with_mtime = path.stat().st_mtime_ns if path.exists() else None
    os.kill(pid, sig)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_mtime_ns != with_mtime:
            return json.loads(path.read_text())
        await asyncio.sleep(0.02)
    raise RuntimeError(f"no answer from pid {pid} to signal {sig} within {timeout_s:g} s")


class Gateway:
    def __init__(self, label: str, proc: peers.Proc, counts: Path, stamps: Path) -> None:
        self.label, self.proc, self.counts, self.stamps = label, proc, counts, stamps

    @property
    def pid(self) -> int:
        return self.proc.popen.pid

    async def read_counts(self) -> dict[str, Any]:
        return await _signal_and_read(self.pid, signal.SIGUSR1, self.counts)


async def start(procs: peers.Processes, shape: peers.FleetShape, url: str, router: str, label: str,
                name: str, tree: Path | None, tmp: Path, stamps: bool) -> Gateway:
    counts, stamp_file = tmp / f"{name}.counts.json", tmp / f"{name}.stamps.json"
    os.environ["WAKE_COUNTS_OUT"], os.environ["WAKE_STAMPS_OUT"] = str(counts), str(stamp_file)
    shim = peers.GATEWAY_SHIM
    peers.GATEWAY_SHIM = COUNTING_PRELUDE + (STAMPS_PRELUDE if stamps else "") + shim
    try:
        proc = await peers.start_gateway(procs, shape, [url], router, name=name, tree=tree)
    finally:
        peers.GATEWAY_SHIM = shim
    return Gateway(label, proc, counts, stamp_file)


async def measure_round(gw: Gateway, worker: peers.Proc, wl: Any, session: Any, stamps: bool) -> dict[str, Any]:
    n = len(wl.requests)
    if stamps:
        await _signal_and_read(gw.pid, signal.SIGUSR2, gw.stamps)  # forget what came before the round
    c0 = await gw.read_counts()
    t0, w0 = _thread_stats(gw.pid), _thread_stats(worker.popen.pid)
    busy0, wall0 = peers._system_busy_s(), time.monotonic()
    run = await replay(wl, Target(gw.proc.url.removesuffix("/v1"), peers.MODEL, peers.API_KEY), session=session,
                       timeout_s=30)
    t1, w1 = _thread_stats(gw.pid), _thread_stats(worker.popen.pid)
    busy, wall = peers._system_busy_s() - busy0, time.monotonic() - wall0
    c1 = await gw.read_counts()
    steps = stamp_steps(await _signal_and_read(gw.pid, signal.SIGUSR2, gw.stamps)) if stamps else None
    threads = thread_deltas(t0, t1, c1["threads"], gw.pid, n)
    ok = sum(1 for r in run.records if r.status == "completed")
    if ok < n:
        print("  failures:", collections.Counter(r.reason for r in run.records if r.status != "completed").most_common(3))
        print(gw.proc.log_tail(1500))
    return {"requests": n, "ok": ok,
            "cpu_us_per_req": sum(r["run_us"] for r in threads.values()),
            "switches_per_req": sum(r["vol"] + r["invol"] for r in threads.values()),
            "threads": threads,
            "worker": thread_deltas(w0, w1, {}, worker.popen.pid, n),
            "soon": counter_deltas(c0["soon"], c1["soon"], n),
            "armed": counter_deltas(c0["armed"], c1["armed"], n),
            "fired": counter_deltas(c0["fired"], c1["fired"], n),
            "stamps": steps, "machine_busy_cores": busy / wall, "load_avg_1m": os.getloadavg()[0]}


def _med(rounds: list[dict[str, Any]], get: Any) -> float:
    return statistics.median(get(r) for r in rounds)


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds of every per-request figure (a key missing from a round counts as 0)."""
    out: dict[str, Any] = {"cpu_us_per_req": _med(rounds, lambda r: r["cpu_us_per_req"]),
                           "switches_per_req": _med(rounds, lambda r: r["switches_per_req"]),
                           "cpu_us_per_req_rounds": [round(r["cpu_us_per_req"], 1) for r in rounds]}
    if rounds[0].get("stamps") is not None:
        steps = list(rounds[0]["stamps"]["steps_us_p50"])
        out["stamps_us_p50"] = {k: _med(rounds, lambda r, k=k: r["stamps"]["steps_us_p50"][k]) for k in steps}
        out["stamps_us_p50"]["arrived -> client_first_write"] = _med(
            rounds, lambda r: r["stamps"]["arrived_to_first_write_us_p50"])
        out["stamps_kept"] = sum(r["stamps"]["complete"] for r in rounds)
        out["stamps_records"] = sum(r["stamps"]["records"] for r in rounds)
    for part in ("threads", "worker"):
        names = sorted({k for r in rounds for k in r[part]})
        out[part] = {k: {f: _med(rounds, lambda r, k=k, f=f: r[part].get(k, {}).get(f, 0.0))
                         for f in ("run_us", "sys_us", "vol", "invol")} for k in names}
    for part in ("soon", "armed", "fired"):
        names = sorted({k for r in rounds for k in r[part]})
        out[part] = {k: _med(rounds, lambda r, k=k, p=part: r[p].get(k, 0.0)) for k in names}
        out[part + "_total"] = _med(rounds, lambda r, p=part: sum(r[p].values()))
    return out


def format_summary(label: str, s: dict[str, Any], top: int) -> str:
    lines = [f"== {label}: {s['cpu_us_per_req']:.0f} us CPU/req (rounds {s['cpu_us_per_req_rounds']}), "
             f"{s['switches_per_req']:.2f} context switches/req",
             f"  {'thread':<34} {'run us/req':>10} {'kernel us':>9} {'vol/req':>8} {'invol/req':>9}"]
    rows = [*sorted(s["threads"].items(), key=lambda kv: -kv[1]["run_us"]),
            *(("(worker) " + k, v) for k, v in s["worker"].items())]
    for name, r in rows:
        if r["run_us"] >= 0.05 or r["vol"] + r["invol"] >= 0.005:
            lines.append(f"  {name:<34} {r['run_us']:>10.1f} {r['sys_us']:>9.0f} {r['vol']:>8.2f} {r['invol']:>9.2f}")
    for part, title in (("armed", "timers armed"), ("fired", "timers fired"), ("soon", "call_soon")):
        lines.append(f"  {title}: {s[part + '_total']:.2f}/req")
        for name, v in sorted(s[part].items(), key=lambda kv: -kv[1])[:top]:
            if v >= 0.005:
                lines.append(f"    {v:8.3f}  {name}")
    return "\n".join(lines)


def parse_strace(text: str) -> dict[str, int]:
    """`strace -c`'s table: syscall -> calls."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] not in ("total",):
            try:
                calls = int(parts[3])
            except ValueError:
                continue
            out[parts[-1]] = calls
    return out


async def strace_round(url: str, key: str | None, pid: int, wl: Any, session: Any, out: Path) -> dict[str, float]:
    """System calls per request by kind: one replay of `wl` to `url` with `strace -f -c` on process
    `pid` (all its threads), its table written to `out`."""
    st = subprocess.Popen(["strace", "-f", "-c", "-q", "-o", str(out), "-p", str(pid)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    await asyncio.sleep(1.0)  # attached to every thread before the first request
    try:
        await replay(wl, Target(url.removesuffix("/v1"), peers.MODEL, key), session=session, timeout_s=30)
    finally:
        st.send_signal(signal.SIGINT)
        _, err = st.communicate(timeout=30)
    calls = parse_strace(out.read_text())
    if not calls:
        raise RuntimeError(f"strace gave no table: {err.decode(errors='replace')[-500:]}")
    n = len(wl.requests)
    return {k: v / n for k, v in sorted(calls.items(), key=lambda kv: -kv[1])}


def stamp_steps(recs: list[dict[str, int]]) -> dict[str, Any]:
    """One round's stamped requests: the median of each step (us) over the requests that ran alone."""
    full = [r for r in recs if all(s in r for s in STEPS) and "overlap" not in r]
    steps: dict[str, float] = {}
    prev = "arrived"
    for s in STEPS[1:]:
        steps[f"{prev} -> {s}"] = statistics.median((r[s] - r[prev]) / 1e3 for r in full) if full else float("nan")
        prev = s
    total = statistics.median((r["client_first_write"] - r["arrived"]) / 1e3 for r in full) if full else float("nan")
    return {"records": len(recs), "complete": len(full), "steps_us_p50": steps, "arrived_to_first_write_us_p50": total}


async def direct_ttft(worker: peers.Proc, wl: Any, session: Any) -> float | None:
    run = await replay(wl, Target(worker.url.removesuffix("/v1"), peers.MODEL, None), session=session, timeout_s=30)
    ttfts = [r.ttft_s for r in run.records if r.status == "completed" and r.ttft_s is not None]
    return 1e3 * statistics.median(ttfts) if ttfts else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/request_wakeups.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=200.0, help="requests per second (default 200)")
    p.add_argument("--requests", type=int, default=1000, help="requests per round (default 1000)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per gateway (default 3)")
    p.add_argument("--baseline-ref", metavar="REF", help="also the gateway at git commit REF, rounds interleaved")
    p.add_argument("--router", default="tokenpilot")
    p.add_argument("--strace", action="store_true", help="then a round per gateway under strace -f -c")
    p.add_argument("--stamps", action="store_true", help="per-step stamps of every request in every round")
    p.add_argument("--max-busy", type=float, default=1.5,
                   help="start a round once the machine is below this many busy cores (waits <= 60 s)")
    p.add_argument("--top", type=int, default=25, help="callbacks listed per kind (default 25)")
    p.add_argument("--json", metavar="OUT.json")
    return p


async def amain(args: argparse.Namespace) -> int:
    report: dict[str, Any] = {"args": vars(args), "load_avg_1m_before": os.getloadavg()[0]}
    print(f"machine   {os.cpu_count()} CPU cores; load average {os.getloadavg()[0]:.2f} before starting", flush=True)
    wl = peers.fixed_rate_workload(args.rate, args.requests)
    async with peers.fast_worker_session("tokenfleet-wakeups-") as (procs, worker, shape, tmp):
        gws: list[Gateway] = []
        if args.baseline_ref:
            tree = peers._tree_at(args.baseline_ref, tmp / "baseline-tree")
            gws.append(await start(procs, shape, worker.url, args.router, f"@{args.baseline_ref}", "gw-base",
                                   tree, tmp, args.stamps))
        gws.append(await start(procs, shape, worker.url, args.router, "this tree", "gw", None, tmp, args.stamps))
        async with new_session(1024) as session:
            warm = peers.fixed_rate_workload(args.rate, max(50, args.requests // 10))
            for g in gws:
                await replay(warm, Target(g.proc.url.removesuffix("/v1"), peers.MODEL, peers.API_KEY),
                             session=session, timeout_s=30)
            per: dict[str, list[dict[str, Any]]] = {g.label: [] for g in gws}
            for r in range(args.rounds):
                for g in (gws if r % 2 == 0 else list(reversed(gws))):
                    await peers.wait_quiet(args.max_busy, 60.0)
                    m = await measure_round(g, worker, wl, session, args.stamps)
                    per[g.label].append(m)
                    print(f"round {r + 1} {g.label:<24} {m['ok']}/{m['requests']} ok  cpu {m['cpu_us_per_req']:.0f} "
                          f"us/req  switches {m['switches_per_req']:.2f}/req  timers armed "
                          f"{sum(m['armed'].values()):.2f} fired {sum(m['fired'].values()):.2f}  call_soon "
                          f"{sum(m['soon'].values()):.2f}  busy {m['machine_busy_cores']:.2f}  load "
                          f"{m['load_avg_1m']:.1f}", flush=True)
            report["rounds"] = per
            report["results"] = {label: summarize(rs) for label, rs in per.items()}
            print()
            for label, s in report["results"].items():
                print(format_summary(label, s, args.top))
                print()
            if args.strace:
                report["strace"] = {}
                for g in gws:
                    report["strace"][g.label] = await strace_round(g.proc.url, peers.API_KEY, g.pid, wl, session,
                                                                  tmp / f"strace-{g.pid}.txt")
                names = list(dict.fromkeys(k for c in report["strace"].values() for k in c))
                print(f"{'syscalls per request (strace -f -c)':<40}" + "".join(f"{g.label:>16}" for g in gws))
                for k in names:
                    print(f"  {k:<38}" + "".join(f"{report['strace'][g.label].get(k, 0.0):>16.2f}" for g in gws))
                print(f"  {'total':<38}" + "".join(f"{sum(report['strace'][g.label].values()):>16.2f}"
                                                    for g in gws))
                print()
            if args.stamps:
                res = report["results"]
                report["direct_ttft_ms_p50"] = d = await direct_ttft(worker, wl, session)
                print(f"{'step (us: median over rounds of the p50 of requests alone)':<60}"
                      + "".join(f"{g.label:>16}" for g in gws))
                for k in res[gws[0].label]["stamps_us_p50"]:
                    print(f"  {k:<58}" + "".join(f"{res[g.label]['stamps_us_p50'][k]:>16.1f}" for g in gws))
                print(f"  direct path TTFT p50 (client side, one round after) {d:.3f} ms; requests kept "
                      + ", ".join(f"{g.label} {res[g.label]['stamps_kept']}/{res[g.label]['stamps_records']}"
                                  for g in gws))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(amain(build_parser().parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
