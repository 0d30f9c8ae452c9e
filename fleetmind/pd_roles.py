"""Elastic prefill/decode pools: flip instances between the prefill and decode roles from SLO load.

FleetMind's long cycle, as a clock-free state machine in the manner of
`fleetmind.placement_cycle`: observations in (the instances' roles and whether they are
idle, the SLO misses of the requests that ended since the last cycle), commands out
(`drain` one instance, `set_role` on it once idle). The executor (the simulator's
`fleetsim.disagg`, or a live gateway) only carries them out.

The rule, each cycle:
- pressure: among requests that ended in the window, the share that missed their TTFT
  bound and the share that missed their TPOT bound (class SLOs). TTFT pressure asks for
  one more prefill instance, TPOT pressure one more decode instance — unless prefilled
  requests had to wait for KV room on the decode side (`decode_blocked`): then the TTFT
  misses are the decode pool's, and that share counts as decode pressure instead;
- hysteresis: the two shares must differ by `margin`, in the same direction for `streak`
  cycles running, and `cooldown_s` must have passed since the last flip finished;
- step: the share of requests the pressure is about, times the pool that gives instances
  up, rounded, between 1 and `max_step` instances at once (a bad split is fixed in a few
  cycles, a small imbalance moves one instance);
- memory: a pool whose mean KV usage is above `max_source_kv` gives no instance up (its
  streams would have nowhere to go: decode KV fills before decode compute does);
- drain first: the instances to flip (the least loaded of their role) take no new work and
  are switched only when idle (nothing running, nothing held in transfer); those not idle
  within `drain_timeout_s` return to their role (and if none was idle, the flip is given
  up). A rollback is never given up: it waits for its instances however long they drain;
- rollback: the goodput (requests that met their SLO per second) over `watch_s` after a flip
  is compared with the `watch_s` before it (each side judged only once `min_samples`
  requests ended in it: a quiet spell proves nothing); a drop of more than `rollback_drop`
  flips the instance back, and that direction is blocked for `block_s`.
Each role keeps at least `min_per_role` instances.
"""

from __future__ import annotations

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
    max_step: int = 2
    max_source_kv: float = 0.8


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

    def cycle(self, now: float, instances: Sequence[RoleInstance], window: SLOWindow) -> list[RoleCommand]:
        span = now - self._last_t if self._last_t is not None else 0.0
        self._last_t = now
        if span > 0:
            self._history.append((now, window.met / span, window.ended))
        by_id = {i.instance_id: i for i in instances}
        if self._pending is not None:
            return self._advance(now, by_id)
        if self._watch is not None:
            return self._judge(now)
        return self._maybe_flip(now, instances, window)

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
    def _judge(self, now: float) -> list[RoleCommand]:
        w = self._watch
        assert w is not None
        if now - w.since < self.config.watch_s or self._ended(w.since, now) < self.config.min_samples:
            return []
        self._watch = None
        after = self._goodput(w.since, now)
        if after < w.goodput_before * (1 - self.config.rollback_drop):
            self._blocked[(w.from_role, w.to_role)] = now + self.config.block_s
            self._pending = _Flip(w.instance_ids, w.to_role, w.from_role, now, True, after)
            self._event(now, "rollback", ",".join(w.instance_ids), w.from_role,
                        f"goodput {after:.2f} req/s after, {w.goodput_before:.2f} before")
            return [RoleCommand("drain", i) for i in w.instance_ids]
        self._calm_until = now + self.config.cooldown_s
        self._event(now, "keep", ",".join(w.instance_ids), w.to_role,
                    f"goodput {after:.2f} req/s after, {w.goodput_before:.2f} before")
        return []

    # -- a new flip -------------------------------------------------------------------------
    def _maybe_flip(self, now: float, instances: Sequence[RoleInstance], window: SLOWindow) -> list[RoleCommand]:
        cfg = self.config
        want = self._pressure(window)
        if want is None or want != self._streak_dir:
            self._streak_dir, self._streak_n = want, 1 if want is not None else 0
        else:
            self._streak_n += 1
        if want is None or self._streak_n < cfg.streak or now < self._calm_until:
            return []
        src: Role = "decode" if want == "prefill" else "prefill"
        if self._blocked.get((src, want), 0.0) > now:
            return []
        pool = [i for i in instances if i.role == src and not i.draining]
        if len(pool) <= cfg.min_per_role or sum(i.kv_usage for i in pool) / len(pool) > cfg.max_source_kv:
            return []
        share_t, share_p = window.ttft_missed / window.ended, window.tpot_missed / window.ended
        share_b = window.decode_blocked / window.ended
        size = share_b if share_b > cfg.margin else abs(share_t - share_p)
        step = max(1, min(cfg.max_step, len(pool) - cfg.min_per_role, round(size * len(pool))))
        picks = tuple(i.instance_id for i in sorted(pool, key=lambda i: (not i.idle, i.load, i.instance_id))[:step])
        before = self._goodput(now - cfg.watch_s, now)
        self._pending = _Flip(picks, src, want, now, False, before)
        self._streak_dir, self._streak_n = None, 0
        why = "TTFT" if want == "prefill" else "decode KV" if share_b > cfg.margin else "TPOT"
        self._event(now, "drain", ",".join(picks), want,
                    f"{why} pressure: TTFT missed {share_t:.0%}, TPOT missed {share_p:.0%}, "
                    f"waited for decode KV {share_b:.0%} of {window.ended}")
        return [RoleCommand("drain", i) for i in picks]

    def _pressure(self, w: SLOWindow) -> Direction | None:
        if w.ended < self.config.min_samples:
            return None
        if w.decode_blocked / w.ended > self.config.margin:  # prefill is waiting on decode
            return "decode"
        diff = (w.ttft_missed - w.tpot_missed) / w.ended
        if diff > self.config.margin:
            return "prefill"
        if -diff > self.config.margin:
            return "decode"
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
