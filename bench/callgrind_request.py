"""Instructions per relayed request: the overhead runs' gateway under valgrind's callgrind.

    .venv/bin/python bench/callgrind_request.py [--requests 300] [--rate 20] [--rounds 2]
        [--baseline-ref REF] [--top 25]

CPU time per request moves by 10-30% between rounds on this shared 2-core machine; the number
of instructions a request executes barely moves with the neighbours' load, so it can judge a
cut of a few percent. The gateway is the one `bench/peers.py --parts overhead` runs
(`tokenfleet up`, TokenPilot, FCFS, one static instance, the same start-up shim) in front of
one simulated worker at time_scale 0.001 (not under valgrind), driven by the same load
(`peers.fixed_rate_workload`: streamed 64-token prompts, 4 output tokens, keep-alive) at a rate
valgrind can keep up with (`--rate`, default 20 req/s: every request runs alone, as nearly all
do at 200 req/s unslowed).

The gateway starts under `valgrind --tool=callgrind --instr-atstart=no` (start-up is not
counted: with instrumentation off it runs ~20x slower, ~1-3 min); after a warm-up round,
`callgrind_control` zeroes the counters and switches instrumentation on for each measured
round and dumps them after it. Counted: every thread of the gateway process (valgrind runs one
at a time), the requests and whatever the gateway does meanwhile with no request (the loop
monitor's 10 ms tick, health polls: slower under valgrind, so more of them per request at a
low rate; so `--tick-s`, default 1 s, sets both gateways' loop-monitor tick busy or idle).
`--idle-s` measures that idle work alone for as long, once per gateway, and the
"net" column subtracts it in proportion to each round's wall time. With `--baseline-ref`
rounds alternate between that commit's gateway (`git archive`, this venv) and this tree's.
`--top` lists the C functions with the most instructions in the last round of each gateway
(`callgrind_annotate`: where the interpreter's own work lands; Python functions are not
resolved). Linux, valgrind. No input files.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402  (bench/ is not a package: the same worker, gateway and load as the overhead runs)
from fleetsim.live import Target, new_session, replay  # noqa: E402

START_S = 900.0  # start-up under valgrind, instrumentation off: minutes on a loaded machine


def _control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True, timeout=120)


def _dump_total(out_prefix: str, pid: int, before: set[Path]) -> tuple[int, Path]:
    """The instruction count of the dump that appeared since `before`, and its file."""
    new = sorted(set(Path(out_prefix).parent.glob(f"{Path(out_prefix).name}.{pid}*")) - before,
                 key=lambda p: p.stat().st_mtime)
    if not new:
        raise RuntimeError(f"no callgrind dump for {pid}")
    text = new[-1].read_text(errors="replace")
    m = re.search(r"^totals:\s+(\d+)", text, re.MULTILINE)  # ("summary:" stays 0 after a zeroing)
    if not m:
        raise RuntimeError(f"no total in {new[-1]}")
    return int(m.group(1)), new[-1]


class Gateway:
    def __init__(self, label: str, proc: peers.Proc, prefix: str) -> None:
        self.label, self.proc, self.prefix = label, proc, prefix
        self.idle_ir_per_s: float | None = None

    @property
    def pid(self) -> int:
        return self.proc.popen.pid

    def _files(self) -> set[Path]:
        return set(Path(self.prefix).parent.glob(f"{Path(self.prefix).name}.{self.pid}*"))

    async def counted(self, work: Any) -> tuple[int, float, Path]:
        """Run `work` (a coroutine function) with instrumentation on: (instructions, wall s, dump)."""
        before = self._files()
        _control(self.pid, "-z")
        _control(self.pid, "-i", "on")
        t0 = time.monotonic()
        await work()
        wall = time.monotonic() - t0
        _control(self.pid, "-i", "off")
        _control(self.pid, "-d")
        await asyncio.sleep(0.5)
        ir, path = _dump_total(self.prefix, self.pid, before)
        return ir, wall, path


# Prepended to peers.GATEWAY_SHIM (both gateways alike): the loop monitor ticks every TICK_S
# seconds, busy or idle. Its 10 ms tick while busy counts in wall time, and under valgrind a
# request takes ~50x its wall time, so the ticks per request would be ~10x the real gateway's
# (~0.5 a request at 200 req/s) and move with the machine's load; they are not request work.
TICK_PRELUDE = r"""
import os, gateway.app, gateway.loop_monitor as _lm
class _CoarseTick(_lm.LoopMonitor):
    def __init__(self, *a, **k):
        t = float(os.environ["CALLGRIND_TICK_S"])
        k.pop("interval_s", None)
        k["idle_interval_s"] = t
        super().__init__(t, *a[1:], **k)
gateway.app.LoopMonitor = _CoarseTick
"""


async def start(procs: peers.Processes, shape: peers.FleetShape, url: str, router: str, label: str,
                name: str, tree: Path | None, tmp: Path) -> Gateway:
    prefix = str(tmp / f"{name}.cg")
    spawn = procs.spawn

    def under_valgrind(pname: str, argv: Any, env: Any = None, cwd: Path = peers.REPO) -> peers.Proc:
        vg = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--dump-instr=no",
              f"--callgrind-out-file={prefix}.%p"]
        return spawn(pname, vg + list(argv), env=env, cwd=cwd)

    procs.spawn = under_valgrind  # type: ignore[method-assign]
    try:
        proc = await peers.start_gateway_fleet(procs, peers.gateway_fleet(shape, [url]), 1, router, name=name,
                                               tree=tree, timeout_s=START_S)
    finally:
        procs.spawn = spawn  # type: ignore[method-assign]
    return Gateway(label, proc, prefix)


def top_functions(path: Path, n: int) -> str:
    out = subprocess.run(["callgrind_annotate", "--inclusive=no", str(path)], capture_output=True, text=True,
                         check=False, timeout=300).stdout
    rows = [ln for ln in out.splitlines() if re.match(r"^\s*[\d,]+ \(", ln)]
    return "\n".join(rows[:n + 1])


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Instructions per relayed request (callgrind), optionally against another commit.")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--rate", type=float, default=20.0, help="req/s (open loop; low enough for valgrind)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--idle-s", type=float, default=10.0, help="seconds of idle counted per gateway (0: none)")
    ap.add_argument("--baseline-ref", help="git ref whose gateway runs in alternate rounds")
    ap.add_argument("--tick-s", type=float, default=1.0,
                    help="the measured gateways' loop-monitor tick, busy or idle (0: theirs, 10 ms busy)")
    ap.add_argument("--router", default="tokenpilot")
    ap.add_argument("--top", type=int, default=0, help="C functions to list from each gateway's last round")
    ap.add_argument("--keep", metavar="DIR", help="copy each gateway's last round dump into DIR (callgrind_annotate)")
    return ap


async def amain(args: argparse.Namespace) -> int:
    print(f"machine   {os.cpu_count()} CPU cores; load average {os.getloadavg()[0]:.2f} before starting", flush=True)
    wl = peers.fixed_rate_workload(args.rate, args.requests)
    async with peers.fast_worker_session("tokenfleet-callgrind-") as (procs, worker, shape, tmp):
        specs: list[tuple[str, str, Path | None]] = []
        if args.baseline_ref:
            specs.append((f"@{args.baseline_ref}", "gw-base", peers._tree_at(args.baseline_ref, tmp / "base")))
        specs.append(("this tree", "gw", None))
        shim = peers.GATEWAY_SHIM
        if args.tick_s > 0:
            os.environ["CALLGRIND_TICK_S"] = repr(args.tick_s)
            peers.GATEWAY_SHIM = TICK_PRELUDE + shim
        try:
            gws = await asyncio.gather(*(start(procs, shape, worker.url, args.router, label, name, tree, tmp)
                                         for label, name, tree in specs))
        finally:
            peers.GATEWAY_SHIM = shim
        print(f"started under valgrind; load average {os.getloadavg()[0]:.2f}", flush=True)
        async with new_session(64) as session:
            def target(g: Gateway) -> Target:
                return Target(g.proc.url.removesuffix("/v1"), peers.MODEL, peers.API_KEY)

            warm = peers.fixed_rate_workload(args.rate, args.warmup)
            for g in gws:
                await replay(warm, target(g), session=session, timeout_s=120)
                if args.idle_s > 0:
                    ir, wall, _ = await g.counted(lambda: asyncio.sleep(args.idle_s))
                    g.idle_ir_per_s = ir / wall
                    print(f"idle      {g.label:<20} {ir / wall / 1e6:8.2f} M instructions/s", flush=True)
            per: dict[str, list[tuple[float, float]]] = {g.label: [] for g in gws}
            last: dict[str, Path] = {}
            for r in range(args.rounds):
                for g in (gws if r % 2 == 0 else list(reversed(gws))):
                    box: dict[str, Any] = {}

                    async def work(g: Gateway = g, box: dict[str, Any] = box) -> None:
                        box["run"] = await replay(wl, target(g), session=session, timeout_s=120)

                    ir, wall, path = await g.counted(work)
                    ok = sum(1 for x in box["run"].records if x.status == "completed")
                    if ok < len(wl.requests):  # a starved valgrind gateway sheds load (503s): say so
                        print("  not completed:", collections.Counter(x.reason for x in box["run"].records
                                                                       if x.status != "completed").most_common(3))
                    n = len(wl.requests)
                    raw = ir / n
                    net = (ir - (g.idle_ir_per_s or 0.0) * wall) / n
                    per[g.label].append((raw, net))
                    last[g.label] = path
                    print(f"round {r + 1} {g.label:<20} {ok}/{n} ok  {raw / 1e3:9.1f} k instr/req  net of idle "
                          f"{net / 1e3:9.1f} k  wall {wall:5.1f} s  load {os.getloadavg()[0]:.2f}", flush=True)
            print()
            base = None
            for g in gws:
                rs = per[g.label]
                raw = statistics.median(x for x, _ in rs)
                net = statistics.median(y for _, y in rs)
                ratio = "" if base is None else f"  ({raw / base[0]:.3f}x raw, {net / base[1]:.3f}x net)"
                base = base or (raw, net)
                print(f"median    {g.label:<20} {raw / 1e3:9.1f} k instr/req  net {net / 1e3:9.1f} k{ratio}")
            if args.keep:
                Path(args.keep).mkdir(parents=True, exist_ok=True)
                for g in gws:
                    shutil.copy(last[g.label], Path(args.keep) / f"{g.proc.name}.callgrind")
            if args.top:
                for g in gws:
                    print(f"\n{g.label}: C functions by instructions (last round, self)")
                    print(top_functions(last[g.label], args.top))
    return 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(amain(build_parser().parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
