"""What the gateway spends with no request: CPU per second of an idle `tokenfleet up`.

    .venv/bin/python bench/idle_cpu.py [--seconds 20] [--rounds 5] [--baseline-ref REF[,REF...]]
        [--router tokenpilot] [--workers 1] [--warmup 5] [--profile 20] [--json OUT.json]

The same gateway `bench/peers.py --parts overhead` starts (`tokenfleet up` over an `adapter: static`
fleet file in front of simulated workers, time_scale 0.001, FCFS admission, uvicorn's default
stack), started and waited for as there: ready once its log names its URL and `/health` counts
every worker ready (a poll on /health, not a fixed sleep). Then nothing is sent to it. After
`--warmup` seconds (left out: the first seconds after start-up still finish lazy work), each round
samples the gateway's CPU over `--seconds` of wall time: ms of CPU per second of wall time, per
round and the median. CPU time is each thread's run time from `/proc/PID/task/TID/schedstat`
(nanoseconds; `stat`'s utime + stime count 10 ms ticks, too coarse for a few ms a second). Per
thread: the event loop's thread (the process's main thread) against all the others together (the
thread pools' sqlite and tokenizer calls, ...), and how often they woke up: context switches per
second (`/proc/PID/task/TID/status`; every timer, socket event or thread hand-off that wakes a
sleeping thread is one, and on a small VM each costs ~100 us of CPU by itself).

`--baseline-ref REF` (several: comma-separated) also starts the gateway of git commit REF (its
tree from `git archive`, this checkout's venv, as `bench/peers.py --baseline-ref` does) beside it;
the rounds alternate the order in which they are measured (`A B`, `B A`, ...), each in a window of
its own, so that drift in other users' load reaches all alike. All stay idle throughout; each
window reports `machine_busy_cores` (the whole machine's busy cores during it) and the 1-minute
load average.

`--profile S`: afterwards, S seconds of an idle gateway of this tree under cProfile, switched on
and off by signals (SIGUSR1, SIGUSR2) once it is ready, so the profile is the idle loop, not
start-up: what runs, how many times a second, and its cumulative time. cProfile inflates each
call; read the call counts, and the times as shares. The profiled gateway is a process started for
it (its shim installs the two signal handlers; the measured ones have none). Linux only (/proc).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402  (bench/ is not a package: the same worker and gateway as the overhead runs)

# Prepended to peers.GATEWAY_SHIM for --profile: cProfile of the main (event-loop) thread between
# SIGUSR1 and SIGUSR2, written to $IDLE_PROFILE_OUT. Signal handlers run on the main thread,
# so `enable()` there profiles the loop from that moment.
PROFILE_PRELUDE = r"""
import cProfile as _cp, os as _os, signal as _sig
_prof = _cp.Profile()
def _on(*_a):
    _prof.enable()
def _off(*_a):
    _prof.disable()
    _prof.dump_stats(_os.environ["IDLE_PROFILE_OUT"])
_sig.signal(_sig.SIGUSR1, _on)
_sig.signal(_sig.SIGUSR2, _off)
"""


@dataclass(frozen=True)
class Sample:
    """One reading of a process: CPU seconds (all threads; main thread apart) and context switches."""

    at: float
    cpu_s: float
    main_cpu_s: float
    wakeups: int  # voluntary + involuntary context switches, all threads
    main_wakeups: int
    threads: int


def run_ns(task: Path) -> int:
    """Nanoseconds a thread (`/proc/PID/task/TID`) has run on a CPU (`schedstat`): finer than
    `stat`'s 10 ms ticks. Also read by bench/request_wakeups.py."""
    return int((task / "schedstat").read_text().split()[0])


def ctx_switches(task: Path) -> tuple[int, int]:
    """A thread's (voluntary, involuntary) context switches (`status`)."""
    vol = invol = 0
    for line in (task / "status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches"):
            vol = int(line.split()[1])
        elif line.startswith("nonvoluntary_ctxt_switches"):
            invol = int(line.split()[1])
    return vol, invol


def sample(pid: int) -> Sample:
    """CPU time and context switches of the process's threads alive now (`/proc/PID/task/*`).
    A thread that ended takes its figures along: the gateway's threads (its thread pools) live
    as long as it does."""
    wake, main_wake, cpu_ns, main_ns, threads = 0, 0, 0, 0, 0
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            n, ns = sum(ctx_switches(t)), run_ns(t)
        except (OSError, ValueError, IndexError):
            continue  # ended between listing and reading
        threads += 1
        wake += n
        cpu_ns += ns
        if t.name == str(pid):
            main_wake, main_ns = n, ns
    return Sample(time.monotonic(), cpu_ns / 1e9, main_ns / 1e9, wake, main_wake, threads)


def rates(a: Sample, b: Sample, busy_s: float) -> dict[str, float]:
    wall = b.at - a.at
    return {"wall_s": wall,
            "cpu_ms_per_s": 1e3 * (b.cpu_s - a.cpu_s) / wall,
            "loop_thread_cpu_ms_per_s": 1e3 * (b.main_cpu_s - a.main_cpu_s) / wall,
            "other_threads_cpu_ms_per_s": 1e3 * ((b.cpu_s - a.cpu_s) - (b.main_cpu_s - a.main_cpu_s)) / wall,
            "wakeups_per_s": (b.wakeups - a.wakeups) / wall,
            "loop_thread_wakeups_per_s": (b.main_wakeups - a.main_wakeups) / wall,
            "threads": b.threads,
            "machine_busy_cores": busy_s / wall,
            "load_avg_1m": os.getloadavg()[0]}


async def measure(pid: int, seconds: float) -> dict[str, float]:
    busy0, s0 = peers._system_busy_s(), sample(pid)
    await asyncio.sleep(seconds)  # the measurement window itself: nothing is sent meanwhile
    s1 = sample(pid)
    return rates(s0, s1, peers._system_busy_s() - busy0)


def summarize(rounds: list[dict[str, float]]) -> dict[str, Any]:
    keys = [k for k in rounds[0] if k not in ("wall_s",)]
    out: dict[str, Any] = {k: statistics.median(r[k] for r in rounds) for k in keys}
    out["cpu_ms_per_s_rounds"] = [round(r["cpu_ms_per_s"], 2) for r in rounds]
    return out


def format_table(results: dict[str, dict[str, Any]]) -> str:
    lines = [f"{'gateway':<30} {'cpu ms/s':>9} {'loop thr':>9} {'others':>8} {'wakeups/s':>10} "
             f"{'loop wk/s':>10} {'thr':>4} {'busy':>5} {'load':>5}  rounds (cpu ms/s)"]
    for name, s in results.items():
        lines.append(f"{name:<30} {s['cpu_ms_per_s']:>9.2f} {s['loop_thread_cpu_ms_per_s']:>9.2f} "
                     f"{s['other_threads_cpu_ms_per_s']:>8.2f} {s['wakeups_per_s']:>10.1f} "
                     f"{s['loop_thread_wakeups_per_s']:>10.1f} {s['threads']:>4.0f} "
                     f"{s['machine_busy_cores']:>5.2f} {s['load_avg_1m']:>5.1f}  "
                     f"{', '.join(f'{v:.2f}' for v in s['cpu_ms_per_s_rounds'])}")
    lines.append("(medians over rounds; cpu = the gateway process's user+system CPU per wall second; loop thr = "
                 "its main (event-loop) thread's; others = every other thread's; wakeups = context switches, "
                 "all threads; busy = the whole machine's busy cores in the window; load = 1-min load average)")
    return "\n".join(lines)


def profile_rows(stats_path: Path, seconds: float, top: int) -> list[dict[str, Any]]:
    """The profile's functions by cumulative time: calls per second, cumulative and self ms per second."""
    st = pstats.Stats(str(stats_path))
    rows = []
    for (filename, line, name), (_cc, ncalls, tottime, cumtime, _callers) in st.stats.items():  # type: ignore[attr-defined]
        where = filename.split("site-packages/")[-1] if "site-packages/" in filename else filename
        where = where.split(str(peers.REPO) + "/")[-1]
        rows.append({"function": f"{where}:{line}({name})", "calls_per_s": ncalls / seconds,
                     "cum_ms_per_s": 1e3 * cumtime / seconds, "self_ms_per_s": 1e3 * tottime / seconds})
    rows.sort(key=lambda r: -r["cum_ms_per_s"])
    return rows[:top]


def format_profile(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'calls/s':>8} {'cum ms/s':>9} {'self ms/s':>9}  function"]
    for r in rows:
        lines.append(f"{r['calls_per_s']:>8.1f} {r['cum_ms_per_s']:>9.3f} {r['self_ms_per_s']:>9.3f}  {r['function']}")
    lines.append("(cProfile of the event-loop thread; its overhead inflates every call: read counts, and times as shares)")
    return "\n".join(lines)


async def run_profile(procs: peers.Processes, shape: peers.FleetShape, urls: list[str], router: str,
                      seconds: float, warmup: float, tmp: Path, top: int) -> list[dict[str, Any]]:
    out = tmp / "idle.pstats"
    shim = peers.GATEWAY_SHIM
    os.environ["IDLE_PROFILE_OUT"] = str(out)  # the child inherits it (peers.Processes.spawn)
    peers.GATEWAY_SHIM = PROFILE_PRELUDE + shim
    try:
        gw = await peers.start_gateway(procs, shape, urls, router, name="gateway-profiled")
    finally:
        peers.GATEWAY_SHIM = shim
    await asyncio.sleep(warmup)
    gw.popen.send_signal(signal.SIGUSR1)
    t0 = time.monotonic()
    await asyncio.sleep(seconds)
    gw.popen.send_signal(signal.SIGUSR2)
    elapsed = time.monotonic() - t0
    deadline = time.monotonic() + 30
    while not out.exists() or out.stat().st_size == 0:  # written by the child's SIGUSR2 handler
        if time.monotonic() > deadline or gw.popen.poll() is not None:
            raise RuntimeError(f"no profile from the gateway:\n{gw.log_tail()}")
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)  # dump_stats writes in one go; let it close the file
    procs.stop(gw)
    return profile_rows(out, elapsed, top)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/idle_cpu.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0, help="length of each measurement window (default 20)")
    p.add_argument("--rounds", type=int, default=5, help="windows per gateway (default 5)")
    p.add_argument("--warmup", type=float, default=5.0,
                   help="seconds after ready before the first window (default 5)")
    p.add_argument("--baseline-ref", metavar="REF",
                   help="also the gateway at git commit REF (its tree, same venv), windows alternated with ours; "
                        "several comma-separated: one gateway each")
    p.add_argument("--router", default="tokenpilot", help="the gateway's router (default tokenpilot)")
    p.add_argument("--workers", type=int, default=1, help="simulated workers (instances) behind it (default 1)")
    p.add_argument("--profile", type=float, default=0.0, metavar="S",
                   help="then S seconds of this tree's idle gateway under cProfile (default 0: none)")
    p.add_argument("--top", type=int, default=30, help="functions listed from the profile (default 30)")
    p.add_argument("--json", metavar="OUT.json", help="write the figures as JSON")
    return p


async def amain(args: argparse.Namespace) -> int:
    shape = peers.FleetShape(workers=args.workers, time_scale=0.001)
    report: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "load_avg_1m_before": os.getloadavg()[0]},
                              "args": vars(args)}
    print(f"machine   {os.cpu_count()} CPU cores; load average {os.getloadavg()[0]:.2f} before starting", flush=True)
    with tempfile.TemporaryDirectory(prefix="tokenfleet-idle-") as tmp:
        procs = peers.Processes(Path(tmp))
        try:
            workers = [await peers.start_worker(procs, shape, i) for i in range(args.workers)]
            urls = [w.url for w in workers]
            gateways: list[tuple[str, peers.Proc]] = []
            refs = [r.strip() for r in (args.baseline_ref or "").split(",") if r.strip()]
            for i, ref in enumerate(refs):
                tree = peers._tree_at(ref, Path(tmp) / f"baseline-tree{i}")
                gw = await peers.start_gateway(procs, shape, urls, args.router, name=f"gateway-baseline{i}", tree=tree)
                gateways.append((f"tokenfleet @{ref}", gw))
            gw = await peers.start_gateway(procs, shape, urls, args.router, name="gateway")
            gateways.append(("tokenfleet (this tree)", gw))
            for name, g in gateways:
                print(f"gateway   {name}: pid {g.popen.pid}, {g.extra['stack']}, {g.url}", flush=True)
            await asyncio.sleep(args.warmup)
            per: dict[str, list[dict[str, float]]] = {name: [] for name, _ in gateways}
            for r in range(args.rounds):
                order = gateways if r % 2 == 0 else list(reversed(gateways))  # A B .., .. B A
                for name, g in order:
                    m = await measure(g.popen.pid, args.seconds)
                    per[name].append(m)
                    print(f"round {r + 1}  {name:<30} cpu {m['cpu_ms_per_s']:6.2f} ms/s  (loop thread "
                          f"{m['loop_thread_cpu_ms_per_s']:.2f}, others {m['other_threads_cpu_ms_per_s']:.2f})  "
                          f"wakeups {m['wakeups_per_s']:.1f}/s  machine busy {m['machine_busy_cores']:.2f}  "
                          f"load {m['load_avg_1m']:.1f}", flush=True)
            results = {name: summarize(rs) for name, rs in per.items()}
            report["results"] = results
            report["rounds"] = per
            print()
            print(format_table(results))
            for name, _ in gateways[:-1]:
                ours, base = results["tokenfleet (this tree)"]["cpu_ms_per_s"], results[name]["cpu_ms_per_s"]
                if base > 0:
                    print(f"this tree / {name}: {ours / base:.2f}x")
            for _, g in gateways:
                procs.stop(g)
            if args.profile > 0:
                rows = await run_profile(procs, shape, urls, args.router, args.profile, args.warmup, Path(tmp),
                                         args.top)
                report["profile"] = rows
                print()
                print(format_profile(rows))
        finally:
            procs.stop_all()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"\nwrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(amain(build_parser().parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
