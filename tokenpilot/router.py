"""TokenPilot: route each request to the instance with the lowest predicted cost.

Filter -> score -> pick, in the manner of the Gateway API inference extension,
except that the score is not a weighted vote of heuristics but a prediction in
seconds of what sending the request there costs:

    cost = queue wait                 backlog of prefill work ahead of it / effective rate
         + prefill of uncached tokens (prompt - longest cached prefix there) / effective rate
         + decode interference        the part of this prefill's compute that pushes the streams
                                      decoding there past their TPOT budget over their
                                      remaining output (streams with slack absorb it for free)
         + KV pressure                risk of evicting hot prefixes or preempting when the
                                      instance's KV cache is nearly full

Effective prefill rate accounts for the decode streams sharing each engine step
(their KV reads grow with the context they hold). All times start from an
`EnginePrior` and are corrected online from observed TTFT and TPOT.

Herding guard. Affinity to a cached prefix gives way by itself: every request
routed to an instance adds its uncached prefill to that instance's backlog, so
once the queue ahead costs more than the cache saves, the next instance wins.
On top, a bounded seeded exploration sends a small fraction (`explore`) of
requests to a random near-best candidate (within `explore_slack` of the best
cost), which keeps learned speeds of rarely chosen instances fresh.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fleetcore.types import Candidate, InstanceSnapshot, RequestOutcome, RequestProfile, RouteDecision
from tokenpilot import score_kernel as sk
from tokenpilot.backlog import Outstanding
from tokenpilot.cache_index import PrefixCacheIndex
from tokenpilot.latency_model import Fit, LearnedLatency, corrected
from tokenpilot.forward import forward_parts
from tokenpilot.learning import SpeedFactor, StepFit
from tokenpilot.score_memo import ScoreMemo
from fleetcore.policies import InstanceRouter
from fleetcore.policies import EnginePrior


@dataclass(frozen=True, slots=True)
class TokenPilotConfig:
    kv_high_water: float = 0.97  # instances above this KV usage are filtered out
    kv_soft_mark: float = 0.85  # KV pressure cost starts here
    kv_pressure_weight: float = 1.0  # x prefill time at a completely full cache
    kv_overflow_weight: float = 10.0  # x prefill time per unit of predicted overflow (preemption)
    interference_weight: float = 1.0  # seconds of our TTFT worth one second of SLO overrun of one stream
    tpot_slo_s: float = 0.05
    locality_weight: float = 1.0  # x the prefill time a cache hit saves, credited on top of TTFT
    decode_weight: float = 0.3  # seconds of TTFT worth one second of this request's own decoding
    # Memory of the prefill-duty estimate: a few typical prefills long (short prompts want a
    # quick estimate, long prefills a long one), within these bounds.
    duty_span: float = 16.0
    duty_min_s: float = 2.0
    duty_max_s: float = 20.0
    max_duty: float = 0.9
    decode_slo_weight: float = 1.0  # ... of its decoding beyond the TPOT budget
    explore: float = 0.01
    explore_slack: float = 1.25
    max_decisions_kept: int = 256
    max_candidates_explained: int = 8  # the best few, kept with each decision
    # Rank candidates by the learned latency model's TTFT / TPOT (`tokenpilot.latency_model`)
    # instead of the physics' own. Either way the decision reports the learned predictions.
    learned_cost: bool = False


@dataclass(slots=True)
class _Inflight:
    slot: int
    prompt_tokens: int
    predicted_ttft_s: float
    predicted_queue_s: float
    predicted_tpot_s: float
    features: np.ndarray  # the learned latency model's inputs at the decision
    forward_ttft_s: float  # the scheduler-forward TTFT (`tokenpilot.forward`): the learned model's prior
    held_s: float  # time between the request's arrival and this dispatch (admission hold): in its TTFT
    # A P/D split request's prefill booking on its prefill instance (`book`): that instance's slot,
    # the prefill seconds and uncached tokens added to its backlog, the duty added, and when.
    split_prefill: tuple[int, float, float, float, float] | None = None
    # The forward TTFT's split into fixed cost, per-token cost and the rest (`forward_parts`): what
    # its outcome teaches the instance's `StepFit`. None: it teaches nothing (a split P/D request).
    forward_parts: tuple[float, float, float, float, float] | None = None  # (a, b, c, d, the fitted forward TTFT)


_SPLIT = float("inf")  # an _Inflight's predicted_queue_s for a P/D split request: learn no prefill from it


@dataclass(slots=True)
class _Learned:
    prefill: SpeedFactor
    decode: SpeedFactor
    step: StepFit  # the forward TTFT's step costs (fixed, per token): the decision's TTFT, not the instance cost


_TERMS = ("predicted_ttft_s", "queue_s", "prefill_s", "interference_s", "kv_pressure_s", "cached_tokens",
          "decode_s", "prefill_compute_s", "tpot_s", "prior_ttft_s", "prior_tpot_s", "forward_ttft_s",
          "ahead_tokens")
_FWD, _AHEAD, _FEATURES, _MATRIX = 12, 13, 14, 15  # positions in `_score`'s terms (not explained)
# Where each of `_score`'s terms lives in its result matrix (`tokenpilot.score_kernel`'s rows);
# None: the learned predictions (rows of it too, unless a fitted residual corrected them).
_ROWS = (sk.O_COST, None, sk.O_QUEUE, sk.O_PREFILL, sk.O_INTERFERENCE, sk.O_KV, sk.O_CACHED, sk.O_DECODE,
         sk.O_COMPUTE, None, sk.O_TTFT, sk.O_OWN_STEP, sk.O_FORWARD, sk.O_AHEAD)


def _terms_of(o: np.ndarray, ttft_pred: np.ndarray, tpot_pred: np.ndarray) -> tuple[np.ndarray, ...]:
    """`_score`'s terms (see there) from its result matrix `o` and the learned predictions."""
    terms = [o[r] for r in _ROWS]
    terms[1], terms[9] = ttft_pred, tpot_pred
    return (*terms, o[sk.O_FEATURES:], o)


_N_TERMS = len(_ROWS) + 2


class _Terms(Sequence[np.ndarray]):
    """`_terms_of`'s tuple, each term made when read: a decision reads 3-4 of its 16 (the cost,
    the TTFT, the cached tokens, the matrix), and 14 row views per scoring were ~3-5 us of it.
    A term is a view of the result matrix `o` (or one of the learned predictions), as in the
    tuple; slices and iteration give what the tuple's would."""

    __slots__ = ("_o", "_ttft", "_tpot", "_tpot_fit")

    def __init__(self, o: np.ndarray, ttft_pred: np.ndarray, tpot_pred: np.ndarray | None,
                 tpot_fit: tuple[Fit, float] | None = None) -> None:
        """`tpot_pred` None: the learned TPOT is `tpot_fit`'s (fit, bound) correction of the
        physics' own, made when first read (`_tpot_pred`)."""
        self._o, self._ttft, self._tpot, self._tpot_fit = o, ttft_pred, tpot_pred, tpot_fit

    def _tpot_pred(self) -> np.ndarray:
        if self._tpot is None:
            assert self._tpot_fit is not None
            fit, bound = self._tpot_fit
            self._tpot = corrected(fit, self._o[sk.O_OWN_STEP], self._o[sk.O_FEATURES:], bound)
        return self._tpot

    def __len__(self) -> int:
        return _N_TERMS

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        if isinstance(i, slice):
            return _terms_of(self._o, self._ttft, self._tpot_pred())[i]
        if i < 0:
            i += _N_TERMS
        if i == 1:
            return self._ttft
        if i == 9:
            return self._tpot_pred()
        if 0 <= i < _FEATURES:
            return self._o[_ROWS[i]]
        if i == _FEATURES:
            return self._o[sk.O_FEATURES:]
        if i == _MATRIX:
            return self._o
        raise IndexError(i)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(_terms_of(self._o, self._ttft, self._tpot_pred()))


class _Explained(Sequence[Candidate]):
    """The best few candidates of a decision, built only when someone reads them
    (the debug endpoint), so explanations cost nothing on the hot path. It keeps the scoring's
    result matrix, not its ~15 row views: a decision's objects are freed when it falls out of
    the kept ones, long after, from cold memory (~6 us a decision with the views)."""

    def __init__(self, ids: Sequence[str], terms: Sequence[np.ndarray], limit: int) -> None:
        self._ids, self._terms, self._limit = ids, terms, limit  # (`_Terms`: the matrix, views made when read)
        self._items: list[Candidate] | None = None

    def _build(self) -> list[Candidate]:
        if self._items is None:
            terms = self._terms[:_FEATURES]
            cost = terms[0]
            top = np.argsort(cost, kind="stable")[: self._limit]
            self._items = [Candidate(self._ids[j], float(cost[j]),
                                     dict(zip(_TERMS, (float(t[j]) for t in terms[1:]))))
                           for j in top]
        return self._items

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        return self._build()[i]

    def __len__(self) -> int:
        return min(self._limit, len(self._ids))


class _Slots:
    """Per-instance state as the rows of one matrix (field x slot), which the compiled scoring
    (`tokenpilot.score_kernel`) reads by slot for every candidate in one loop.

    Besides the state proper it keeps derived rows (speeds times learned factors, context
    per stream) that change only when an instance's state does: `refresh` recomputes them
    with the very expressions the score used to evaluate per decision, so scores are
    bit-for-bit what they were, at a few vector operations less per decision.
    """

    # The rows, with what each holds: `tokenpilot.score_kernel` (the scoring reads them there).
    TOKEN_S, ATTN_S, KV_S, OVERHEAD_S, CAPACITY_BLOCKS, BUDGET, PREFILL_FACTOR, DECODE_FACTOR = (
        sk.TOKEN_S, sk.ATTN_S, sk.KV_S, sk.OVERHEAD_S, sk.CAPACITY_BLOCKS, sk.BUDGET, sk.PREFILL_FACTOR,
        sk.DECODE_FACTOR)
    BACKLOG, BACKLOG_UNTRACKED, DUTY, DECAYED_AT, CONTEXT, STREAMS, OUT_S, HEAD_S, TPOT_FACTOR = (
        sk.BACKLOG, sk.BACKLOG_UNTRACKED, sk.DUTY, sk.DECAYED_AT, sk.CONTEXT, sk.STREAMS, sk.OUT_S, sk.HEAD_S,
        sk.TPOT_FACTOR)
    TOKEN_EFF, ATTN_EFF, KV_EFF, OVERHEAD_DF, CONTEXT_PER_STREAM = (
        sk.TOKEN_EFF, sk.ATTN_EFF, sk.KV_EFF, sk.OVERHEAD_DF, sk.CONTEXT_PER_STREAM)
    BACKLOG_TOK, UNTRACKED_TOK, OUT_TOK, HEAD_TOK, OUT_N = sk.BACKLOG_TOK, sk.UNTRACKED_TOK, sk.OUT_TOK, \
        sk.HEAD_TOK, sk.OUT_N
    FWD_TOKEN_F, FWD_OVERHEAD_F, FWD_TOKEN_EFF, FWD_ATTN_EFF, FWD_OVERHEAD = (
        sk.FWD_TOKEN_F, sk.FWD_OVERHEAD_F, sk.FWD_TOKEN_EFF, sk.FWD_ATTN_EFF, sk.FWD_OVERHEAD)
    ROWS = sk.STATE_ROWS

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.ids: list[str] = []
        self.m = np.zeros((self.ROWS, 8))
        # Slots of recently seen pools: pools repeat, and slots never move once assigned.
        self._pool_slots: dict[tuple[str, ...], np.ndarray] = {}

    def slot(self, instance_id: str) -> int | None:
        return self.index.get(instance_id)

    def add(self, instance_id: str) -> int:
        n = len(self.ids)
        self.index[instance_id] = n
        self.ids.append(instance_id)
        if n >= self.m.shape[1]:
            grown = np.zeros((self.ROWS, 2 * self.m.shape[1]))
            grown[:, :n] = self.m
            self.m = grown
        self.m[self.PREFILL_FACTOR, n] = self.m[self.DECODE_FACTOR, n] = self.m[self.TPOT_FACTOR, n] = 1.0
        self.m[self.FWD_OVERHEAD_F, n], self.m[self.FWD_TOKEN_F, n] = 1.0, np.nan  # no step fit yet
        return n

    def pool_slots(self, ids: tuple[str, ...]) -> np.ndarray | None:
        """Slots of `ids` in order (cached), or None if one of them has no slot yet."""
        k = self._pool_slots.get(ids)
        if k is None:
            index = self.index
            if not all(i in index for i in ids):
                return None
            k = np.fromiter((index[i] for i in ids), dtype=np.intp, count=len(ids))
            if len(self._pool_slots) > 1024:
                self._pool_slots.clear()
            self._pool_slots[ids] = k
        return k

    def refresh(self, k: int) -> None:
        """Recompute slot `k`'s derived rows after its prior or learned speeds changed."""
        sk.refresh(self.m, k)  # (compiled: four products and the context per stream)

    def refresh_context(self, k: int) -> None:
        """... after only its streams and context changed (every routed request)."""
        sk.refresh_context(self.m, k)


class TokenPilot(InstanceRouter):
    name = "tokenpilot"
    follows_kv_events = True  # exact cache mode: the index follows the engines' KV events

    def __init__(self, priors: Mapping[str, EnginePrior] | None = None,
                 default_prior: EnginePrior | None = None,
                 config: TokenPilotConfig | None = None,
                 index: PrefixCacheIndex | None = None, seed: int = 0,
                 latency: LearnedLatency | None = None) -> None:
        self.config = config or TokenPilotConfig()
        self.default_prior = default_prior or EnginePrior()
        self.index = index or PrefixCacheIndex()
        self._s = _Slots()
        self._learned: list[_Learned] = []
        self._inflight: dict[str, _Inflight] = {}
        # Observed over predicted time per output token, the prediction being the one the cost
        # uses (decode step stretched by prefill duty, which runs high under load): one factor
        # for the pool, since it corrects the model's shape (instances' speeds are `_learned`,
        # whose decode factor may go to 256x since i19-cap: this one keeps its ceiling 4, so that
        # a pool-wide factor, moved by every instance's outcomes, does not race each instance's
        # own to carry a slow engine's speed; let go to 64, it ran to 52-64 in overloaded mixed-fleet
        # runs where 4 held it, the goodput the same, bench/ROUTING.md "i19-cap").
        self._tpot = SpeedFactor(hi=4.0)
        self._outstanding = Outstanding()  # streamed requests sent and not through their prefill
        self._outstanding_tok = Outstanding()  # ... the same, in uncached prompt tokens
        self.latency = latency or LearnedLatency()  # residual over the prior; fitted when the caller says
        self._rng = random.Random(seed)
        self._mean_output = 256.0  # learned from outcomes (EWMA)
        self._mean_compute = 0.5  # prefill compute per routed request, seconds (EWMA)
        self.decisions: deque[tuple[str, RouteDecision]] = deque(maxlen=self.config.max_decisions_kept)
        # the last tuple of candidates, the config it was read with, its eligible ones and their ids
        self._eligible_of: tuple[tuple[InstanceSnapshot, ...], TokenPilotConfig,
                                 tuple[InstanceSnapshot, ...], tuple[str, ...]] | None = None
        self._memo: ScoreMemo[tuple[tuple[str, ...], np.ndarray, tuple[np.ndarray, ...]]] = ScoreMemo()
        for iid, prior in (priors or {}).items():
            self.register_instance(iid, prior)

    # -- fleet membership ----------------------------------------------------
    def register_instance(self, instance_id: str, prior: EnginePrior) -> None:
        self._memo.clear()
        s = self._s
        k = s.slot(instance_id)
        if k is None:
            k = s.add(instance_id)
            # Both speed factors within `SpeedFactor`'s bounds, 1/16 to 256 x the prior: an engine 4x
            # or more faster than its prior (a sim worker run faster than real time) pinned the prefill
            # factor at 1/4, a 20% over-prediction for good ("Over real vLLM on CPU"), and one 10x
            # slower (vLLM on CPU) pinned both at 4: the routing cost priced its queue and prefill 2.5x
            # fast, its decode step ~4x (bench/ROUTING.md, "i19-cap").
            self._learned.append(_Learned(SpeedFactor(), SpeedFactor(), StepFit()))
            s.m[s.TPOT_FACTOR, k] = self._tpot.value  # the pool's, learned so far
        m = s.m
        m[s.TOKEN_S, k] = prior.prefill_token_s
        m[s.ATTN_S, k] = prior.attn_s_per_token_ctx
        m[s.KV_S, k] = prior.kv_read_s_per_token
        m[s.OVERHEAD_S, k] = prior.step_overhead_s
        m[s.CAPACITY_BLOCKS, k] = prior.capacity_blocks
        m[s.BUDGET, k] = prior.max_batched_tokens
        s.refresh(k)
        self.index.set_capacity(instance_id, prior.capacity_blocks)

    def forget_instance(self, instance_id: str) -> None:
        """The instance left the fleet: its cache entries go (its learned speed stays, should it return)."""
        self._memo.clear()
        self.index.forget(instance_id)

    def _slot(self, instance_id: str) -> int:
        k = self._s.slot(instance_id)
        if k is None:
            self.register_instance(instance_id, self.default_prior)
            k = self._s.index[instance_id]
        return k

    def _pool_slots(self, ids: tuple[str, ...]) -> np.ndarray:
        """Slots of the pool's instances; unknown ones are registered with the default prior."""
        k = self._s.pool_slots(ids)
        if k is None:
            for i in ids:
                self._slot(i)
            k = self._s.pool_slots(ids)
            assert k is not None
        return k

    # -- the decision --------------------------------------------------------
    def _eligible(self, candidates: Sequence[InstanceSnapshot]) -> tuple[InstanceSnapshot, ...]:
        # The same tuple of (frozen) snapshots has the same eligible ones: the site chooser's
        # `predict` and then `route` get the one pool object (`fleetmind.site_choice.ready_pool`),
        # and while the fleet view stands still, so do the next requests. One entry, with its ids.
        kept = self._eligible_of
        if kept is not None and kept[0] is candidates and kept[1] is self.config:
            return kept[2]
        hw = self.config.kv_high_water
        below = tuple([c for c in candidates
                       if c.ready and not c.draining and c.role != "decode" and c.kv_usage < hw])
        if not below:
            # Every instance above the high-water mark: the engines will queue the request, which
            # beats refusing it; send it where KV is least full rather than nowhere.
            up = [c for c in candidates if c.ready and not c.draining and c.role != "decode"]
            below = (min(up, key=lambda c: (c.kv_usage, c.instance_id)),) if up else ()
        if type(candidates) is tuple:  # (a list may change in place under the same identity)
            self._eligible_of = (candidates, self.config, below, tuple([c.instance_id for c in below]))
        return below

    def _terms(self, profile: RequestProfile, pool: Sequence[InstanceSnapshot],
               now: float) -> tuple[tuple[str, ...], np.ndarray, tuple[np.ndarray, ...]]:
        """(pool ids, their slots, the score terms): the prefix match runs before unknown
        instances are registered, as it always has, so index bits are handed out in the same order."""
        kept = self._eligible_of
        ids = kept[3] if kept is not None and kept[2] is pool else tuple([c.instance_id for c in pool])
        kept = self._memo.get(profile, ids, pool, now)  # the site chooser scored this pool already
        if kept is not None:
            return kept
        matched = self.index.match_blocks(profile.block_hashes, ids)
        k = self._pool_slots(ids)
        terms = ids, k, self._score(profile, pool, k, matched, now)
        self._memo.put(profile, ids, pool, now, terms)
        return terms

    def predict(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot],
                now: float) -> tuple[float, int] | None:
        """(predicted TTFT s, cached tokens) of the best instance among `candidates`, without
        routing there: how the site chooser compares whole sites. None if none is eligible."""
        pool = self._eligible(candidates)
        if not pool:
            return None
        _, _, terms = self._terms(profile, pool, now)
        best = int(terms[0].argmin())  # (the method: no dispatch through np.argmin's wrapper)
        return float(terms[1][best]), int(terms[6][best])

    def prefix_match(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot],
                     now: float) -> list[int] | None:
        """Prefix blocks of the prompt the cache index holds per candidate, without routing:
        what a replica's pool share weighs (`fleetcore.replica_spread`). The match the decision
        itself makes, so it applies the deferred index update the decision would apply first."""
        ids = tuple([c.instance_id for c in candidates])
        return [int(x) for x in self.index.match_blocks(profile.block_hashes, ids)]

    def route(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot],
              now: float) -> RouteDecision:
        cfg = self.config
        pool = self._eligible(candidates)
        if not pool:
            why = "no candidate instance" if not candidates else \
                f"all {len(candidates)} candidate(s) unready or draining"
            return RouteDecision(None, why)
        ids, slots, terms = self._terms(profile, pool, now)
        cost = terms[0]
        best = int(cost.argmin())  # pool order is instance-id order: ties go to the smallest id
        chosen, reason = best, "lowest predicted cost"
        if cfg.explore > 0 and len(pool) > 1 and self._rng.random() < cfg.explore:
            near = [k for k in np.flatnonzero(cost <= cost[best] * cfg.explore_slack + 0.01) if k != best]
            if near:
                chosen, reason = int(self._rng.choice(near)), "exploration (near-best)"
        # The decision's TTFT is the one its site was chosen by (`predict`), one path: `terms[1]`.
        ttft, cached = float(terms[1][chosen]), int(terms[6][chosen])
        self._commit_at(profile, ids, slots, terms, chosen, now)
        decision = RouteDecision(ids[chosen], reason, self._explain(ids, terms), predicted_ttft_s=ttft,
                                 cached_tokens=cached)
        self.decisions.append((profile.request_id, decision))  # (bounded: the oldest falls out)
        return decision

    def _score(self, profile: RequestProfile, pool: Sequence[InstanceSnapshot], k: np.ndarray,
               matched_blocks: np.ndarray, now: float) -> tuple[np.ndarray, ...]:
        """(cost, ttft, queue, prefill, interference, kv pressure, cached tokens, own decode,
        prefill compute, tpot, prior ttft, prior tpot, forward ttft, tokens ahead, features) per
        candidate, and the matrix whose rows most of them are (`_terms_of`).

        The arithmetic per candidate is `tokenpilot.score_kernel.score` (compiled: a decision's
        cost used to be the count of numpy calls here, ~100 of them at 0.3-1 us each); this
        method feeds it, takes numpy's exp and log between its steps (see that module's doc for
        why the results are bit-for-bit those of the numpy expressions it replaced), and applies
        what stays numpy's: the KV pressure (`_kv_cost`, shared with the P/D decision) and the
        learned residual (`LatencyModel.correct`).
        """
        cfg = self.config
        s = self._s
        n = len(pool)
        p = np.array((profile.prompt_tokens, profile.block_size, now, self._duty_window(), self._remaining_tokens(),
                      cfg.tpot_slo_s, cfg.max_duty, cfg.interference_weight, cfg.locality_weight, cfg.decode_weight,
                      cfg.decode_slo_weight, 0.0, 0.0), dtype=np.float64)  # (sk.P_*: the last two are answers)
        # the snapshots' fields, read once each
        # (one array, three C-contiguous rows: each value converted as np.fromiter converts it)
        running, waiting, kv_usage = np.array([c.num_running for c in pool] + [c.num_waiting for c in pool]
                                              + [c.kv_usage for c in pool], dtype=float).reshape(3, n)
        if matched_blocks.dtype != np.float64 or not matched_blocks.flags.c_contiguous:
            matched_blocks = np.ascontiguousarray(matched_blocks, dtype=np.float64)
        o = np.empty((sk.OUT_ROWS, n))
        sk.prep(s.m, k, p, o)
        np.exp(o[sk.O_DECAY], out=o[sk.O_DECAY])  # the duty's decay over the time elapsed
        sk.score(s.m, k, running, waiting, kv_usage, matched_blocks, p, o)
        features = o[sk.O_FEATURES:]
        np.log(features[sk.F_LOG - sk.O_FEATURES], out=features[sk.F_LOG - sk.O_FEATURES])
        own_step = o[sk.O_OWN_STEP]
        kv_cost = self._kv_cost(profile, kv_usage, o[sk.O_CAPACITY], o[sk.O_PREFILL],
                                float(p[sk.P_KV_MAX]), float(p[sk.P_CAPACITY_MIN]))
        if kv_cost is not None:
            o[sk.O_KV] = kv_cost
        # The decision's TTFT (`terms[1]`: what it reports, what `predict` gives the site chooser,
        # what the P/D decision weighs): the forward TTFT, at the instance's fitted step costs where
        # a `StepFit` is in; where none is, the learned residual over it (`tokenpilot.latency_model`:
        # zero until the caller has fitted it on enough outcomes). Over a fitted forward TTFT the
        # residual made it worse (simulator 3% / 42% -> 7% / 66% median / P90, bench/ROUTING.md "i19-pred").
        lat = self.latency
        ttft_pred = lat.correct(lat.ttft, o[sk.O_FORWARD], features)
        if lat.ttft is not None:
            ttft_pred = np.where(o[sk.O_FITTED] != 0.0, o[sk.O_FORWARD], ttft_pred)
        if cfg.learned_cost:  # off by default: ranking by it lost goodput (bench/ROUTING.md)
            tpot_pred = lat.correct(lat.tpot, own_step, features)
            sk.finish(o, _f64(ttft_pred), _f64(tpot_pred), o[sk.O_KV], 0.0 if kv_cost is None else 1.0, p)
            return _Terms(o, ttft_pred, tpot_pred)  # type: ignore[return-value]  (`_terms_of`'s, made when read)
        if kv_cost is not None:  # (`score` made the cost without it)
            sk.finish(o, o[sk.O_TTFT], own_step, o[sk.O_KV], 1.0, p)
        if lat.tpot is None:
            return _Terms(o, ttft_pred, own_step)  # type: ignore[return-value]  (what `correct` returns unfitted)
        # The learned TPOT ranks nothing here; only an explanation reads it: corrected when read,
        # with the fit and bound of now (`finish` wrote neither its prior nor the features).
        return _Terms(o, ttft_pred, None, (lat.tpot, lat.log_bound()))  # type: ignore[return-value]

    def _kv_cost(self, profile: RequestProfile, kv_usage: np.ndarray, capacity: np.ndarray,
                 prefill: np.ndarray, kv_usage_max: float, capacity_min: float) -> np.ndarray | None:
        """KV pressure per candidate (`kv_usage`: theirs now), or None where no candidate
        would pass the soft mark.

        The whole request holds KV once running (cached blocks become referenced too), and
        streams grow as they decode; past the soft mark it risks evicting hot prefixes,
        past full it will be preempted and recomputed (its TTFT doubles).
        """
        cfg = self.config
        demand = profile.prompt_tokens + self._mean_output
        # Most decisions see no pressure anywhere: rule that out from two maxima first. The
        # bound is >= every candidate's new usage in floating point too (rounding is monotonic:
        # a smaller capacity gives a larger need, and x <= X, y <= Y give fl(x + y) <= fl(X + Y)).
        # (`kv_usage_max`, `capacity_min`: those of the arrays, taken by the scoring loop as it reads them)
        if kv_usage_max + demand / (profile.block_size * capacity_min) <= cfg.kv_soft_mark:
            return None
        need = demand / (profile.block_size * capacity)
        new_usage = kv_usage + need
        if not new_usage.max() > cfg.kv_soft_mark:  # (written so that NaN still takes the full path)
            return None
        return self._pressure(new_usage, prefill)

    def _pressure(self, new_usage: np.ndarray, seconds: np.ndarray) -> np.ndarray:
        """KV pressure at `new_usage` (shares of capacity), in `seconds` of recompute or wait:
        past the soft mark it risks evicting hot prefixes, past full it is preempted."""
        cfg = self.config
        return seconds * (cfg.kv_pressure_weight * np.maximum(0.0, new_usage - cfg.kv_soft_mark)
                          / (1 - cfg.kv_soft_mark) + cfg.kv_overflow_weight * np.maximum(0.0, new_usage - 1.0))

    def _duty_window(self) -> float:
        cfg = self.config
        return min(cfg.duty_max_s, max(cfg.duty_min_s, cfg.duty_span * self._mean_compute))

    def _remaining_tokens(self) -> float:
        """Tokens a running stream still has to produce, on average (half a mean answer)."""
        return max(16.0, self._mean_output / 2)

    def _explain(self, ids: Sequence[str], terms: tuple[np.ndarray, ...]) -> _Explained:
        return _Explained(ids, terms, self.config.max_candidates_explained)

    def _commit_at(self, profile: RequestProfile, ids: Sequence[str], slots: np.ndarray,
                   terms: tuple[np.ndarray, ...], j: int, now: float) -> None:
        """Book the request on candidate `j` of a scored pool (`route`'s pick, or another replica's)."""
        o = terms[_MATRIX]
        col = o[:, j].tolist()  # (its terms as Python floats, in one call)
        k = int(slots[j])
        self._commit(profile, k, ids[j], col[sk.O_TTFT], col[sk.O_QUEUE], col[sk.O_PREFILL],
                     col[sk.O_COMPUTE], col[sk.O_OWN_STEP], o[sk.O_FEATURES:, j].copy(), now, col[sk.O_FORWARD],
                     profile.prompt_tokens - col[sk.O_CACHED], self._forward_parts(k, profile.prompt_tokens, col))

    def _forward_parts(self, k: int, prompt: float, col: list[float]) -> tuple[float, float, float, float, float]:
        """The chosen candidate's forward TTFT split for its `StepFit` (`forward_parts`, with
        the scoring's own inputs, read back from its result column `col`), and that TTFT."""
        m, f = self._s.m, sk.O_FEATURES
        token_f = float(m[sk.FWD_TOKEN_F, k])
        if token_f != token_f:
            token_f = float(m[sk.PREFILL_FACTOR, k])
        cached = col[sk.O_CACHED]
        return (*forward_parts(col[sk.O_AHEAD], prompt - cached, cached, col[f + 10], col[f + 4] * 1e6,
                               float(m[sk.BUDGET, k]), float(m[sk.TOKEN_S, k]), float(m[sk.ATTN_S, k]),
                               float(m[sk.KV_EFF, k]), float(m[sk.OVERHEAD_S, k]), token_f,
                               float(m[sk.FWD_OVERHEAD_F, k])), col[sk.O_FORWARD])

    def _commit(self, profile: RequestProfile, k: int, instance_id: str, ttft: float,
                queue_s: float, prefill_s: float, compute_s: float, tpot_s: float, features: np.ndarray,
                now: float, forward_s: float, uncached: float,
                forward_parts: tuple[float, float, float, float, float] | None = None) -> None:
        """Book a routed request (`ttft`, `tpot_s`: the physics predictions, before the learned residual;
        `forward_s`: the scheduler-forward TTFT; `uncached`: the prompt tokens it prefills there)."""
        self._memo.clear()
        s = self._s
        rid = profile.request_id
        if rid in self._inflight:  # routed again (a retry elsewhere): the earlier attempt is over
            self._release(self._inflight.pop(rid), rid, now)
        sk.book(s.m, k, prefill_s, uncached, compute_s / self._duty_window(), profile.prompt_tokens,
                *self._first_token_tracked(k, profile, prefill_s, uncached))
        self._mean_compute += 0.02 * (compute_s - self._mean_compute)
        self.index.record_route_later(instance_id, profile.block_hashes, now)  # applied after dispatch
        self._inflight[rid] = _Inflight(k, profile.prompt_tokens, ttft, queue_s, tpot_s, features, forward_s,
                                        profile.held_s(now), forward_parts=forward_parts)

    def _first_token_tracked(self, k: int, profile: RequestProfile, prefill_s: float,
                             uncached: float) -> tuple[float, float, float, float, float, float]:
        """The outstanding-prefill arguments of a booking on slot `k` (`sk.book_prefill`'s
        `streamed, out_s, head_s, out_tok, head_tok, out_n`): a streamed request's first token will
        say when this prefill is through, so it joins the slot's outstanding set; any other drains
        by the clock alone (all zero)."""
        if not profile.stream:
            return 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
        rid = profile.request_id
        out_s, head_s = self._outstanding.add(k, rid, prefill_s)
        out_tok, head_tok = self._outstanding_tok.add(k, rid, uncached)
        return 1.0, out_s, head_s, out_tok, head_tok, float(self._outstanding.count(k))

    def _settle(self, k: int, now: float) -> None:
        """Decay slot `k`'s backlog and duty to `now` (as a decision would), then reconcile its backlog."""
        m = self._s.m
        elapsed = max(0.0, now - float(m[sk.DECAYED_AT, k]))
        # (numpy's exp, as the scoring takes it; the rest compiled: `score_kernel.settle`)
        sk.settle(m, k, now, elapsed, float(np.exp(elapsed / -self._duty_window())))

    def _through(self, k: int, request_id: str, now: float) -> None:
        """The request's prefill is through (first token), or it ended: it leaves the outstanding set."""
        totals = self._outstanding.remove(k, request_id)
        if totals is not None:
            self._memo.clear()
            s, m = self._s, self._s.m
            m[s.OUT_S, k], m[s.HEAD_S, k] = totals
            m[s.OUT_TOK, k], m[s.HEAD_TOK, k] = self._outstanding_tok.remove(k, request_id) or (0.0, 0.0)
            m[s.OUT_N, k] = self._outstanding.count(k)
            self._settle(k, now)

    def _release(self, rec: _Inflight, request_id: str, now: float) -> None:
        s, m, k = self._s, self._s.m, rec.slot
        m[s.STREAMS, k] = max(0.0, m[s.STREAMS, k] - 1)
        m[s.CONTEXT, k] = max(0.0, m[s.CONTEXT, k] - rec.prompt_tokens)
        self._through(k, request_id, now)

    def on_first_token(self, request_id: str, now: float) -> None:
        """A routed request's first token: its prefill, and every one ahead of it, is done."""
        rec = self._inflight.get(request_id)
        if rec is not None:
            self._through(rec.slot, request_id, now)

    # -- the learned latency model: fitted when the caller says ---------------------
    def refit_due(self) -> bool:
        return self.latency.refit_due()

    def refit(self) -> bool:
        """Fit the learned latency model on the outcomes seen (scikit-learn; off the decision path)."""
        self._memo.clear()
        return self.latency.refit()

    def prepare_refit(self) -> None:
        self.latency.prepare()

    # -- feedback --------------------------------------------------------------
    def observe(self, outcome: RequestOutcome) -> None:
        rec = self._inflight.pop(outcome.request_id, None)
        if rec is None:
            return
        self._memo.clear()
        s, k = self._s, rec.slot
        # (no clock in an outcome: a request ending without a first token settles at the last decision's time)
        self._release(rec, outcome.request_id, float(s.m[s.DECAYED_AT, k]))
        if outcome.ok and not outcome.cancelled:
            # The engine's TTFT: from the dispatch on (time held before it, by admission, is no GPU's
            # speed), less the network round trip to the site (on the 3-site simulated fleet the step
            # fit took a remote site's 62-75 ms for an engine step's fixed cost, its bound 4x, on nearly
            # every instance there, so the site chooser counted that round trip twice).
            ttft = _after_dispatch(outcome.ttft_s, rec.held_s + outcome.network_s)
            if rec.predicted_queue_s != _SPLIT:  # a split P/D request's TTFT is no one instance's
                self.latency.record(rec.features, rec.forward_ttft_s, rec.predicted_tpot_s, ttft,
                                    outcome.mean_tpot_s if outcome.output_tokens > 1 else None)
            self._learn(k, rec, outcome, ttft)
            s.refresh(k)
        else:
            s.refresh_context(k)

    def _learn(self, k: int, rec: _Inflight, outcome: RequestOutcome, ttft: float | None) -> None:
        """Update slot `k`'s learned speeds from one outcome (`ttft`: its engine TTFT, `observe`'s)."""
        s, m = self._s, self._s.m
        if outcome.output_tokens > 0:
            self._mean_output += 0.02 * (outcome.output_tokens - self._mean_output)
        learned = self._learned[k]
        # Learn prefill speed only from requests predicted to start at once: otherwise an error
        # in the queue model would be taken for a slow (or fast) GPU and feed back on itself.
        if ttft is not None and rec.predicted_queue_s <= 0.1 * rec.predicted_ttft_s:
            learned.prefill.update(ttft, rec.predicted_ttft_s)
            m[s.PREFILL_FACTOR, k] = learned.prefill.value
        # The forward TTFT's step costs, from every outcome (its queue is in tokens, of the same
        # steps): the decision's TTFT and the token backlog's drain read them; the prefill factor and
        # the instance cost (the physics' seconds) do not.
        if ttft is not None and rec.forward_parts is not None:
            a, b, c, steps, predicted = rec.forward_parts
            learned.step.update(a, b, c, ttft, predicted, steps)
            fit = learned.step.fit(1.0, float(m[s.PREFILL_FACTOR, k]))
            if fit is not None:
                m[s.FWD_OVERHEAD_F, k], m[s.FWD_TOKEN_F, k], m[sk.FWD_STEP_S, k] = fit
        if outcome.mean_tpot_s is not None and outcome.output_tokens > 1:
            predicted = (m[s.OVERHEAD_S, k] + m[s.CONTEXT, k] * m[s.KV_S, k]) * learned.decode.value
            learned.decode.update(outcome.mean_tpot_s, max(float(predicted), 1e-4))
            m[s.DECODE_FACTOR, k] = learned.decode.value
            self._tpot.update(outcome.mean_tpot_s, max(rec.predicted_tpot_s, 1e-4))
            m[s.TPOT_FACTOR, : len(s.ids)] = self._tpot.value

    def note_dispatch(self, profile: RequestProfile, instance: InstanceSnapshot, now: float) -> None:
        """Another replica's dispatch: booked exactly as `route` books its own pick (backlog,
        outstanding prefill, duty, streams and context, the prefix it will cache), priced by this
        replica's model with the instance as the only candidate; no decision is logged."""
        ids, slots, terms = self._terms(profile, [instance], now)
        self._commit_at(profile, ids, slots, terms, 0, now)

    def note_release(self, request_id: str, now: float) -> None:
        """Another replica's dispatch ended: released as `observe` releases one, learning nothing."""
        rec = self._inflight.pop(request_id, None)
        if rec is None:
            return
        self._memo.clear()
        self._release(rec, request_id, now)
        self._s.refresh_context(rec.slot)

    def note_route(self, instance_id: str, block_hashes: Sequence[int], now: float) -> None:
        if self._s.slot(instance_id) is not None:  # a known instance (exact ones keep following their events)
            self._memo.clear()
            self.index.record_route(instance_id, block_hashes, now)

    def observe_kv_events(self, instance_id: str, seq: int, events: Sequence[Mapping[str, object]],
                          now: float) -> None:
        """Engine KV events: the cache index follows them exactly (see `PrefixCacheIndex`)."""
        self._memo.clear()
        self.index.apply_events(instance_id, seq, events, now)

    def cache_blocks(self, instance_id: str) -> int | None:
        return self.index.entries(instance_id)

    def cache_exact(self, instance_id: str, now: float) -> bool:
        return self.index.is_exact(instance_id, now)

    def forward_factors(self, instance_id: str) -> tuple[float, float | None]:
        """The forward TTFT's learned step factors on one instance: (fixed cost, per token; None
        while no fit is in and the prefill factor stands in), x the prior's."""
        m, k = self._s.m, self._slot(instance_id)
        token_f = float(m[sk.FWD_TOKEN_F, k])
        return float(m[sk.FWD_OVERHEAD_F, k]), None if token_f != token_f else token_f

    def explain(self, instance_id: str) -> dict[str, float]:
        """What TokenPilot has learned about one instance (for debug endpoints and tests)."""
        s, k = self._s, self._slot(instance_id)
        m = s.m
        return {"prefill_speed_factor": float(m[s.PREFILL_FACTOR, k]),
                "decode_speed_factor": float(m[s.DECODE_FACTOR, k]),
                "tpot_factor": float(m[s.TPOT_FACTOR, k]),
                "backlog_s": float(m[s.BACKLOG, k]), "streams": float(m[s.STREAMS, k]),
                "outstanding_prefill_s": float(m[s.OUT_S, k]), "outstanding": float(self._outstanding.count(k)),
                "index_entries": float(self.index.entries(instance_id))}

    # -- hook for the prefill/decode decision (tokenpilot.disagg; issue 17) ----------------
    # The P/D decision prices options with this cost model rather than a second one: `price`
    # is `route`'s scoring without the pick, `book` its commit, split when prefill and decode
    # run on different instances.

    def price(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot], now: float,
              arrives_prefilled: bool = False) -> Priced:
        """Every candidate's terms (as `route` scores them) without routing there. No role
        filter: the caller chose the pool. Draining or unready candidates are left out, and
        those above the KV high-water mark unless that leaves none. `arrives_prefilled`: the
        request's KV is computed elsewhere and arrives whole, so no prefill happens here (its
        decode and KV terms are those of a stream that only decodes)."""
        up = [c for c in candidates if c.ready and not c.draining]
        pool = [c for c in up if c.kv_usage < self.config.kv_high_water] or up
        if not pool:
            return Priced((), (), ())
        if not arrives_prefilled:
            ids, _, terms = self._terms(profile, pool, now)
            return Priced(ids, tuple(pool), terms)
        ids = tuple([c.instance_id for c in pool])
        whole = np.full(len(pool), -(-profile.prompt_tokens // max(profile.block_size, 1)), dtype=float)
        return Priced(ids, tuple(pool), self._score(profile, pool, self._pool_slots(ids), whole, now))

    def prefill_compute_s(self, instance_id: str, uncached: float, cached: float) -> float:
        """The bare compute of prefilling `uncached` tokens after `cached` ones on this instance
        (linear layers per token + attention over the context so far: the `compute` term of
        `score_kernel.score`, at its learned speed), for an instance that runs nothing else.
        Read-only."""
        s = self._s
        k = self._slot(instance_id)
        return float(uncached * s.m[s.TOKEN_EFF, k] + s.m[s.ATTN_EFF, k] * uncached * (cached + uncached / 2))

    def committed_kv(self, profile: RequestProfile, priced: Priced) -> np.ndarray:
        """Each candidate's KV in use or promised, as a share of its capacity: the larger of what
        its engine reports and what was sent there and has not ended (prompts, plus the half of a
        mean answer each has still to grow). A split request's blocks are reserved on its decode
        instance only once its prefill is done elsewhere, so the engine's own figure misses every
        request still prefilling for it (the P/D decision's decode-side KV, `tokenpilot.disagg`)."""
        s = self._s
        k = self._pool_slots(priced.ids)
        booked = s.m[s.CONTEXT].take(k) + s.m[s.STREAMS].take(k) * self._remaining_tokens()
        capacity = np.maximum(s.m[s.CAPACITY_BLOCKS].take(k) * max(profile.block_size, 1), 1.0)
        usage = np.fromiter([c.kv_usage for c in priced.pool], dtype=float, count=len(priced.pool))
        return np.maximum(usage, booked / capacity)

    def kv_pressure_of(self, profile: RequestProfile, priced: Priced, usage: np.ndarray,
                       recompute_s: np.ndarray) -> np.ndarray:
        """The KV pressure term of `_kv_cost` for a request of this profile added at `usage`
        (shares of capacity), priced in `recompute_s` seconds: what losing its KV (a preemption)
        or waiting for room would cost it."""
        s = self._s
        capacity = s.m[s.CAPACITY_BLOCKS].take(self._pool_slots(priced.ids))
        new_usage = usage + (profile.prompt_tokens + self._mean_output) / (profile.block_size * capacity)
        return self._pressure(new_usage, recompute_s)

    def book(self, profile: RequestProfile, priced: Priced, prefill_on: str, decode_on: str, now: float,
             predicted_ttft_s: float) -> None:
        """Account a request placed by the P/D decision: all of it on one instance as `route`
        would, or its prefill (backlog, duty, the prefix it caches) on `prefill_on` and its
        stream (context, the prefix that arrives with the KV) on `decode_on`."""
        j = priced.index(prefill_on)
        tpot, features = float(priced.terms[11][j]), priced.terms[_FEATURES][:, j].copy()
        uncached = float(profile.prompt_tokens - priced.cached[j])
        if prefill_on == decode_on:
            self._commit(profile, self._slot(prefill_on), prefill_on, float(priced.terms[10][j]),
                         float(priced.queue[j]), float(priced.prefill[j]), float(priced.compute[j]), tpot,
                         features, now, float(priced.terms[_FWD][j]), uncached)
            return
        self._memo.clear()
        s, m = self._s, self._s.m
        kp, kd = self._slot(prefill_on), self._slot(decode_on)
        compute = float(priced.compute[j])
        prefill = float(priced.prefill[j])
        # The first token leaves the decode instance, so it cannot bound the prefill side's
        # backlog: that prefill drains by the clock alone (as a non-streamed request's does).
        duty = compute / self._duty_window()
        sk.book_prefill(m, kp, prefill, uncached, duty, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        self._mean_compute += 0.02 * (compute - self._mean_compute)
        m[s.CONTEXT, kd] += profile.prompt_tokens
        m[s.STREAMS, kd] += 1
        s.refresh_context(kd)
        self.index.record_route(prefill_on, profile.block_hashes, now)
        self.index.record_route(decode_on, profile.block_hashes, now)
        # Its TTFT spans two instances and a link: not evidence of either one's prefill speed.
        self._inflight[profile.request_id] = _Inflight(kd, profile.prompt_tokens, predicted_ttft_s, _SPLIT,
                                                       tpot, features, predicted_ttft_s, profile.held_s(now),
                                                       (kp, prefill, uncached, duty, now))

    def prefill_withdrawn(self, profile: RequestProfile, priced: Priced, now: float) -> None:
        """A split request's prefill leg was withdrawn before it started and the request now
        prefills whole on its decode instance (`fleetsim.disagg.PDRuntime._replace_queued`, when
        its prefill instance leaves the role): the prefill booked on the prefill instance leaves
        its backlog and duty, and the decode instance (`priced`: that one candidate, priced for
        this request) gets it as `route` books a local prefill there (backlog, outstanding
        prefill, duty). The stream's context stays where `book` put it. Without this the ex-prefill
        instance priced a queue it no longer had until the clock drained it, and the decode
        instance's own queue missed the prefill (bench/DISAGG.md "Agent loops x14")."""
        rid = profile.request_id
        rec = self._inflight.get(rid)
        if rec is None or rec.split_prefill is None:
            return
        self._memo.clear()
        s, m = self._s, self._s.m
        kp, prefill, uncached, duty, at = rec.split_prefill
        rec.split_prefill = None
        self._settle(kp, now)
        # It had not started: all of it was still ahead of the clock that drained the queue in
        # front of it. The duty decays by the window since it was added.
        for row, x in ((s.BACKLOG, prefill), (s.BACKLOG_UNTRACKED, prefill), (s.BACKLOG_TOK, uncached),
                       (s.UNTRACKED_TOK, uncached)):
            m[row, kp] = max(0.0, m[row, kp] - x)
        m[s.DUTY, kp] = max(0.0, m[s.DUTY, kp] - duty * float(np.exp((at - now) / self._duty_window())))
        kd = rec.slot
        j = priced.index(self._s.ids[kd])
        prefill_d, compute_d = float(priced.prefill[j]), float(priced.compute[j])
        uncached_d = float(profile.prompt_tokens - priced.cached[j])
        # its first token now comes from this prefill, on the decode instance
        sk.book_prefill(m, kd, prefill_d, uncached_d, compute_d / self._duty_window(),
                        *self._first_token_tracked(kd, profile, prefill_d, uncached_d))


@dataclass(frozen=True, slots=True)
class Priced:
    """`TokenPilot.price`'s answer: candidate ids, their snapshots, and the score terms
    (cost, ttft, queue, prefill, interference, kv pressure, cached tokens, own decode,
    prefill compute), one array each in candidate order."""

    ids: tuple[str, ...]
    pool: tuple[InstanceSnapshot, ...]
    terms: tuple[np.ndarray, ...]

    def index(self, instance_id: str) -> int:
        return self.ids.index(instance_id)

    @property
    def cost(self) -> np.ndarray:
        return self.terms[0]

    @property
    def ttft(self) -> np.ndarray:
        return self.terms[1]

    @property
    def queue(self) -> np.ndarray:
        return self.terms[2]

    @property
    def prefill(self) -> np.ndarray:
        return self.terms[3]

    @property
    def interference(self) -> np.ndarray:
        return self.terms[4]

    @property
    def kv_pressure(self) -> np.ndarray:
        return self.terms[5]

    @property
    def cached(self) -> np.ndarray:
        return self.terms[6]

    @property
    def decode(self) -> np.ndarray:
        return self.terms[7]

    @property
    def compute(self) -> np.ndarray:
        return self.terms[8]



def _after_dispatch(ttft_s: float | None, held_s: float) -> float | None:
    """An observed TTFT (from arrival) from the dispatch on, less `held_s` (the admission hold and
    the network round trip): the engine's time, what the router's predictions are of."""
    return None if ttft_s is None else max(ttft_s - held_s, 1e-6)


def _f64(x: np.ndarray) -> np.ndarray:
    """`x` as the compiled scoring takes it: contiguous float64 (a copy only where it is not)."""
    return x if x.dtype == np.float64 and x.flags.c_contiguous else np.ascontiguousarray(x, dtype=np.float64)
