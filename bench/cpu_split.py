"""Where a relayed request's CPU goes by kind: user vs kernel time and system calls, ours and the SGLang router's.

    .venv/bin/python bench/cpu_split.py [--rate 200] [--requests 1000] [--rounds 3] [--no-sglang] [--strace]

The overhead runs' stack (`bench/peers.py --parts overhead`): one time_scale-0.001 simulated worker,
our gateway in front of it (`tokenfleet up`, TokenPilot, FCFS) and, unless `--no-sglang`, the SGLang
router (`sglang_router.launch_router --policy cache_aware`, from the peers venv: the benchmark-only
venv `bench/peers.py` installs; this script does not install it). The same open-loop load
(`peers.fixed_rate_workload`: 64-token prompts, 4 output tokens, streamed, keep-alive), rounds
alternating between the proxies so that a neighbour's load hits them alike. Per round and proxy,
from /proc/PID/stat (the process and its children) around the round: user and system CPU per
request, and the kernel's share. With `--strace`, one more round per proxy under `strace -f -c`
(all threads): system calls per request by kind (strace slows the traced process: read the
counts, not its times). Printed per round and as medians, with the machine's busy cores and load
average. No input files.

The question it answers (issue 14): is the gap to the SGLang router's CPU per request in user
space (our Python) or in the kernel (how many reads, writes and wakeups a request takes)?
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402  (bench/ is not a package: the same worker, gateway, router and load)
from request_wakeups import strace_round  # noqa: E402  (one strace round, one reader of its table)
from fleetsim.live import Target, new_session, replay  # noqa: E402


def tree_user_sys_s(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of `pid` and every live process below it (/proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, int, int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                f = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                stats[int(entry)] = (int(f[1]), int(f[11]), int(f[12]))
    user = system = 0
    todo, seen = [pid], set()
    while todo:
        p = todo.pop()
        if p in seen or p not in stats:
            continue
        seen.add(p)
        user += stats[p][1]
        system += stats[p][2]
        todo.extend(c for c, (ppid, _, _) in stats.items() if ppid == p)
    return user / tick, system / tick


async def one_round(name: str, url: str, key: str | None, pid: int, wl: Any, session: Any) -> dict[str, float]:
    u0, s0 = tree_user_sys_s(pid)
    b0 = peers._system_busy_s()
    run = await replay(wl, Target(url.removesuffix("/v1"), peers.MODEL, key), session=session, timeout_s=30)
    u1, s1 = tree_user_sys_s(pid)
    n = max(1, len(run.records))
    ok = sum(1 for r in run.records if r.status == "completed")
    row = {"user_us": 1e6 * (u1 - u0) / n, "sys_us": 1e6 * (s1 - s0) / n, "ok": ok, "n": len(run.records),
           "busy": (peers._system_busy_s() - b0) / max(run.wall_s, 1e-9), "load": os.getloadavg()[0]}
    return row


async def main_async(args: argparse.Namespace) -> None:
    print(f"machine   {os.cpu_count()} CPU cores; load average {os.getloadavg()[0]:.2f} before starting", flush=True)
    async with peers.fast_worker_session("cpu-split-") as (procs, worker, shape, tmp):
        gw = await peers.start_gateway(procs, shape, [worker.url], "tokenpilot")
        paths: list[tuple[str, str, str | None, int]] = [("tokenfleet", gw.url, peers.API_KEY, gw.popen.pid)]
        if not args.no_sglang:
            sg = await peers.start_sglang(procs, peers.ensure_sglang_router(False), [worker.url], "cache_aware")
            paths.append(("sglang-router", sg.url, None, sg.popen.pid))
        rows: dict[str, list[dict[str, float]]] = {p[0]: [] for p in paths}
        wl = peers.fixed_rate_workload(args.rate, args.requests)
        async with new_session(1024) as session:
            warm = peers.fixed_rate_workload(args.rate, max(50, args.requests // 10))
            for _, url, key, _ in paths:
                await replay(warm, Target(url.removesuffix("/v1"), peers.MODEL, key), session=session, timeout_s=30)
            for r in range(args.rounds):
                order = paths if r % 2 == 0 else list(reversed(paths))
                for name, url, key, pid in order:
                    await peers.wait_quiet(args.max_busy, 60.0)
                    row = await one_round(name, url, key, pid, wl, session)
                    rows[name].append(row)
                    print(f"round {r + 1} {name:<14} {row['ok']}/{row['n']} ok  user {row['user_us']:6.0f} us/req  "
                          f"sys {row['sys_us']:5.0f} us/req  kernel {100 * row['sys_us'] / max(1e-9, row['user_us'] + row['sys_us']):4.1f}%  "
                          f"busy {row['busy']:.2f}  load {row['load']:.1f}", flush=True)
            print()
            print(f"{'medians over rounds':<22}{'user us':>10}{'sys us':>10}{'total us':>10}{'kernel':>9}")
            for name, rs in rows.items():
                u = statistics.median(x["user_us"] for x in rs)
                s = statistics.median(x["sys_us"] for x in rs)
                t = statistics.median(x["user_us"] + x["sys_us"] for x in rs)
                print(f"  {name:<20}{u:>10.0f}{s:>10.0f}{t:>10.0f}{100 * s / max(1e-9, u + s):>8.1f}%")
            if args.strace:
                calls = {name: await strace_round(url, key, pid, wl, session, tmp / f"strace-{name}.txt")
                         for name, url, key, pid in paths}
                kinds = list(dict.fromkeys(k for c in calls.values() for k in c))
                print()
                print(f"{'syscalls per request (strace -f -c)':<40}" + "".join(f"{n:>16}" for n in calls))
                for k in kinds:
                    if any(c.get(k, 0.0) >= 0.005 for c in calls.values()):
                        print(f"  {k:<38}" + "".join(f"{c.get(k, 0.0):>16.2f}" for c in calls.values()))
                print(f"  {'total':<38}" + "".join(f"{sum(c.values()):>16.2f}" for c in calls.values()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=200.0, help="requests per second (default 200)")
    p.add_argument("--requests", type=int, default=1000, help="requests per round (default 1000)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per proxy (default 3)")
    p.add_argument("--no-sglang", action="store_true", help="our gateway only")
    p.add_argument("--strace", action="store_true", help="then a round per proxy under strace -f -c")
    p.add_argument("--max-busy", type=float, default=1.5,
                   help="start a round once the machine is below this many busy cores (waits <= 60 s)")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
