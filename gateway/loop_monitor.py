"""Event-loop stall monitor: how late the gateway's event loop runs what is due.

A timer callback re-arms itself every `interval_s` (10 ms) and records how late it fired
(its *lag*). Anything that holds the loop — a blocking call, a long tokenization, a big
JSON parse, CPU starvation — delays every other callback, relay and health poll by at
least that much, so the lag is the loop's own latency, seen from inside.

    tokenfleet_event_loop_lag_seconds          histogram of every tick's lag
    tokenfleet_event_loop_lag_max_seconds      largest lag since the monitor started
    tokenfleet_event_loop_lag_recent_max_seconds  largest lag in the last 60 s
    tokenfleet_event_loop_lag_busy_max_seconds    largest lag while the process was on a CPU

Why two maxima: on a crowded machine the OS can keep the whole process off the CPU for
a while, and the loop is late without any fault of its own. The *busy* lag of a tick is
its lag less the time the process spent off the CPU since the tick was armed
(`time.process_time`, all threads): ~0 for a process the scheduler starved or that
slept in a blocking call, the whole lag for code that held the loop computing (a long
tokenization, a garbage collection, CPU saturation of the gateway itself).

Resolution: a stall of D seconds shows up as a lag between D - interval_s and D (the
stall may begin just after a tick). Cost: one timer callback per tick (a few
microseconds, ~0.05% of one core at 10 ms), nothing on the request path.

For health-check hysteresis, `max_lag_since(t)` answers "was the loop responsive since
`t`?" (a missed health poll during a stall of our own loop is not the engine's fault).
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections import deque
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

DEFAULT_INTERVAL_S = 0.01
# Stall sizes that matter here: 1 ms (noise) ... 100 ms (the soak target) ... seconds (a hang).
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
RECENT_WINDOW_S = 60.0
# Lags below this are timer jitter, not stalls: they are counted in the histogram but not
# kept for `max_lag_since`, so an idle loop keeps no history at all.
_KEEP_MIN_S = 0.001
# How far back `max_lag_since` can see, and a hard bound on what it keeps (see `_record`).
HISTORY_S = 600.0
_HISTORY_MAX = 4096


class LoopMonitor:
    """Measures the lag of the running event loop; `start()` inside it, `stop()` to end.

    Times are `clock()` seconds (default `time.monotonic`, the clock FleetState and the relay
    use), so callers can pass their own timestamps to `max_lag_since`.
    """

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not interval_s > 0:
            raise ValueError("interval_s must be positive")
        self.interval_s = interval_s
        self.clock = clock
        self.max_lag_s = 0.0  # since start
        self.max_busy_lag_s = 0.0  # since start, on-CPU part only (module docstring)
        self.ticks = 0
        self.lag_sum_s = 0.0
        self.bucket_counts = [0] * (len(LAG_BUCKETS) + 1)  # per bucket (not cumulative); last is +Inf
        # (fired_at, lag) with lags strictly decreasing from oldest to newest: the oldest entry
        # at or after t is the largest lag since t (a max-queue), O(1) amortised per tick.
        self._history: deque[tuple[float, float]] = deque()
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._armed_at = 0.0
        self._cpu_at_arm = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def running(self) -> bool:
        return self._handle is not None

    def start(self) -> None:
        """Begin ticking on the running loop (idempotent)."""
        if self._handle is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._arm()

    def stop(self) -> None:
        """Stop ticking (idempotent); the figures stay readable."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _arm(self) -> None:
        assert self._loop is not None
        self._armed_at = self.clock()
        self._cpu_at_arm = time.process_time()
        self._due = self._armed_at + self.interval_s
        self._handle = self._loop.call_later(self.interval_s, self._tick)

    def _tick(self) -> None:
        now = self.clock()
        # Timers may fire a hair early (the loop rounds to its clock resolution): that is 0 lag.
        lag = max(0.0, now - self._due)
        if lag > self.max_busy_lag_s:
            off_cpu = (now - self._armed_at) - (time.process_time() - self._cpu_at_arm)
            self.max_busy_lag_s = max(self.max_busy_lag_s, lag - max(0.0, off_cpu))
        self._record(now, lag)
        self._arm()

    def _record(self, now: float, lag: float) -> None:
        self.ticks += 1
        self.lag_sum_s += lag
        self.bucket_counts[bisect.bisect_left(LAG_BUCKETS, lag)] += 1
        if lag > self.max_lag_s:
            self.max_lag_s = lag
        h = self._history
        while h and h[0][0] < now - HISTORY_S:
            h.popleft()
        if lag < _KEEP_MIN_S:
            return
        while h and h[-1][1] <= lag:
            h.pop()
        # Kept entries form a strictly decreasing run of lags: ~ln(ticks) of them for lags in
        # any random order; only a long run of ever-smaller stalls could reach the cap.
        if len(h) >= _HISTORY_MAX:
            h.popleft()
        h.append((now, lag))

    def current_lag_s(self) -> float:
        """How overdue the pending tick is right now: a stall still in progress, as seen by
        a callback that runs before the monitor's own (0 when stopped or on time)."""
        if self._handle is None:
            return 0.0
        return max(0.0, self.clock() - self._due)

    def stalled_s(self) -> float:
        """Blocked time so far (every tick's lag summed), counting the stall in progress: read
        right after a block ends, before the monitor's own tick has run, it is already right.
        The difference of two readings is how much of that interval the loop could not run
        anything: health checks give engines their deadline in the rest (`gateway.fleet_state`)."""
        return self.lag_sum_s + self.current_lag_s()

    def max_lag_since(self, t: float) -> float:
        """The largest loop lag (seconds) of any stall that ended at or after `t` (a `clock()`
        time), including one still in progress. A stall that began before `t` counts whole,
        so the answer errs towards "the loop was unresponsive". Sees back `HISTORY_S`.

        Typical use: a health poll started at `t` timed out; if `max_lag_since(t)` is a
        sizeable part of the poll's timeout, the gateway's own loop was late, and the miss
        says nothing about the engine."""
        best = self.current_lag_s()
        for fired_at, lag in self._history:  # lags decrease along the deque: first match is the max
            if fired_at >= t:
                return max(best, lag)
        return best

    def recent_max_s(self, window_s: float = RECENT_WINDOW_S) -> float:
        return self.max_lag_since(self.clock() - window_s)


class LoopLagCollector(Collector):
    """The monitor's figures on /metrics, read at scrape time (nothing on the tick path)."""

    def __init__(self, monitor: LoopMonitor) -> None:
        self.monitor = monitor

    def collect(self) -> Iterator[Metric]:
        m = self.monitor
        cumulative, buckets = 0, []
        for bound, n in zip((*LAG_BUCKETS, float("inf")), m.bucket_counts):
            cumulative += n
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        hist = HistogramMetricFamily("tokenfleet_event_loop_lag",
                                     f"How late the gateway's event loop ran a timer due every "
                                     f"{m.interval_s * 1e3:g} ms", unit="seconds")
        hist.add_metric([], buckets, sum_value=m.lag_sum_s)
        yield hist
        yield GaugeMetricFamily("tokenfleet_event_loop_lag_max_seconds",
                                "Largest event-loop lag since the gateway started", value=m.max_lag_s)
        yield GaugeMetricFamily("tokenfleet_event_loop_lag_recent_max_seconds",
                                f"Largest event-loop lag in the last {RECENT_WINDOW_S:g} s",
                                value=m.recent_max_s())
        yield GaugeMetricFamily("tokenfleet_event_loop_lag_busy_max_seconds",
                                "Largest event-loop lag since start less the time the process was off "
                                "the CPU (the part the gateway's own work caused)", value=m.max_busy_lag_s)
