"""Elastic prefill/decode pools: flip instances between the prefill and decode roles from SLO load.

FleetMind's long cycle, as a clock-free state machine in the manner of
`fleetmind.placement_cycle`: observations in (the instances' roles and whether they are
idle, the SLO misses of the requests that ended since the last cycle), commands out
(`drain` one instance, `set_role` on it once idle). The executor (the simulator's
`fleetsim.disagg`, or a live gateway) only carries them out.

The start (`start_colocated`, the default): the first cycle turns every prefill instance the
fleet file names (beyond `min_prefill`) to decode, before the first request is placed, so
elastic begins as the colocated fleet and a prefill pool grows only on the pressure below
(bench/DISAGG.md "Elastic from colocated"; not watched: there is no goodput before it).

The rule, each cycle:
- pressure: among requests that ended in the window, the share that missed their TTFT
  bound and the share that missed their TPOT bound (class SLOs). TTFT pressure asks for
  one more prefill instance, TPOT pressure one more decode instance — unless prefilled
  requests had to wait for KV room on the decode side (`decode_blocked`), or the decode
  pool's mean KV usage is above `decode_kv_high`: then the decode pool's memory is the
  bound and that is decode pressure. TTFT pressure takes a decode instance only while the
  decode pool's KV is `kv_band` below that mark (decode instances prefill locally too: one
  taken for prefill only pays if its streams' KV is not missed);
- hysteresis: the two shares must differ by `margin`, in the same direction for `streak`
  cycles running, and `cooldown_s` must have passed since the last flip finished;
- step: the share of requests the pressure is about, times the pool that gives instances
  up, rounded, between 1 and `max_step` instances at once (a bad split is fixed in a few
  cycles, a small imbalance moves one instance);
- split demand (`split_demand`, off by default): the P/D decision's count of requests a split
  onto an idle prefill instance would have served better but that no prefill instance took
  (`tokenpilot.disagg.SplitDemand`), in prefill instances' worth, is prefill pressure ahead of
  the TTFT/TPOT shares, and TPOT pressure leaves alone a prefill pool its splits keep busy;
- memory: a pool whose mean KV usage is above `max_source_kv` gives no instance up (its
  streams would have nowhere to go: decode KV fills before decode compute does);
- urgency (`urgent_kv`): decode KV at or above `decode_kv_high + kv_band`, now or
  `kv_horizon_s` ahead at the rate it rose since the last cycle, moves prefill instances to
  decode from the first cycle (no streak, sample minimum or cooldown; a rollback's block
  still holds), the whole movable prefill pool (`urgent_whole_pool`; off: as many as bring
  the decode pool's mean back to the mark, `_kv_step`), not `max_step`; while such a move is watched, further urgent cycles extend it (judged, and
  rolled back, as one). The prefill pool may empty (`min_prefill`, 0): every request then
  runs whole on a decode instance, the colocated fleet — P/D's floor (long documents at
  16/16 collapsed to 0.05x colocated, bench/DISAGG.md "P/D that never collapses");
- back-off (`regrow_holdoff_s`): after an urgent move has taken prefill instances back (the
  pool pressure grew, the start aside), no pressure rule grows the prefill pool again for
  `regrow_holdoff_s`, doubled at each further take-back (up to `regrow_holdoff_max_s`), nor
  until the decode KV reading that made it urgent has cleared (`kv_band` below the mark,
  projected `kv_horizon_s` ahead): long documents grew 2-4 prefill instances three or four
  times a run and the urgent rule took each back (bench/DISAGG.md "P/D against colocated at
  the same budget");
- gradual (`gradual`, the default): the instances to flip (the least loaded of their role)
  take their new role at once and finish their in-flight work where they are (a decode
  instance turned prefill decodes its streams to the end while it takes new prefills), so
  a flip, and its rollback, cost no drain (the drain-first flip's rollback took 105 s on
  Mooncake, bench/DISAGG.md);
- drain first (`gradual=False`, for executors that cannot mix roles on one instance): the
  instances take no new work and are switched only when idle (nothing running, nothing
  held in transfer); those not idle within `drain_timeout_s` return to their role (and if
  none was idle, the flip is given up). A rollback is never given up: it waits for its
  instances however long they drain;
- rollback: the goodput (requests that met their SLO per second) over `watch_s` after a flip
  is compared with the `watch_s` before it (each side judged only once `min_samples`
  requests ended in it: a quiet spell proves nothing); a drop of more than `rollback_drop`
  flips the instance back, and that direction is blocked for `block_s` — unless the
  pressure that made the move still points the same way (then the drop is the load
  rising, not the move: undoing it took the right direction back on Mooncake).
Each role keeps at least `min_per_role` instances (the prefill role: `min_prefill`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from fleetcore.types import Role

Direction = Literal["prefill", "decode"]  # the role that gains an instance


@dataclass(frozen=True, slots=True)
class PDRolesConfig:
    margin: float = 0.05
    streak: int = 2
    min_samples: int = 20
    cooldown_s: float = 30.0
    drain_timeout_s: float = 60.0
    watch_s: float = 60.0
    rollback_drop: float = 0.1
    block_s: float = 600.0
    min_per_role: int = 1
    max_step: int = 4
    max_source_kv: float = 0.8
    # The prefill pool may give every instance up: with none, each request runs whole on a
    # decode instance (they prefill locally), the colocated fleet. Below that floor the split
    # is only a cost (long documents, agent loops: bench/DISAGG.md "P/D that never collapses").
    # None: `min_per_role`.
    min_prefill: int | None = 0
    # Decode KV, not decode compute, bounds the decode pool on long contexts (bench/DISAGG.md):
    # a decode pool whose mean KV usage is above this asks for an instance (decode pressure),
    # and TTFT pressure moves none out of it unless its usage is `kv_band` below the mark.
    decode_kv_high: float = 0.5
    kv_band: float = 0.1
    # Decode KV at or above `decode_kv_high + kv_band` is urgent: a level, not a noisy share of
    # misses, and the next minutes fill it further (preemptions redo 30k-token prefills). It
    # acts from the first cycle (no streak, no sample minimum, no cooldown), moves as many
    # prefill instances as bring the pool's mean back to the mark (`_kv_step`, up to the whole
    # prefill pool, not `max_step`), and a move already watched is extended while it lasts.
    urgent_kv: bool = True
    # An urgent move takes the whole movable prefill pool, not the proportional step
    # (`_kv_step`): the KV level says the decode pool is short but not by how much the next
    # seconds' arrivals need, and every second a burst spends at the old split pins its
    # requests' streams and prefix caches to the decode instances (agent loops x14: all 16 at
    # 0.5 s 4,977 tok/s, 2.5 s 4,465, 10 s 1,473; bench/DISAGG.md "Agent loops x14"). The
    # goodput watch judges and may roll it back as one move, as before.
    urgent_whole_pool: bool = True
    # The controller's own period (None: the fleet's `planner.cycle_s`). It reads gauges and
    # counts, so a short period costs nothing; with 15 s, agent loops' 33 s trace had arrived
    # before the first move (elastic 0.08x colocated; 5 s: 0.32x); on Mooncake 15 s gave 1.27x
    # at x5.5 but 0.69x / 0.81x at x5 / x6, 5 s 0.95-1.04x at all three (bench/DISAGG.md "P/D
    # that never collapses"). 2 s with `urgent_whole_pool`: agent loops x14 4,111 tok/s (5 s:
    # 1,684), Mooncake x5.5 1,738 (1,415), long documents x7 1,503 (1,336); 1 s and 3 s were
    # worse on at least one of them (bench/DISAGG.md "Agent loops x14").
    cycle_s: float | None = 2.0
    # Urgency reads the decode KV this far ahead, at the rate it rose since the reading at least
    # `kv_rate_s` old (the oldest kept, early on). With a 2 s period the rate since the last cycle
    # alone was noise times 15: one prefill pool's hand-over, +2% in 2 s, read as 91% ahead on
    # Mooncake and took the pool back at 38% (bench/DISAGG.md "Split demand").
    kv_horizon_s: float = 30.0
    kv_rate_s: float = 10.0
    # The fleet the controller starts from: True turns every prefill instance the fleet file
    # names (beyond `min_prefill`) to decode on the first cycle, before any request is placed,
    # so elastic starts as the colocated fleet and a prefill pool grows only on the pressure
    # rules below. The first seconds at the file's split decide an overloaded run: agent loops
    # x14 with all 16 prefill instances turned decode at 0.5 s measured 0.94x colocated, at 10 s
    # 0.28x (bench/DISAGG.md "Agent loops x14"). False: start from the file's roles.
    start_colocated: bool = True
    # Split demand (`SLOWindow.starved_prefill_s`): prefill seconds per second of requests that a
    # split onto an idle prefill instance would have served better, placed locally because no
    # prefill instance could take them, are prefill instances the fleet lacks. At or above
    # `demand_grow` (instances' worth) it is prefill pressure, ahead of TTFT and TPOT shares (a
    # TPOT miss a local prefill caused asks for a prefill instance, not a decode one), and the
    # step is that many instances (up to `max_step`). TPOT pressure takes a prefill instance
    # only while the pool less one still runs the splits' prefill seconds at `demand_util`.
    # Off by default: it grew 1-4 prefill instances early and lost goodput on all three
    # workloads (Mooncake x5.5 1,247 against 1,452 tok/s without it, long documents x7 500
    # against 1,660, agent loops x14 1,907 against 5,198; bench/DISAGG.md "Split demand").
    split_demand: bool = False
    demand_grow: float = 0.5
    demand_util: float = 0.8
    # Back-off after an urgent decode-KV move took prefill instances back (not the start): no
    # prefill growth for this long (a take-back is the urgent rule's verdict on the growth, held
    # as long as a rollback's `block_s`), doubled at each further take-back (at most
    # `regrow_holdoff_max_s`), and none until the projected decode KV is `kv_band` below the
    # mark. 0: no back-off (the growth rules alone, which on long documents grew a pool the
    # urgent rule took back two or three times a run). 120 s measured no change at long
    # documents x7 (the regrowth came 136 s after the take-back); bench/DISAGG.md.
    regrow_holdoff_s: float = 600.0
    regrow_holdoff_max_s: float = 3600.0
    # A prefill growth takes only as many decode instances as leave the decode pool's KV, projected
    # over the growth's watch (`watch_s`) at its present rate (level and rate scaled to the smaller
    # pool), `kv_band` below the mark (the level the TTFT rule grows from): a growth the urgent rule
    # would take back before it is judged is not made. Long documents x7: TTFT pressure grew 3
    # instances at 54 s (decode KV 25%, +0.39%/s) and the urgent rule took them back at 116 s (46%,
    # 65% ahead); bench/DISAGG.md "P/D against colocated at the same budget".
    grow_kv_guard: bool = True
    # Gradual flips: the instance takes its new role at once and finishes its in-flight work
    # where it is (a decode instance turned prefill keeps decoding its streams; a prefill
    # instance turned decode still sends the KV it holds). Off: drain first, switch once idle.
    gradual: bool = True


@dataclass(frozen=True, slots=True)
class RoleInstance:
    instance_id: str
    role: Role
    draining: bool
    idle: bool  # nothing running, queued or in KV transfer there
    load: int = 0  # requests in flight there (the least loaded one is drained)
    kv_usage: float = 0.0


@dataclass(frozen=True, slots=True)
class SLOWindow:
    """The requests that ended since the previous cycle."""

    ended: int
    met: int
    ttft_missed: int
    tpot_missed: int
    decode_blocked: int = 0  # prefilled requests that waited for KV room on a decode instance
    # The P/D decision's split demand over the window (`tokenpilot.disagg.SplitDemand`): requests
    # placed, those a split onto an idle prefill instance would have served better but that ran
    # locally (no prefill instance, or all too busy), their prefill compute seconds, and the
    # prefill compute seconds of the requests that did split.
    placed: int = 0
    split_starved: int = 0
    starved_prefill_s: float = 0.0
    split_prefill_s: float = 0.0


@dataclass(frozen=True, slots=True)
class RoleCommand:
    kind: Literal["drain", "set_role"]
    instance_id: str
    role: Role | None = None  # set_role: the new role (the instance takes work again)


@dataclass(frozen=True, slots=True)
class RoleEvent:
    at: float
    kind: Literal["drain", "flip", "abandon", "keep", "rollback"]
    instance_id: str
    to_role: Role | None
    reason: str


@dataclass(slots=True)
class _Flip:
    """A flip draining (`since`: when it started) or done and watched (`since`: when done)."""

    instance_ids: tuple[str, ...]
    from_role: Role
    to_role: Role
    since: float
    rollback: bool
    goodput_before: float


@dataclass
class PDRoleController:
    config: PDRolesConfig = field(default_factory=PDRolesConfig)
    log: list[RoleEvent] = field(default_factory=list)
    _history: deque[tuple[float, float, int]] = field(default_factory=lambda: deque(maxlen=4096))  # (t, met/s, ended)
    _last_t: float | None = None
    _pending: _Flip | None = None
    _watch: _Flip | None = None
    _streak_dir: Direction | None = None
    _streak_n: int = 0
    _calm_until: float = 0.0
    _blocked: dict[tuple[Role, Role], float] = field(default_factory=dict)
    # (when, decode KV) since the decode pool last changed size
    _kv_seen: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=64))
    _kv_pool: int = -1  # the decode pool's size those readings were taken at
    _kv_ahead: float = 0.0  # decode KV projected `kv_horizon_s` ahead (this cycle's)
    _kv_rate: float = 0.0  # its rate (per second, >= 0) over the readings kept
    _span: float = 0.0  # seconds since the previous cycle (the window's)
    _takebacks: int = 0  # urgent moves that took prefill instances back (the back-off's count)
    _regrow_at: float = 0.0  # no prefill growth before this (the back-off)

    def cycle(self, now: float, instances: Sequence[RoleInstance], window: SLOWindow) -> list[RoleCommand]:
        first = self._last_t is None
        span = now - self._last_t if self._last_t is not None else 0.0
        self._last_t = now
        self._span = span
        if span > 0:
            self._history.append((now, window.met / span, window.ended))
        self._project(now, instances)
        by_id = {i.instance_id: i for i in instances}
        if first and self.config.start_colocated:
            return self._colocate(now, instances)
        if self._pending is not None:
            return self._advance(now, by_id)
        if self._watch is not None:
            return self._judge(now, instances, window)
        return self._maybe_flip(now, instances, window)

    # -- the start: the colocated fleet ------------------------------------------------------
    def _colocate(self, now: float, instances: Sequence[RoleInstance]) -> list[RoleCommand]:
        """Every prefill instance beyond `min_prefill` to decode (`start_colocated`). Not watched:
        there is no goodput before it to compare with; a prefill pool the pressure rules grow
        later is watched and rolled back as any other move."""
        pool = [i for i in instances if i.role == "prefill" and not i.draining]
        keep = min(len(pool), self._min("prefill"))
        picks = tuple(i.instance_id for i in sorted(pool, key=lambda i: (not i.idle, i.load, i.instance_id))
                      [: len(pool) - keep])
        if not picks:
            return []
        busy = [i.instance_id for i in pool if i.instance_id in picks and not i.idle]
        reason = f"start colocated: {len(picks)} of {len(pool)} prefill instances to decode"
        if self.config.gradual or not busy:
            self._event(now, "flip", ",".join(picks), "decode", reason)
            return [RoleCommand("set_role", i, "decode") for i in picks]
        # Drain first, never given up and not watched (as a rollback is).
        self._pending = _Flip(picks, "prefill", "decode", now, True, 0.0)
        self._event(now, "drain", ",".join(picks), "decode", reason)
        return [RoleCommand("drain", i) for i in picks]

    # -- a flip under way: drain, then switch -------------------------------------------
    def _advance(self, now: float, by_id: dict[str, RoleInstance]) -> list[RoleCommand]:
        f = self._pending
        assert f is not None
        here = [i for i in f.instance_ids if i in by_id]  # (one gone from the fleet: nothing to flip)
        ready = [i for i in here if by_id[i].idle]
        timed_out = now - f.since >= self.config.drain_timeout_s and not f.rollback
        if len(ready) < len(here) and not timed_out:
            return []
        self._pending = None
        stuck = [i for i in here if i not in ready]
        out = [RoleCommand("set_role", i, f.to_role) for i in ready]
        out += [RoleCommand("set_role", i, f.from_role) for i in stuck]
        if stuck:
            self._event(now, "abandon", ",".join(stuck), f.from_role,
                        f"not idle after {self.config.drain_timeout_s:g} s: back to {f.from_role}")
        if not ready:
            self._calm_until = now + self.config.cooldown_s
            return out
        self._event(now, "flip", ",".join(ready), f.to_role, f"drained in {now - f.since:.0f} s")
        if f.rollback:
            self._calm_until = now + self.config.cooldown_s
        else:
            self._watch = _Flip(tuple(ready), f.from_role, f.to_role, now, False, f.goodput_before)
        return out

    # -- after a flip: keep it or roll it back --------------------------------------------
    def _judge(self, now: float, instances: Sequence[RoleInstance], window: SLOWindow) -> list[RoleCommand]:
        w = self._watch
        assert w is not None
        if now - w.since < self.config.watch_s or self._ended(w.since, now) < self.config.min_samples:
            return self._extend(now, instances, w)
        self._watch = None
        after = self._goodput(w.since, now)
        # A drop while the pressure that made the move still points the same way is the load
        # rising, not the move (rolling it back would undo the right direction: bench/DISAGG.md).
        still = self._pressure(window, instances) == w.to_role
        if after < w.goodput_before * (1 - self.config.rollback_drop) and not still:
            self._blocked[(w.from_role, w.to_role)] = now + self.config.block_s
            self._event(now, "rollback", ",".join(w.instance_ids), w.from_role,
                        f"goodput {after:.2f} req/s after, {w.goodput_before:.2f} before")
            if self.config.gradual:
                self._calm_until = now + self.config.cooldown_s
                return [RoleCommand("set_role", i, w.from_role) for i in w.instance_ids]
            self._pending = _Flip(w.instance_ids, w.to_role, w.from_role, now, True, after)
            return [RoleCommand("drain", i) for i in w.instance_ids]
        self._calm_until = now + self.config.cooldown_s
        self._event(now, "keep", ",".join(w.instance_ids), w.to_role,
                    f"goodput {after:.2f} req/s after, {w.goodput_before:.2f} before")
        return []

    def _extend(self, now: float, instances: Sequence[RoleInstance], w: _Flip) -> list[RoleCommand]:
        """A move towards decode under watch, while the decode KV is still urgent: more prefill
        instances follow at once (judged, and rolled back, with the move they extend)."""
        if not (self.config.gradual and w.to_role == "decode" and self._urgent()):
            return []
        picks = self._kv_picks(instances)
        if not picks:
            return []
        w.instance_ids = w.instance_ids + picks
        self._event(now, "flip", ",".join(picks), "decode",
                    f"gradual; decode KV urgent {_decode_kv(instances):.0%}: extends the move of {w.since:.0f} s")
        return [RoleCommand("set_role", i, "decode") for i in picks]

    def _project(self, now: float, instances: Sequence[RoleInstance]) -> None:
        """Decode KV `kv_horizon_s` ahead at the rate since the last cycle: long documents fill
        the decode pool from 47% to 95% in two 15 s cycles, and a move that waits for the level
        comes after the caches it should have kept are gone (bench/DISAGG.md)."""
        u = _decode_kv(instances)
        ahead = u
        seen = self._kv_seen
        n = sum(i.role == "decode" for i in instances)
        if n != self._kv_pool:
            # A pool of another size has another mean: the step a flip makes in it is no rate
            # (2-4 instances to prefill lift the mean at once, which read as 61-74% ahead at 38-53%
            # and took them back within one cycle on long documents, bench/DISAGG.md "Split demand").
            seen.clear()
            self._kv_pool = n
        while len(seen) > 1 and now - seen[1][0] >= self.config.kv_rate_s:
            seen.popleft()  # (the newest reading old enough is kept as the base)
        self._kv_rate = 0.0
        if seen and now > seen[0][0]:
            self._kv_rate = max(0.0, (u - seen[0][1]) / (now - seen[0][0]))
            ahead = u + self._kv_rate * self.config.kv_horizon_s
        seen.append((now, u))
        self._kv_ahead = min(1.0, ahead)

    def _urgent(self) -> bool:
        cfg = self.config
        return cfg.urgent_kv and self._kv_ahead >= cfg.decode_kv_high + cfg.kv_band

    def _min(self, role: Role) -> int:
        cfg = self.config
        return cfg.min_prefill if role == "prefill" and cfg.min_prefill is not None else cfg.min_per_role

    def _kv_step(self, instances: Sequence[RoleInstance], pool: Sequence[RoleInstance]) -> int:
        """Prefill instances to turn decode so that the decode pool's mean KV comes back to the
        mark: D decode instances at mean usage u, k joining at their pool's mean s, give
        (D u + k s) / (D + k) <= high for k >= D (u - high) / (high - s)."""
        cfg = self.config
        dec = [i for i in instances if i.role == "decode"]
        if not dec or not pool:
            return 0
        u = max(_decode_kv(instances), self._kv_ahead)
        s = sum(i.kv_usage for i in pool) / len(pool)
        return max(1, math.ceil(len(dec) * (u - cfg.decode_kv_high) / max(cfg.decode_kv_high - s, cfg.kv_band)))

    def _kv_picks(self, instances: Sequence[RoleInstance]) -> tuple[str, ...]:
        """The prefill instances an urgent decode-KV move takes (least loaded first)."""
        pool = [i for i in instances if i.role == "prefill" and not i.draining]
        room = len(pool) - self._min("prefill")
        if room <= 0 or sum(i.kv_usage for i in pool) / len(pool) > self.config.max_source_kv:
            return ()
        step = room if self.config.urgent_whole_pool else min(room, self._kv_step(instances, pool))
        return tuple(i.instance_id for i in sorted(pool, key=lambda i: (not i.idle, i.load, i.instance_id))[:step])

    # -- a new flip -------------------------------------------------------------------------
    def _maybe_flip(self, now: float, instances: Sequence[RoleInstance], window: SLOWindow) -> list[RoleCommand]:
        cfg = self.config
        if self._urgent() and self._blocked.get(("prefill", "decode"), 0.0) <= now:
            picks = self._kv_picks(instances)
            if picks:
                held = self._hold_growth(now)  # (a take-back: the back-off starts, or grows)
                return self._start(now, picks, "prefill", "decode",
                                   f"decode KV urgent: {_decode_kv(instances):.0%}, {self._kv_ahead:.0%} ahead (mark "
                                   f"{cfg.decode_kv_high:.0%}), {len(picks)} to decode at once{held}")
        want = self._pressure(window, instances)
        if want is None or want != self._streak_dir:
            self._streak_dir, self._streak_n = want, 1 if want is not None else 0
        else:
            self._streak_n += 1
        if want is None or self._streak_n < cfg.streak or now < self._calm_until:
            return []
        if want == "prefill" and self._held(now):
            return []
        src: Role = "decode" if want == "prefill" else "prefill"
        if self._blocked.get((src, want), 0.0) > now:
            return []
        pool = [i for i in instances if i.role == src and not i.draining]
        if len(pool) <= self._min(src) or sum(i.kv_usage for i in pool) / len(pool) > cfg.max_source_kv:
            return []
        ended = max(window.ended, 1)
        share_t, share_p = window.ttft_missed / ended, window.tpot_missed / ended
        share_b = window.decode_blocked / ended
        kv_over = _decode_kv(instances) - cfg.decode_kv_high
        starved = self._starved(window)
        demand = want == "prefill" and starved >= cfg.demand_grow
        if demand:  # that many instances' worth of prefill found no prefill instance
            size_n = math.ceil(starved)
        else:
            size = share_b if share_b > cfg.margin else max(kv_over, 0.0) if want == "decode" and kv_over > 0 \
                else abs(share_t - share_p)
            size_n = round(size * len(pool))
        step = max(1, min(cfg.max_step, len(pool) - self._min(src), size_n))
        picks = tuple(i.instance_id for i in sorted(pool, key=lambda i: (not i.idle, i.load, i.instance_id))[:step])
        if want == "prefill" and cfg.grow_kv_guard:
            picks = self._kv_guarded(instances, picks)
            if not picks:
                return []
        why = "split demand" if demand else "TTFT" if want == "prefill" \
            else "decode KV" if share_b > cfg.margin or kv_over > 0 else "TPOT"
        reason = (f"{why} pressure: TTFT missed {share_t:.0%}, TPOT missed {share_p:.0%}, "
                  f"waited for decode KV {share_b:.0%} of {window.ended}, decode KV {_decode_kv(instances):.0%} "
                  f"(+{self._kv_rate:.2%}/s), "
                  f"split demand unserved {starved:.1f} instances ({window.split_starved} of {window.placed})")
        return self._start(now, picks, src, want, reason)

    def _start(self, now: float, picks: tuple[str, ...], src: Role, want: Role, reason: str) -> list[RoleCommand]:
        cfg = self.config
        before = self._goodput(now - cfg.watch_s, now)
        self._streak_dir, self._streak_n = None, 0
        if cfg.gradual:  # no drain: switched now, watched from now
            self._event(now, "flip", ",".join(picks), want, f"gradual; {reason}")
            self._watch = _Flip(picks, src, want, now, False, before)
            return [RoleCommand("set_role", i, want) for i in picks]
        self._pending = _Flip(picks, src, want, now, False, before)
        self._event(now, "drain", ",".join(picks), want, reason)
        return [RoleCommand("drain", i) for i in picks]

    def _kv_guarded(self, instances: Sequence[RoleInstance], picks: tuple[str, ...]) -> tuple[str, ...]:
        """The longest head of `picks` (decode instances to turn prefill) after which the decode
        pool's KV, projected `watch_s` ahead, stays `kv_band` below the mark (`grow_kv_guard`):
        the rest of the pool keeps its own KV and takes the arrivals the picks would have, so its
        mean is theirs less the picks' and its rate is scaled by D / (D - k)."""
        cfg = self.config
        dec = {i.instance_id: i.kv_usage for i in instances if i.role == "decode"}
        n, total = len(dec), sum(dec.values())
        limit = cfg.decode_kv_high - cfg.kv_band
        for k in range(len(picks), 0, -1):
            left = n - k
            if left <= 0:
                continue
            level = (total - sum(dec.get(i, 0.0) for i in picks[:k])) / left
            if level + self._kv_rate * n / left * cfg.watch_s < limit:
                return picks[:k]
        return ()

    def _hold_growth(self, now: float) -> str:
        """An urgent move takes prefill instances back: hold prefill growth (`regrow_holdoff_s`,
        doubled per take-back). Returns what the move's reason says of it ("" with no back-off)."""
        cfg = self.config
        if cfg.regrow_holdoff_s <= 0:
            return ""
        self._takebacks += 1
        hold = min(cfg.regrow_holdoff_max_s, cfg.regrow_holdoff_s * 2 ** (self._takebacks - 1))
        self._regrow_at = max(self._regrow_at, now + hold)
        return f"; take-back {self._takebacks}: no prefill growth for {hold:.0f} s and until decode KV clears"

    def _held(self, now: float) -> bool:
        """Whether the back-off holds prefill growth: within the hold-off, or (after a take-back)
        while the decode KV projected ahead has not cleared `kv_band` below the mark."""
        cfg = self.config
        if self._takebacks == 0:
            return False
        return now < self._regrow_at or self._kv_ahead >= cfg.decode_kv_high - cfg.kv_band

    def _starved(self, w: SLOWindow) -> float:
        """Prefill instances' worth of split demand no prefill instance took (0 when the rule is
        off or too few requests were placed to say)."""
        cfg = self.config
        if not cfg.split_demand or w.placed < cfg.min_samples or self._span <= 0:
            return 0.0
        return w.starved_prefill_s / self._span

    def _pool_needed(self, w: SLOWindow, instances: Sequence[RoleInstance]) -> bool:
        """Whether the prefill pool less one instance would run the splits' prefill seconds past
        `demand_util` (then TPOT pressure takes none of it: its streams' misses come from local
        prefills, which a smaller pool makes more of)."""
        cfg = self.config
        if not cfg.split_demand or self._span <= 0:
            return False
        n = sum(i.role == "prefill" for i in instances)
        return w.split_prefill_s / self._span > (n - 1) * cfg.demand_util

    def _pressure(self, w: SLOWindow, instances: Sequence[RoleInstance]) -> Direction | None:
        cfg = self.config
        kv = _decode_kv(instances)
        if w.ended >= cfg.min_samples:
            if w.decode_blocked / w.ended > cfg.margin:  # prefill is waiting on decode
                return "decode"
            if kv > cfg.decode_kv_high:  # the decode pool's memory is the bound: more of it
                return "decode"
        elif kv > cfg.decode_kv_high:
            return None
        # Decode instances prefill too (locally): taking one for prefill only pays while the
        # decode pool has KV to spare for the streams it would have held.
        kv_spare = kv < cfg.decode_kv_high - cfg.kv_band
        if self._starved(w) >= cfg.demand_grow:
            return "prefill" if kv_spare else None
        if w.ended < cfg.min_samples:
            return None
        diff = (w.ttft_missed - w.tpot_missed) / w.ended
        if diff > cfg.margin:
            return "prefill" if kv_spare else None
        if -diff > cfg.margin:
            return None if self._pool_needed(w, instances) else "decode"
        return None

    def _goodput(self, start: float, end: float) -> float:
        """Mean met-SLO rate of the cycles that ended in (start, end]."""
        xs = [g for t, g, _ in self._history if start < t <= end]
        return sum(xs) / len(xs) if xs else 0.0

    def _ended(self, start: float, end: float) -> int:
        return sum(n for t, _, n in self._history if start < t <= end)

    def _event(self, now: float, kind: Literal["drain", "flip", "abandon", "keep", "rollback"], iid: str,
               role: Role | None, reason: str) -> None:
        self.log.append(RoleEvent(now, kind, iid, role, reason))
        if len(self.log) > 1024:
            del self.log[:256]


def _decode_kv(instances: Sequence[RoleInstance]) -> float:
    """Mean KV usage of the decode pool (0 when it has no instance)."""
    pool = [i.kv_usage for i in instances if i.role == "decode"]
    return sum(pool) / len(pool) if pool else 0.0
