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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fleetcore.types import Candidate, InstanceSnapshot, RequestOutcome, RequestProfile, RouteDecision
from tokenpilot.cache_index import PrefixCacheIndex
from tokenpilot.learning import SpeedFactor
from tokenpilot.priors import EnginePrior


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


@dataclass(slots=True)
class _Inflight:
    slot: int
    prompt_tokens: int
    predicted_ttft_s: float
    predicted_queue_s: float


@dataclass(slots=True)
class _Learned:
    prefill: SpeedFactor
    decode: SpeedFactor


_TERMS = ("predicted_ttft_s", "queue_s", "prefill_s", "interference_s", "kv_pressure_s", "cached_tokens",
          "decode_s", "prefill_compute_s")


class _Explained(Sequence[Candidate]):
    """The best few candidates of a decision, built only when someone reads them
    (the debug endpoint), so explanations cost nothing on the hot path."""

    def __init__(self, ids: Sequence[str], terms: tuple[np.ndarray, ...], limit: int) -> None:
        self._ids, self._terms, self._limit = ids, terms, limit
        self._items: list[Candidate] | None = None

    def _build(self) -> list[Candidate]:
        if self._items is None:
            cost = self._terms[0]
            top = np.argsort(cost, kind="stable")[: self._limit]
            self._items = [Candidate(self._ids[j], float(cost[j]),
                                     dict(zip(_TERMS, (float(t[j]) for t in self._terms[1:]))))
                           for j in top]
        return self._items

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        return self._build()[i]

    def __len__(self) -> int:
        return min(self._limit, len(self._ids))


class _Slots:
    """Per-instance state as numpy columns, so one decision scores every candidate at once."""

    FIELDS = ("token_s", "attn_s", "kv_s", "overhead_s", "capacity_blocks", "budget", "prefill_factor",
              "decode_factor", "backlog", "backlog_at", "context", "streams", "duty", "duty_at")

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.ids: list[str] = []
        self.cols = {f: np.zeros(0) for f in self.FIELDS}

    def slot(self, instance_id: str) -> int | None:
        return self.index.get(instance_id)

    def add(self, instance_id: str) -> int:
        n = len(self.ids)
        self.index[instance_id] = n
        self.ids.append(instance_id)
        for f, col in self.cols.items():
            if n >= len(col):
                grown = np.zeros(max(8, 2 * len(col)))
                grown[: len(col)] = col
                self.cols[f] = grown
        self.cols["prefill_factor"][n] = self.cols["decode_factor"][n] = 1.0
        return n

    def __getattr__(self, name: str) -> np.ndarray:
        try:
            return self.__dict__["cols"][name]
        except KeyError:
            raise AttributeError(name) from None


class TokenPilot:
    name = "tokenpilot"

    def __init__(self, priors: Mapping[str, EnginePrior] | None = None,
                 default_prior: EnginePrior | None = None,
                 config: TokenPilotConfig | None = None,
                 index: PrefixCacheIndex | None = None, seed: int = 0) -> None:
        self.config = config or TokenPilotConfig()
        self.default_prior = default_prior or EnginePrior()
        self.index = index or PrefixCacheIndex()
        self._s = _Slots()
        self._learned: list[_Learned] = []
        self._inflight: dict[str, _Inflight] = {}
        self._rng = random.Random(seed)
        self._mean_output = 256.0  # learned from outcomes (EWMA)
        self._mean_compute = 0.5  # prefill compute per routed request, seconds (EWMA)
        self.decisions: list[tuple[str, RouteDecision]] = []
        for iid, prior in (priors or {}).items():
            self.register_instance(iid, prior)

    # -- fleet membership ----------------------------------------------------
    def register_instance(self, instance_id: str, prior: EnginePrior) -> None:
        k = self._s.slot(instance_id)
        if k is None:
            k = self._s.add(instance_id)
            self._learned.append(_Learned(SpeedFactor(), SpeedFactor()))
        s = self._s
        s.token_s[k] = prior.prefill_token_s
        s.attn_s[k] = prior.attn_s_per_token_ctx
        s.kv_s[k] = prior.kv_read_s_per_token
        s.overhead_s[k] = prior.step_overhead_s
        s.capacity_blocks[k] = prior.capacity_blocks
        s.budget[k] = prior.max_batched_tokens
        self.index.set_capacity(instance_id, prior.capacity_blocks)

    def forget_instance(self, instance_id: str) -> None:
        """The instance left the fleet: its cache entries go (its learned speed stays, should it return)."""
        self.index.forget(instance_id)

    def _slot(self, instance_id: str) -> int:
        k = self._s.slot(instance_id)
        if k is None:
            self.register_instance(instance_id, self.default_prior)
            k = self._s.index[instance_id]
        return k

    # -- the decision --------------------------------------------------------
    def _eligible(self, candidates: Sequence[InstanceSnapshot]) -> list[InstanceSnapshot]:
        hw = self.config.kv_high_water
        up = [c for c in candidates if c.ready and not c.draining and c.role != "decode"]
        below = [c for c in up if c.kv_usage < hw]
        # Every instance above the high-water mark: the engines will queue the request, which
        # beats refusing it; send it where KV is least full rather than nowhere.
        return below or ([min(up, key=lambda c: (c.kv_usage, c.instance_id))] if up else [])

    def _terms(self, profile: RequestProfile, pool: Sequence[InstanceSnapshot],
               now: float) -> tuple[list[str], tuple[np.ndarray, ...]]:
        ids = [c.instance_id for c in pool]
        matched = self.index.match(profile.block_hashes, ids)
        return ids, self._score(profile, pool, ids, [matched[i] for i in ids], now)

    def predict(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot],
                now: float) -> tuple[float, int] | None:
        """(predicted TTFT s, cached tokens) of the best instance among `candidates`, without
        routing there: how the site chooser compares whole sites. None if none is eligible."""
        pool = self._eligible(candidates)
        if not pool:
            return None
        _, terms = self._terms(profile, pool, now)
        best = int(np.argmin(terms[0]))
        return float(terms[1][best]), int(terms[6][best])

    def route(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot],
              now: float) -> RouteDecision:
        cfg = self.config
        pool = self._eligible(candidates)
        if not pool:
            why = "no candidate instance" if not candidates else \
                f"all {len(candidates)} candidate(s) unready or draining"
            return RouteDecision(None, why)
        ids, terms = self._terms(profile, pool, now)
        cost = terms[0]
        best = int(np.argmin(cost))  # pool order is instance-id order: ties go to the smallest id
        chosen, reason = best, "lowest predicted cost"
        if cfg.explore > 0 and len(pool) > 1 and self._rng.random() < cfg.explore:
            near = [k for k in np.flatnonzero(cost <= cost[best] * cfg.explore_slack + 0.01) if k != best]
            if near:
                chosen, reason = int(self._rng.choice(near)), "exploration (near-best)"
        ttft, cached = float(terms[1][chosen]), int(terms[6][chosen])
        self._commit(profile, self._s.index[ids[chosen]], ids[chosen], cached, ttft, float(terms[2][chosen]),
                     float(terms[3][chosen]), float(terms[8][chosen]), now)
        decision = RouteDecision(ids[chosen], reason, self._explain(ids, terms), predicted_ttft_s=ttft,
                                 cached_tokens=cached)
        self.decisions.append((profile.request_id, decision))
        if len(self.decisions) > cfg.max_decisions_kept:
            del self.decisions[: len(self.decisions) - cfg.max_decisions_kept]
        return decision

    def _score(self, profile: RequestProfile, pool: Sequence[InstanceSnapshot], ids: Sequence[str],
               matched_blocks: Sequence[int], now: float) -> tuple[np.ndarray, ...]:
        """(cost, ttft, queue, prefill, interference, kv pressure, cached tokens, own decode) per candidate."""
        cfg = self.config
        s = self._s
        slot = s.index.get
        k = np.array([slot(i) if i in s.index else self._slot(i) for i in ids], dtype=np.intp)
        running, waiting, kv_usage = np.array(
            [(c.num_running, c.num_waiting, c.kv_usage) for c in pool], dtype=float).T
        prompt = profile.prompt_tokens
        cached = np.minimum(np.asarray(matched_blocks, dtype=float) * profile.block_size, max(prompt - 1, 0))
        uncached = prompt - cached
        speed = s.prefill_factor[k]
        token_s = s.token_s[k] * speed
        kv_s = s.kv_s[k] * s.decode_factor[k]
        overhead = s.overhead_s[k]
        # Context decoding alongside the prefill: what we routed there, or what the engine
        # reports running when others share it (assume our mean context per stream).
        ours = s.streams[k]
        streams = np.maximum(ours, running)
        mean_ctx = np.where(ours > 0, s.context[k] / np.maximum(ours, 1), prompt)
        context = streams * mean_ctx
        # Prefill = linear layers per token + attention over the context so far (quadratic in
        # long prompts) + every step's decode KV reads and fixed cost while it runs.
        compute = uncached * token_s + s.attn_s[k] * speed * uncached * (cached + uncached / 2)
        steps = uncached / s.budget[k]
        prefill = compute + steps * (context * kv_s + overhead) + overhead
        # Prefill work routed here and not yet done (seconds), drained by the clock.
        backlog = np.maximum(0.0, s.backlog[k] - np.maximum(0.0, now - s.backlog_at[k]))
        s.backlog[k] = backlog
        s.backlog_at[k] = np.maximum(s.backlog_at[k], now)
        per_token = compute / np.maximum(uncached, 1) + (context * kv_s + overhead) / s.budget[k]
        waiting_hint = waiting * mean_ctx * 0.5 * per_token  # engine queue we did not route ourselves
        queue = np.maximum(backlog, waiting_hint)
        ttft = queue + prefill
        # Prefill duty: the share of the instance's time that prefills routed there have been
        # taking lately (EWMA). Every prefill step stalls all decoding streams, so a stream's
        # time per token is its decode step stretched by 1 / (1 - duty).
        window = self._duty_window()
        duty = s.duty[k] * np.exp(-np.maximum(0.0, now - s.duty_at[k]) / window)
        s.duty[k] = duty
        s.duty_at[k] = np.maximum(s.duty_at[k], now)
        duty_after = np.minimum(cfg.max_duty, duty + compute / window)
        decode_step = overhead * s.decode_factor[k] + context * kv_s
        tpot_now = decode_step / (1 - np.minimum(duty, cfg.max_duty))
        # Each running stream absorbs this prefill's compute as gaps between its tokens over
        # its remaining output; only what pushes it past its TPOT budget costs goodput.
        remaining = self._remaining_tokens()
        slack = (cfg.tpot_slo_s - tpot_now) * remaining
        interference = cfg.interference_weight * streams * np.maximum(0.0, compute - np.maximum(slack, 0.0))
        # The whole request holds KV once running (cached blocks become referenced too), and
        # streams grow as they decode; past the soft mark it risks evicting hot prefixes,
        # past full it will be preempted and recomputed (its TTFT doubles).
        need = (prompt + self._mean_output) / (profile.block_size * s.capacity_blocks[k])
        new_usage = kv_usage + need
        kv_cost = prefill * (cfg.kv_pressure_weight * np.maximum(0.0, new_usage - cfg.kv_soft_mark)
                             / (1 - cfg.kv_soft_mark) + cfg.kv_overflow_weight * np.maximum(0.0, new_usage - 1.0))
        # Locality: reusing a prefix where it already lives also spares the fleet a second copy
        # of it, which keeps every instance's cache holding more distinct prefixes.
        locality = cfg.locality_weight * cached * token_s
        # Its own decode: every step there reads all streams' KV, ours included. A crowded
        # instance stretches this request's time per token (and past the TPOT budget, costs
        # its SLO); without this term, requests whose prefill is cheap everywhere would
        # all tie on TTFT and pile onto one instance.
        own_step = (decode_step + prompt * kv_s) / (1 - duty_after)
        out = 2 * remaining
        decode = out * (cfg.decode_weight * own_step
                        + cfg.decode_slo_weight * np.maximum(0.0, own_step - cfg.tpot_slo_s))
        cost = ttft + interference + kv_cost + decode - locality
        return cost, ttft, queue, prefill, interference, kv_cost, cached, decode, compute

    def _duty_window(self) -> float:
        cfg = self.config
        return min(cfg.duty_max_s, max(cfg.duty_min_s, cfg.duty_span * self._mean_compute))

    def _remaining_tokens(self) -> float:
        """Tokens a running stream still has to produce, on average (half a mean answer)."""
        return max(16.0, self._mean_output / 2)

    def _explain(self, ids: Sequence[str], terms: tuple[np.ndarray, ...]) -> _Explained:
        return _Explained(ids, terms, self.config.max_candidates_explained)

    def _commit(self, profile: RequestProfile, k: int, instance_id: str, cached: int, ttft: float,
                queue_s: float, prefill_s: float, compute_s: float, now: float) -> None:
        s = self._s
        s.backlog[k] += prefill_s
        s.duty[k] += compute_s / self._duty_window()
        self._mean_compute += 0.02 * (compute_s - self._mean_compute)
        s.context[k] += profile.prompt_tokens
        s.streams[k] += 1
        self.index.record_route(instance_id, profile.block_hashes, now)
        self._inflight[profile.request_id] = _Inflight(k, profile.prompt_tokens, ttft, queue_s)

    # -- feedback --------------------------------------------------------------
    def observe(self, outcome: RequestOutcome) -> None:
        rec = self._inflight.pop(outcome.request_id, None)
        if rec is None:
            return
        s, k = self._s, rec.slot
        s.streams[k] = max(0.0, s.streams[k] - 1)
        s.context[k] = max(0.0, s.context[k] - rec.prompt_tokens)
        if not outcome.ok or outcome.cancelled:
            return
        if outcome.output_tokens > 0:
            self._mean_output += 0.02 * (outcome.output_tokens - self._mean_output)
        learned = self._learned[k]
        # Learn prefill speed only from requests predicted to start at once: otherwise an error
        # in the queue model would be taken for a slow (or fast) GPU and feed back on itself.
        if outcome.ttft_s is not None and rec.predicted_queue_s <= 0.1 * rec.predicted_ttft_s:
            learned.prefill.update(outcome.ttft_s, rec.predicted_ttft_s)
            s.prefill_factor[k] = learned.prefill.value
        if outcome.mean_tpot_s is not None and outcome.output_tokens > 1:
            predicted = (s.overhead_s[k] + s.context[k] * s.kv_s[k]) * learned.decode.value
            learned.decode.update(outcome.mean_tpot_s, max(float(predicted), 1e-4))
            s.decode_factor[k] = learned.decode.value

    def observe_kv_events(self, instance_id: str, seq: int, events: Sequence[Mapping[str, object]],
                          now: float) -> None:
        """Engine KV events: the cache index follows them exactly (see `PrefixCacheIndex`)."""
        self.index.apply_events(instance_id, seq, events, now)

    def explain(self, instance_id: str) -> dict[str, float]:
        """What TokenPilot has learned about one instance (for debug endpoints and tests)."""
        s, k = self._s, self._slot(instance_id)
        return {"prefill_speed_factor": float(s.prefill_factor[k]),
                "decode_speed_factor": float(s.decode_factor[k]),
                "backlog_s": float(s.backlog[k]), "streams": float(s.streams[k]),
                "index_entries": float(self.index.entries(instance_id))}
