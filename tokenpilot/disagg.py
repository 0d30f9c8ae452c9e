"""Prefill/decode placement per request: prefill where it decodes, or on a prefill instance
and move the KV (issue 17).

A site's pool holds instances of three roles: `mixed` and `decode` instances can run a
request whole (a decode instance prefilling locally); `prefill` instances only prefill and
send the KV to a `decode` or `mixed` instance over the interconnect. For each request a
`DisaggPolicy` picks one of

    local:   instance L prefills and decodes;
    split:   instance P prefills, its KV crosses the link P -> D, D decodes.

`TokenPilotDisagg` prices every option with TokenPilot's own cost model
(`TokenPilot.price`, the very terms `route` minimises) and takes the cheapest:

    local(L)    = cost(L)                        TTFT + interference with L's streams
                                                 + own decode + KV pressure (on the KV promised
                                                 there, as for D below) - locality
    split(P, D) = cost(P) - decode(P) - interference(P)   TTFT on P (its cache reuse counts)
                + transfer(P -> D)               the link's queue + latency + bytes / bandwidth
                                                 of the prompt less what D already caches
                + decode(D) + kv(D)              TPOT on D with this stream added (priced as
                                                 arriving prefilled: no prefill duty on D), and
                                                 the KV pressure of its blocks on the KV promised
                                                 there (`TokenPilot.committed_kv`: split requests
                                                 still prefilling for D count), priced at the
                                                 prompt's prefill on D (what a preemption redoes)
                + split_overhead_s               the second hop (two schedulers, a handshake)

so a short uncached prompt stays local (its prefill barely disturbs decoding there), a long
one goes to a prefill instance when the interference it would cause costs more than the
transfer, and a congested link keeps it local. The interference term is the TPOT harm of a
local prefill: with chunked prefill every step that carries one of its chunks stretches every
running stream's step, so it costs (its compute) x (the streams there) less the slack their
TPOT budget leaves them (`tokenpilot.score_kernel.score`).

Split demand (`SplitDemand`, read by the elastic role controller, `fleetmind.pd_roles`): for
every request the decision also asks whether a split onto an *idle* prefill instance would have
paid — the local option's TPOT harm on its streams plus what they slow its prefill by, against
an idle link's transfer and the second hop — and counts those it placed locally all the same
(there was no prefill instance, or every one was too busy). Their prefill seconds per second
are the prefill instances the fleet lacks: the growth signal of an elastic prefill pool that
starts empty (bench/DISAGG.md "Split demand"). Counting changes no decision. Cache reuse counts on the prefill side and,
for local prefill, on the decode side (both come from the router's prefix index).

The baselines (`tokenpilot.disagg_baselines`) share the skeleton (`RuleDisagg`): choose the
decode instance first, then a fixed rule says whether to prefill remotely.

Pure: no I/O, no clock; the link is asked through `Transfers`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from fleetcore.slo import DEFAULT_SLOS, ClassSLO, class_by_length
from fleetcore.types import InstanceSnapshot, RequestProfile
from tokenpilot.router import Priced, TokenPilot


class Transfers(Protocol):
    """What the caller knows of its links (`fleetcore.interconnect`): predicted seconds to move
    `tokens` tokens of KV from instance `src` to `dst` if sent at `now`, queueing included."""

    def predict_s(self, src: str, dst: str, tokens: int, now: float) -> float: ...


@dataclass(frozen=True, slots=True)
class PDDecision:
    """Where a request runs. `decode` is None when it runs nowhere; `prefill` is None when it
    prefills on `decode` itself."""

    decode: str | None
    reason: str
    prefill: str | None = None
    predicted_ttft_s: float | None = None
    transfer_s: float = 0.0
    cached_tokens: int = 0  # on the instance that prefills

    @property
    def split(self) -> bool:
        return self.prefill is not None and self.prefill != self.decode


@dataclass(slots=True)
class SplitDemand:
    """What the P/D decisions since the last read asked of the prefill pool (module doc)."""

    placed: int = 0  # requests placed
    starved: int = 0  # ... for which a split onto an idle prefill instance would have paid, placed locally
    starved_prefill_s: float = 0.0  # their prefill compute seconds (what prefill instances would have run)
    split_prefill_s: float = 0.0  # prefill compute seconds of the requests that split


class DisaggPolicy(Protocol):
    name: str
    demand: SplitDemand

    def decide(self, profile: RequestProfile, pool: Sequence[InstanceSnapshot], transfers: Transfers,
               now: float) -> PDDecision: ...

    def prefill_withdrawn(self, profile: RequestProfile, decode: InstanceSnapshot, now: float) -> None:
        """A split request's prefill leg was withdrawn unstarted: it prefills on `decode` instead."""
        ...


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    # The second hop of a split request (two schedulers and a handshake: about an engine step
    # each), charged against splitting.
    split_overhead_s: float = 0.02
    max_prefill_options: int = 4  # best prefill instances (by their own cost) paired ...
    max_decode_options: int = 4  # ... with the best decode instances (by decode cost)
    # Seconds of cost per second that an option's predicted TTFT passes the request's class
    # TTFT SLO, on top of the router's own TTFT seconds. A prefill queue far past the SLO
    # loses the request whole, where a local prefill on a decode instance only stretches
    # its streams' gaps (priced by the router's interference term): without it the longest
    # prompts queued a minute at the prefill pool in overload (the TTFT tail, bench/DISAGG.md).
    ttft_miss_weight: float = 0.0
    slos: Mapping[str, ClassSLO] = field(default_factory=lambda: dict(DEFAULT_SLOS))
    # Price the local option's own decode, against a split, without the duty of its own prefill
    # (`TokenPilotDisagg.decide`). Off by default: the live P/D tests and `bench/pd_live.py` split
    # long prompts beside a few light streams, which only that duty paid for (bench/DISAGG.md
    # "Split demand": what the tests would need instead).
    local_decode_as_split: bool = False
    # Split demand (`SplitDemand`) counts no request whose split would recompute more than this
    # x its local prefill's compute (`_Placer._would_split`).
    demand_recompute: float = 1.25


def _as_priced(pool: Sequence[InstanceSnapshot]) -> list[InstanceSnapshot]:
    """The pool as the cost model should see it: what runs on a prefill instance is prefills,
    not decode streams, so its running count must not be priced as streams whose KV every
    step reads (its queued prefill work is in the router's backlog already)."""
    return [replace(c, num_running=0) if c.role == "prefill" and c.num_running else c for c in pool]


def _roles(priced: Priced) -> tuple[list[int], list[int]]:
    """(candidates that may run a request whole or decode one, prefill-only candidates)."""
    whole = [j for j, c in enumerate(priced.pool) if c.role != "prefill"]
    prefill = [j for j, c in enumerate(priced.pool) if c.role == "prefill"]
    return whole, prefill


def _prefill_cost(priced: Priced) -> np.ndarray:
    """Cost of only prefilling on each candidate: its full cost less the parts that belong to
    decoding there (its own decode, the stall of streams decoding there)."""
    return priced.cost - priced.decode - priced.interference


def _nowhere(pool: Sequence[InstanceSnapshot]) -> PDDecision:
    return PDDecision(None, "no instance to decode on" if not pool else "no ready decode or mixed instance")


def _uncached_at(profile: RequestProfile, priced: Priced, j: int) -> int:
    return int(profile.prompt_tokens - priced.cached[j])


class _Placer:
    """Shared by every policy: price the pool, then book and explain the pick."""

    name = "disagg"

    def __init__(self, router: TokenPilot, config: DisaggConfig | None = None) -> None:
        self.router = router
        self.config = config or DisaggConfig()
        self.demand = SplitDemand()

    def take_demand(self) -> SplitDemand:
        """The split demand since the last call (and a fresh count from now)."""
        d, self.demand = self.demand, SplitDemand()
        return d

    def _would_split(self, profile: RequestProfile, priced: Priced, j: int, prefill: Sequence[int],
                     transfers: Transfers, now: float) -> float | None:
        """The prefill compute seconds an *idle* prefill instance would spend on this request if
        splitting onto it and sending the KV to candidate `j` costs less than prefilling on `j`;
        else None. Local: its prefill on `j` (slowed by `j`'s streams) and its interference (their
        steps stretched past the TPOT budget). Split: the bare compute on a prefill instance with
        the best prefix any prefill candidate holds (none without one), an idle link's transfer of
        what `j` does not cache (from `j`'s site: the link's time, not a sender's queue) and the
        second hop. Queues are left out on both sides (a prefill pool has one too). A split that
        would recompute more than `demand_recompute` x the local prefill's compute (the prefix is
        cached where it decodes: agent histories) is no demand: in an overloaded fleet that extra
        compute is capacity taken from other requests, which the per-request cost does not see."""
        if (profile.max_tokens or 2) < 2:
            return None
        cached = max((float(priced.cached[p]) for p in prefill), default=0.0)
        compute = self.router.prefill_compute_s(priced.ids[j], profile.prompt_tokens - cached, cached)
        if compute > self.config.demand_recompute * float(priced.compute[j]):
            return None
        local = float(priced.prefill[j] + priced.interference[j])
        iid = priced.ids[j]
        split = compute + self.config.split_overhead_s
        if local <= split:
            return None
        split += transfers.predict_s(iid, iid, _uncached_at(profile, priced, j), now)
        return compute if local > split else None

    def _count(self, profile: RequestProfile, priced: Priced, j: int, transfers: Transfers, now: float,
               d: PDDecision) -> PDDecision:
        """Book decision `d` (local on `j`, or split) into the split demand."""
        dm = self.demand
        dm.placed += 1
        if d.split:
            assert d.prefill is not None
            dm.split_prefill_s += float(priced.compute[priced.index(d.prefill)])
            return d
        compute = self._would_split(profile, priced, j, _roles(priced)[1], transfers, now)
        if compute is not None:
            dm.starved += 1
            dm.starved_prefill_s += compute
        return d

    def _price(self, profile: RequestProfile, pool: Sequence[InstanceSnapshot],
               now: float) -> tuple[Priced, list[int], list[int]]:
        """The pool priced, and which candidates can run it whole / only prefill it."""
        priced = self.router.price(profile, _as_priced(pool), now)
        whole, prefill = _roles(priced)
        return priced, whole, prefill

    def _kv(self, profile: RequestProfile, priced: Priced) -> np.ndarray:
        """Decode-side KV pressure per candidate, from the KV promised there (`committed_kv`:
        split requests still prefilling elsewhere count on their decode instance), priced at
        the prompt's prefill there (what a preemption redoes; what a wait for room costs)."""
        return self.router.kv_pressure_of(profile, priced, self.router.committed_kv(profile, priced),
                                          priced.prefill)

    def _local_cost(self, profile: RequestProfile, priced: Priced, kv: np.ndarray) -> np.ndarray:
        """Running the request whole on each candidate: the router's cost with its KV pressure
        (the engine's figure alone) replaced by the promised-KV one."""
        return priced.cost - priced.kv_pressure + kv

    def _late(self, profile: RequestProfile, ttft: np.ndarray | float) -> np.ndarray | float:
        """`ttft_miss_weight` x the seconds a predicted TTFT passes the request's TTFT SLO
        (zero without a weight or a bound)."""
        w = self.config.ttft_miss_weight
        slo = self.config.slos.get(profile.request_class or class_by_length(profile.prompt_tokens))
        if w <= 0 or slo is None or slo.ttft_s is None:
            return 0.0
        return w * np.maximum(0.0, np.asarray(ttft) - slo.ttft_s)

    def _local(self, profile: RequestProfile, priced: Priced, j: int, now: float, reason: str) -> PDDecision:
        iid = priced.ids[j]
        ttft = float(priced.ttft[j])
        self.router.book(profile, priced, iid, iid, now, ttft)
        return PDDecision(iid, reason, None, ttft, 0.0, int(priced.cached[j]))

    def _split(self, profile: RequestProfile, priced: Priced, p: int, d: int, transfer_s: float, now: float,
               reason: str) -> PDDecision:
        ttft = float(priced.ttft[p]) + transfer_s
        self.router.book(profile, priced, priced.ids[p], priced.ids[d], now, ttft)
        return PDDecision(priced.ids[d], reason, priced.ids[p], ttft, transfer_s, int(priced.cached[p]))

    def prefill_withdrawn(self, profile: RequestProfile, decode: InstanceSnapshot, now: float) -> None:
        """The router's booking follows a withdrawn prefill leg to the decode instance
        (`TokenPilot.prefill_withdrawn`), priced there as a local prefill (draining or not: the
        request is there already)."""
        priced = self.router.price(profile, [replace(decode, ready=True, draining=False)], now)
        self.router.prefill_withdrawn(profile, priced, now)

    def _transfer(self, profile: RequestProfile, priced: Priced, p: int, d: int, transfers: Transfers,
                  now: float) -> float:
        return transfers.predict_s(priced.ids[p], priced.ids[d], _uncached_at(profile, priced, d), now)


class TokenPilotDisagg(_Placer):
    """TokenPilot's P/D decision: the cheapest of every local and split option (module doc)."""

    name = "tokenpilot_disagg"

    def decide(self, profile: RequestProfile, pool: Sequence[InstanceSnapshot], transfers: Transfers,
               now: float) -> PDDecision:
        priced, whole, prefill = self._price(profile, pool, now)
        if not whole:
            return _nowhere(pool)
        kv = self._kv(profile, priced)
        cost = self._local_cost(profile, priced, kv) + self._late(profile, priced.ttft)
        best_local = min(whole, key=lambda j: (cost[j], j))
        if not prefill or (profile.max_tokens or 2) < 2:
            return self._count(profile, priced, best_local, transfers, now,
                               self._local(profile, priced, best_local, now, "local: no prefill instance"
                                           if not prefill else "local: one output token, nothing to decode elsewhere"))
        cfg = self.config
        pre = _prefill_cost(priced)
        # A decode instance that receives the KV does not prefill: price its stream as such
        # (its KV pressure is the promised-KV one: the engine's figure, and a pressure priced
        # at the near-zero prefill of a prompt that arrives whole, would see no pressure at all).
        streams = self.router.price(profile, [priced.pool[j] for j in whole], now, arrives_prefilled=True)
        dec = {j: float(streams.decode[streams.index(priced.ids[j])] + kv[j]) for j in whole}
        ps = sorted(prefill, key=lambda j: (pre[j], j))[: cfg.max_prefill_options]
        ds = sorted(whole, key=lambda j: (dec[j], j))[: cfg.max_decode_options]
        best: tuple[float, int, int, float] | None = None
        for p in ps:
            for d in ds:
                xfer = self._transfer(profile, priced, p, d, transfers, now)
                total = float(pre[p]) + xfer + dec[d] + cfg.split_overhead_s \
                    + float(self._late(profile, float(priced.ttft[p]) + xfer))
                if best is None or total < best[0]:
                    best = (total, p, d, xfer)
        assert best is not None
        total, p, d, xfer = best
        local = float(cost[best_local])
        if cfg.local_decode_as_split:
            # The local option's own decode priced as the split's is: without the duty its own
            # prefill adds (`duty_after`). That prefill is over before its first token, so it
            # stretches the steps of the streams already there (the interference term), not its
            # own; priced with it, a long prompt on an idle fleet splits for nothing (16k tokens,
            # no stream anywhere: 3.89 s split against 4.33 s local, `tests/test_pd_demand.py`).
            local += float(streams.decode[streams.index(priced.ids[best_local])] - priced.decode[best_local])
        if total < local:
            pick = self._split(profile, priced, p, d, xfer, now,
                               f"split: predicted cost {total:.3f} s < {local:.3f} s local")
        else:
            pick = self._local(profile, priced, best_local, now,
                               f"local: predicted cost {local:.3f} s <= {total:.3f} s split")
        return self._count(profile, priced, best_local, transfers, now, pick)


class RuleDisagg(_Placer):
    """The published deciders' shape: pick the decode instance first (here by TokenPilot's cost,
    so that comparisons isolate the rule), then `remote(uncached, prompt)` says whether to
    prefill on a prefill instance (the cheapest to prefill on) instead of locally."""

    def remote(self, uncached: int, prompt: int) -> bool:
        raise NotImplementedError

    def decide(self, profile: RequestProfile, pool: Sequence[InstanceSnapshot], transfers: Transfers,
               now: float) -> PDDecision:
        priced, whole, prefill = self._price(profile, pool, now)
        if not whole:
            return _nowhere(pool)
        cost = self._local_cost(profile, priced, self._kv(profile, priced))
        d = min(whole, key=lambda j: (cost[j], j))
        uncached = _uncached_at(profile, priced, d)
        if not prefill or (profile.max_tokens or 2) < 2 or not self.remote(uncached, profile.prompt_tokens):
            return self._local(profile, priced, d, now, f"local: {uncached} uncached tokens on the decode instance")
        pre = _prefill_cost(priced)
        p = min(prefill, key=lambda j: (pre[j], j))
        return self._split(profile, priced, p, d, self._transfer(profile, priced, p, d, transfers, now), now,
                           f"split: {uncached} uncached tokens on the decode instance")
