"""bench/request_wakeups.py's own machinery: the counting loop, the strace table, thread and stamp sums."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.bench_scripts import load_bench

rw = load_bench("request_wakeups")


def test_the_counting_loop_counts_timers_armed_and_fired_and_call_soon(tmp_path: Path) -> None:
    out = tmp_path / "counts.json"
    script = rw.COUNTING_PRELUDE + r"""
import asyncio, os, signal, uvloop
def fired(): pass
def never(): pass
async def main():
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    loop.call_later(0.001, fired)
    loop.call_at(loop.time() + 0.002, done.set_result, None)
    loop.call_later(30, never).cancel()
    loop.call_soon(fired)
    await done
    os.kill(os.getpid(), signal.SIGUSR1)  # the dump: handled on this thread before the next line
loop = uvloop.new_event_loop()
loop.run_until_complete(main())
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60,
                   env={"WAKE_COUNTS_OUT": str(out), "PATH": "/usr/bin:/bin"})
    counts = json.loads(out.read_text())
    assert counts["armed"]["__main__.fired"] == 1 and counts["fired"]["__main__.fired"] == 1
    assert counts["armed"]["__main__.never"] == 1 and "__main__.never" not in counts["fired"]
    assert counts["armed"].get("Future.set_result", 0) + counts["armed"].get("set_result", 0) == 1  # call_at once
    assert counts["soon"]["__main__.fired"] == 1
    assert "MainThread" in counts["threads"].values()


def test_strace_table_is_read_by_syscall_without_the_total() -> None:
    text = """% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
 40.00    0.004000           2      2000           epoll_pwait
 30.00    0.003000           1      7200           getpid
 10.00    0.001000           1      1000       120 read
------ ----------- ----------- --------- --------- ----------------
100.00    0.010000           1     10200       120 total
"""
    assert rw.parse_strace(text) == {"epoll_pwait": 2000, "getpid": 7200, "read": 1000}


def test_thread_deltas_group_pools_name_the_loop_and_count_new_threads_from_zero() -> None:
    a = {10: (1_000, 5, 1, 0.0), 11: (0, 0, 0, 0.0)}
    b = {10: (3_000, 9, 3, 0.01), 11: (1_000, 2, 0, 0.0), 12: (2_000, 2, 2, 0.0)}
    names = {"10": "MainThread", "11": "ThreadPoolExecutor-0_0", "12": "ThreadPoolExecutor-0_1"}
    rows = rw.thread_deltas(a, b, names, pid=10, n=2)
    assert rows["MainThread"]["run_us"] == 1.0 and rows["MainThread"]["vol"] == 2 and rows["MainThread"]["invol"] == 1
    assert abs(rows["MainThread"]["sys_us"] - 5000.0) < 1e-6
    pool = rows["ThreadPoolExecutor-0"]
    assert pool["threads"] == 2 and pool["run_us"] == 1.5 and pool["vol"] == 2 and pool["invol"] == 1


def test_stamp_steps_keep_only_whole_requests_that_ran_alone() -> None:
    def rec(t0: int, step_ns: int, **extra: int) -> dict[str, int]:
        return {s: t0 + i * step_ns for i, s in enumerate(rw.STEPS)} | extra
    recs = [rec(0, 1000), rec(10**6, 3000), rec(2 * 10**6, 2000), rec(3 * 10**6, 99_000, overlap=1)]
    recs.append({"arrived": 0, "parsed": 5})  # incomplete: left out
    out = rw.stamp_steps(recs)
    assert out["records"] == 5 and out["complete"] == 3
    assert all(v == 2.0 for v in out["steps_us_p50"].values())  # the median of 1, 3 and 2 us
    assert out["arrived_to_first_write_us_p50"] == 2.0 * (len(rw.STEPS) - 1)
