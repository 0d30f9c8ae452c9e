"""Event-loop stall monitor: how late the gateway's event loop runs what is due.

A timer callback re-arms itself every `interval_s` (10 ms) and records how late it fired
(its *lag*). Anything that holds the loop — a blocking call, a long tokenization, a big
JSON parse, CPU starvation — delays every other callback, relay and health poll by at
least that much, so the lag is the loop's own latency, seen from inside.

    tokenfleet_event_loop_lag_seconds          histogram of every tick's lag
    tokenfleet_event_loop_lag_max_seconds      largest lag since the gateway began serving
    tokenfleet_event_loop_lag_recent_max_seconds  largest lag in the last 60 s
    tokenfleet_event_loop_lag_busy_max_seconds    largest lag while the process was on a CPU

Why two maxima: on a crowded machine the OS can keep the whole process off the CPU for
a while, and the loop is late without any fault of its own. The *busy* lag of a tick is
its lag less the time the process spent off the CPU since the tick was armed
(`time.process_time`, all threads): ~0 for a process the scheduler starved or that
slept in a blocking call, the whole lag for code that held the loop computing (a long
tokenization, a garbage collection, CPU saturation of the gateway itself).

Resolution: a stall of D seconds shows up as a lag between D - interval_s and D (the
stall may begin just after a tick). Cost: one timer callback per tick, a few microseconds
of Python, nothing on the request path; but on an otherwise idle loop each tick is a wakeup
of the process of its own (the kernel's timer, two context switches, the loop's iteration),
~85-110 us of CPU each on the 2-core VM of bench/README.md: ~10 ms of CPU a second at 10 ms,
half of what an idle gateway spent (bench/README.md, "What the gateway spends with no request").

Idle ticking (`idle_interval_s`, what the gateway uses): a loop with nothing to do cannot
stall, so the monitor ticks every `idle_interval_s` (250 ms) while the loop is idle and every
`interval_s` otherwise, and while someone `hold()`s it (a health check in flight: its deadline
counts stalls, `stalled_s`, and needs them to the fine interval). Idle, judged every
`MODE_WINDOW_S` of ticking: the loop's thread woke fewer than `ACTIVE_WAKEUPS_PER_S` times a
second for anything but the monitor (its voluntary context switches, `getrusage(RUSAGE_THREAD)`:
each return from the poll that was not the monitor's timer, and each blocking call) and used
under `ACTIVE_CPU_SHARE` of a CPU (`time.thread_time`: a loop that never sleeps because it always
has work wakes no one). `poke()` (the listener calls it whenever a client's bytes arrive) ends
idle ticking at once, so a request is measured at `interval_s` from its first byte. While idle,
a stall that begins there (from a timer) reads as D - idle_interval_s to D, in `stalled_s` too.

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

try:
    import resource
    _RUSAGE_THREAD: int | None = resource.RUSAGE_THREAD  # Linux
except (ImportError, AttributeError):
    _RUSAGE_THREAD = None

DEFAULT_INTERVAL_S = 0.01
# Idle ticking (module docstring): the gateway's tick while its loop has nothing to do, how
# often the mode is judged, and what counts as a loop with something to do. An idle gateway
# with one engine wakes ~20-30 times a second for its own jobs (health polls, syncs): below.
IDLE_INTERVAL_S = 0.25
MODE_WINDOW_S = 0.25
ACTIVE_WAKEUPS_PER_S = 50.0
ACTIVE_CPU_SHARE = 0.05
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
                 clock: Callable[[], float] = time.monotonic, *, idle_interval_s: float | None = None) -> None:
        if not interval_s > 0:
            raise ValueError("interval_s must be positive")
        if idle_interval_s is not None and not idle_interval_s >= interval_s:
            raise ValueError("idle_interval_s must be at least interval_s")
        self.interval_s = interval_s
        self.idle_interval_s = idle_interval_s  # None: always interval_s
        self.clock = clock
        self.idle = False  # ticking at idle_interval_s now
        self.idle_ticks = 0  # ticks at idle_interval_s since start
        self.max_lag_s = 0.0  # since start (or `forget_peaks`)
        self.max_busy_lag_s = 0.0  # the same, on-CPU part only (module docstring)
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
        # the mode's judging window: since when, the thread's wakeups and CPU then, ticks then
        self._window_at = 0.0
        self._window_wakeups = 0
        self._window_cpu = 0.0
        self._window_ticks = 0
        self._holds = 0  # `hold()`s not yet released: tick finely meanwhile
        self._resume_idle = False  # idle when the first hold began: idle again when the last ends

    @property
    def running(self) -> bool:
        return self._handle is not None

    def start(self) -> None:
        """Begin ticking on the running loop (idempotent)."""
        if self._handle is not None:
            return
        self._loop = asyncio.get_running_loop()
        self.idle = False
        self._open_window(self.clock())
        self._arm()
        if self.idle_interval_s is not None:
            _POKEABLE[self._loop] = self

    def stop(self) -> None:
        """Stop ticking (idempotent); the figures stay readable."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._loop is not None and _POKEABLE.get(self._loop) is self:
            del _POKEABLE[self._loop]
        self.idle = False

    def forget_peaks(self) -> None:
        """Start the maxima (`max_lag_s`, `max_busy_lag_s`, `max_lag_since`, the recent maximum)
        afresh from now; the tick counts, the histogram and `stalled_s` go on. The gateway calls
        it once start-up is done: start-up's own work (the full collection before `gc.freeze()`,
        0.1-0.2 s) holds the loop before anyone is served, and is no serving stall. The pending
        tick is ended here, its lag so far counted (a stall in progress is start-up's too)."""
        if self._handle is not None:
            now = self.clock()
            self._handle.cancel()
            self._record(now, max(0.0, now - self._due))
            self._arm()
        self.max_lag_s = 0.0
        self.max_busy_lag_s = 0.0
        self._history.clear()

    def poke(self) -> None:
        """Something the monitor cannot see is starting (a client's bytes arrived): if ticking
        idle, tick at `interval_s` from now, for a window at least. Cheap when not idle (one
        attribute test)."""
        self._resume_idle = False  # work came in: a hold ending does not make the loop idle again
        if self.idle and self._handle is not None:
            self._switch(idle=False)
            self._open_window(self.clock())

    def hold(self) -> None:
        """Tick at `interval_s` until the matching `release_hold()`, whatever the loop does: for a
        caller that reads `stalled_s` over a span and needs the stalls in it to the fine interval
        (a health check's deadline counts only responsive time: `gateway.fleet_state`). When the
        last hold ends, a monitor that was idle at the first goes back to idle ticking at once."""
        self._holds += 1
        if self._holds == 1:
            self._resume_idle = self.idle
            if self.idle and self._handle is not None:
                self._switch(idle=False)

    def release_hold(self) -> None:
        self._holds = max(0, self._holds - 1)
        if self._holds == 0:
            if self._resume_idle and not self.idle and self._handle is not None:
                self._switch(idle=True)
            self._resume_idle = False

    def _switch(self, *, idle: bool) -> None:
        """Re-arm the pending tick at the other interval. Overdue, it is a stall that ends now:
        counted as the tick would have counted it, so `stalled_s` runs on without a jump."""
        assert self._handle is not None
        now = self.clock()
        self._handle.cancel()
        lag = now - self._due
        if lag > 0:
            self._record(now, lag)
        self.idle = idle
        self._arm()

    def _arm(self) -> None:
        assert self._loop is not None
        delay = self.idle_interval_s if self.idle else self.interval_s
        self._armed_at = self.clock()
        self._cpu_at_arm = time.process_time()
        self._due = self._armed_at + delay  # type: ignore[operator]
        self._handle = self._loop.call_later(delay, self._tick)  # type: ignore[arg-type]

    def _tick(self) -> None:
        now = self.clock()
        # Timers may fire a hair early (the loop rounds to its clock resolution): that is 0 lag.
        lag = max(0.0, now - self._due)
        if lag > self.max_busy_lag_s:
            off_cpu = (now - self._armed_at) - (time.process_time() - self._cpu_at_arm)
            self.max_busy_lag_s = max(self.max_busy_lag_s, lag - max(0.0, off_cpu))
        self._record(now, lag)
        if self.idle:
            self.idle_ticks += 1
        # (an idle tick is a window's worth: judged whatever a timer's rounding made of its due time)
        if self.idle_interval_s is not None and (self.idle or now - self._window_at >= MODE_WINDOW_S):
            self._judge(now)
        self._arm()

    def _open_window(self, now: float) -> None:
        self._window_at, self._window_ticks = now, self.ticks
        self._window_cpu = time.thread_time()
        self._window_wakeups = _thread_wakeups()

    def _judge(self, now: float) -> None:
        """Idle or not, from the window that ends now (module docstring); a new window opens."""
        span = max(now - self._window_at, 1e-9)
        # Each of our own ticks woke the loop once at most: what is left woke it for others.
        others = _thread_wakeups() - self._window_wakeups - (self.ticks - self._window_ticks)
        cpu_share = (time.thread_time() - self._window_cpu) / span
        self.idle = (_RUSAGE_THREAD is not None and self._holds == 0 and others < ACTIVE_WAKEUPS_PER_S * span
                     and cpu_share < ACTIVE_CPU_SHARE)
        self._open_window(now)

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


# The running monitor with idle ticking of each loop (at most one a loop: the gateway's), for
# code that sees activity the monitor cannot (`running_on`); entries leave at `stop()`.
_POKEABLE: dict[asyncio.AbstractEventLoop, LoopMonitor] = {}


def running_on(loop: asyncio.AbstractEventLoop) -> LoopMonitor | None:
    """The monitor with idle ticking running on `loop`, to `poke()` when work arrives; None if none."""
    return _POKEABLE.get(loop)


def _thread_wakeups() -> int:
    """Voluntary context switches of the calling thread so far (0 where the platform does not count them)."""
    if _RUSAGE_THREAD is None:
        return 0
    return resource.getrusage(_RUSAGE_THREAD).ru_nvcsw


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
        every = f"{m.interval_s * 1e3:g} ms" + ("" if m.idle_interval_s is None else
                                                 f" ({m.idle_interval_s * 1e3:g} ms while the loop is idle)")
        hist = HistogramMetricFamily("tokenfleet_event_loop_lag",
                                     f"How late the gateway's event loop ran a timer due every {every}",
                                     unit="seconds")
        hist.add_metric([], buckets, sum_value=m.lag_sum_s)
        yield hist
        yield GaugeMetricFamily("tokenfleet_event_loop_lag_max_seconds",
                                "Largest event-loop lag since the gateway began serving", value=m.max_lag_s)
        yield GaugeMetricFamily("tokenfleet_event_loop_lag_recent_max_seconds",
                                f"Largest event-loop lag in the last {RECENT_WINDOW_S:g} s",
                                value=m.recent_max_s())
        yield GaugeMetricFamily("tokenfleet_event_loop_lag_busy_max_seconds",
                                "Largest event-loop lag since serving began less the time the process was off "
                                "the CPU (the part the gateway's own work caused)", value=m.max_busy_lag_s)
