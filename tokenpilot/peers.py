"""Published routing policies we benchmark against, re-implemented as pure `InstanceRouter`s.

Each class docstring names its source (project, file/function, version) and the
rule, and says where this re-implementation approximates the original. Shared
conventions:

* Pure and clock-free: time is the `now` argument; randomness comes from a
  `random.Random(seed)` owned by the router, so a run is reproducible.
* Candidates are considered in instance-id order, so a decision does not depend
  on the order the caller listed them in.
* "In-flight" is `InstanceSnapshot.inflight`: what the gateway sent to the
  instance and has not seen finish. That is what the originals count as a
  worker's load (SGLang `Worker::load()`, AIBrix's realtime running-request
  counter) - a count the router keeps itself, not the engine's scrape.
* Cache state comes only from each router's own routing history
  (`tokenpilot.prefix_tree.PrefixIndex`), as the originals do without KV events.
  Prefix blocks are the engine's chained block hashes (`profile.block_hashes`),
  where the originals hash characters or tokens; the block is their unit here.
* `RouteDecision.candidates`: lower score is better (see each router's reason).
"""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, overload

import xxhash

from fleetcore.types import Candidate, InstanceSnapshot, RequestOutcome, RequestProfile, RouteDecision
from fleetcore.policies import InstanceRouter
from tokenpilot.policy import no_candidates
from tokenpilot.prefix_tree import ActiveBlocks, PrefixIndex

_by_id = attrgetter("instance_id")


def _pool(candidates: Sequence[InstanceSnapshot]) -> list[InstanceSnapshot]:
    return sorted(candidates, key=_by_id)


def _engine_load(i: InstanceSnapshot) -> int:
    """Gateway in-flight, or the engine's running + waiting when other clients add more."""
    return max(i.inflight, i.num_running + i.num_waiting)


class _Scored(Sequence[Candidate]):
    """The candidates of one decision, built only when read.

    Routers score every instance on every request, but a decision's candidate
    list is read far less often (explanations, debugging); building 32 frozen
    Candidate objects would cost more than the decision itself.
    """

    __slots__ = ("_keys", "_rows", "_built")

    def __init__(self, keys: tuple[str, ...], rows: list[tuple[Any, ...]]) -> None:
        self._keys = keys          # names of the detail values after (name, score)
        self._rows = rows          # (name, score, *detail values)
        self._built: list[Candidate] | None = None

    def _all(self) -> list[Candidate]:
        if self._built is None:
            keys = self._keys
            self._built = [Candidate(r[0], float(r[1]), dict(zip(keys, map(float, r[2:]))))
                           for r in self._rows]
        return self._built

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, i: int) -> Candidate: ...
    @overload
    def __getitem__(self, i: slice) -> list[Candidate]: ...
    def __getitem__(self, i: int | slice) -> Candidate | list[Candidate]:
        return self._all()[i]

    def __iter__(self) -> Iterator[Candidate]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return repr(self._all())


def _least_inflight(pool: Sequence[InstanceSnapshot], rng: random.Random) -> InstanceSnapshot:
    """Fewest in-flight requests, uniformly random among ties (AIBrix's least-request rule)."""
    low = min(i.inflight for i in pool)
    ties = [i for i in pool if i.inflight == low]
    return ties[0] if len(ties) == 1 else ties[rng.randrange(len(ties))]


# ---- load-only policies ---------------------------------------------------------------


class RandomRouter(InstanceRouter):
    """Uniform random choice among the candidates.

    Source: sgl-project/sglang sgl-router `src/policies/random.rs` (`RandomPolicy`,
    router v0.1.x): a uniformly random healthy worker. Seeded here.
    """

    name = "random"

    def __init__(self, *, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def route(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot],
              now: float) -> RouteDecision:
        if not candidates:
            return no_candidates(profile)
        pool = _pool(candidates)
        pick = pool[self._rng.randrange(len(pool))]
        return RouteDecision(pick.instance_id, f"uniform random over {len(pool)} instances")


class PowerOfTwo(InstanceRouter):
    """Power of two choices: sample two distinct instances, keep the less loaded.

    Source: sgl-project/sglang sgl-router `src/policies/power_of_two.rs`
    (`PowerOfTwoPolicy::select_worker`, router v0.1.x): `choose_multiple(2)`, then
    the worker with load <= the other's (the first sampled wins a tie). The
    original reads the router's in-flight count, newer versions the engine's
    polled load; here load = max(gateway in-flight, engine running + waiting).
    """

    name = "power_of_two"

    def __init__(self, *, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def route(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot],
              now: float) -> RouteDecision:
        if not candidates:
            return no_candidates(profile)
        pool = _pool(candidates)
        if len(pool) == 1:
            return RouteDecision(pool[0].instance_id, "only instance")
        a, b = self._rng.sample(pool, 2)
        la, lb = _engine_load(a), _engine_load(b)
        pick = a if la <= lb else b
        cands = [Candidate(a.instance_id, float(la)), Candidate(b.instance_id, float(lb))]
        return RouteDecision(pick.instance_id,
                             f"power of two: {a.instance_id}={la} vs {b.instance_id}={lb}", cands)


class LeastRequest(InstanceRouter):
    """Fewest in-flight requests (the gateway's own count), random among ties.

    Source: vllm-project/aibrix `pkg/plugins/gateway/algorithms/least_request.go`
    (`selectTargetPodWithLeastRequestCount`, v0.3): minimum realtime running-request
    count kept by the gateway, uniformly random among equal minima. Unlike our
    `LeastLoaded` it ignores the engine's scraped running/waiting counts.
    """

    name = "least_request"

    def __init__(self, *, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def route(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot],
              now: float) -> RouteDecision:
        if not candidates:
            return no_candidates(profile)
        pool = _pool(candidates)
        pick = _least_inflight(pool, self._rng)
        cands = _Scored((), [(i.instance_id, i.inflight) for i in pool])
        return RouteDecision(pick.instance_id, f"least request ({pick.inflight} in flight)", cands)


class PrefixHash(InstanceRouter):
    """Consistent hashing of the prompt prefix, with a bounded-load escape.

    Source: sgl-project/sglang model gateway `src/policies/prefix_hash.rs`
    (`PrefixHashPolicy`, defaults `prefix_token_count=256`, `load_factor=1.25`) and
    the `HashRing` of `src/core/worker_registry.rs` (150 virtual nodes per worker).
    Rule: hash the first `prefix_tokens` tokens; the ring owner (first virtual node
    clockwise) takes the request if its load <= load_factor x (total load + 1) / n;
    otherwise the least-loaded worker that passes that check (first in order), or
    the owner anyway if none passes. Load = the router's in-flight count.

    Approximations: the key is the chained hash of the last full block within the
    first `prefix_tokens` tokens (it names exactly that prefix; with
    `prefix_tokens <= block_size` it is the first block hash); ring points are
    xxh64("{instance}#{i}") where the original uses blake3. The ring is built from
    the candidates, which equals the original's clockwise walk that skips unhealthy
    workers. A prompt shorter than one block has no key: the original declines to
    route it, here it goes to the least-loaded instance.
    """

    name = "prefix_hash"
    _RING_CACHE = 16  # pools whose rings are kept; pools rarely change

    def __init__(self, *, prefix_tokens: int = 256, load_factor: float = 1.25,
                 virtual_nodes: int = 150, seed: int = 0) -> None:
        if prefix_tokens <= 0 or virtual_nodes <= 0 or load_factor <= 0:
            raise ValueError("prefix_tokens, virtual_nodes and load_factor must be positive")
        self.prefix_tokens = prefix_tokens
        self.load_factor = load_factor
        self.virtual_nodes = virtual_nodes
        self._seed = seed  # no randomness in the rule; kept for a uniform constructor
        self._rings: OrderedDict[tuple[str, ...], tuple[list[int], list[str]]] = OrderedDict()

    def _ring(self, ids: tuple[str, ...]) -> tuple[list[int], list[str]]:
        ring = self._rings.get(ids)
        if ring is None:
            points = sorted((xxhash.xxh64_intdigest(f"{iid}#{v}".encode()), iid)
                            for iid in ids for v in range(self.virtual_nodes))
            ring = ([p for p, _ in points], [iid for _, iid in points])
            self._rings[ids] = ring
            if len(self._rings) > self._RING_CACHE:
                self._rings.popitem(last=False)
        else:
            self._rings.move_to_end(ids)
        return ring

    def owner(self, key: int, ids: tuple[str, ...]) -> str:
        positions, owners = self._ring(ids)
        return owners[bisect_right(positions, key) % len(owners)]

    def route(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot],
              now: float) -> RouteDecision:
        if not candidates:
            return no_candidates(profile)
        pool = _pool(candidates)
        blocks = profile.block_hashes
        least = min(pool, key=lambda i: i.inflight)
        if not blocks:
            return RouteDecision(least.instance_id, "no full prefix block to hash: least in-flight")
        k = min(len(blocks), max(1, self.prefix_tokens // max(1, profile.block_size)))
        key = blocks[k - 1]
        ids = tuple(i.instance_id for i in pool)
        owner_id = self.owner(key, ids)
        total = sum(i.inflight for i in pool)
        limit = self.load_factor * (total + 1) / len(pool)
        owner = next(i for i in pool if i.instance_id == owner_id)
        if total == 0 or owner.inflight <= limit:
            return RouteDecision(owner_id, f"ring owner of prefix key ({owner.inflight} in flight)")
        ok = [i for i in pool if i.inflight <= limit]
        if ok:
            pick = min(ok, key=lambda i: i.inflight)
            return RouteDecision(pick.instance_id,
                                 f"ring owner {owner_id} over {limit:.1f} in flight: least loaded")
        return RouteDecision(owner_id, "all instances over the load bound: ring owner")


# ---- cache-aware policies -----------------------------------------------------------


class _HistoryIndexed(InstanceRouter):
    """A router whose cache index is its routing history (`self.index`): it can say how much of a
    prompt each candidate holds without routing (`prefix_match`), as its rule would read it."""

    index: PrefixIndex

    def prefix_match(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot],
                     now: float) -> list[int] | None:
        return self.index.match_many([c.instance_id for c in candidates], profile.block_hashes)

    def note_route(self, instance_id: str, block_hashes: Sequence[int], now: float) -> None:
        """Another replica's route, inserted as the rule inserts its own pick (`route`): replicas
        share their routing history (`gateway.route_share`, `fleetsim.replicas`). Their load they
        take from the in-flight counts (`InstanceSnapshot.inflight`), as the originals do."""
        self.index.insert(instance_id, block_hashes, now)


class SGLangCacheAware(_HistoryIndexed):
    """SGLang router cache-aware policy: approximate radix tree per worker + balance switch.

    Source: sgl-project/sglang sgl-router `src/policies/cache_aware.rs`
    (`CacheAwarePolicy::select_worker`) and `src/policies/tree.rs`; defaults from
    the router CLI (v0.1.x/v0.2): cache_threshold 0.3, balance_abs_threshold 64,
    balance_rel_threshold 1.5, max_tree_size 2^26 chars, eviction every 120 s.
    Rule: load = the router's in-flight count per worker. If max - min > abs AND
    max > rel x min, the system is imbalanced: shortest queue (first minimum).
    Otherwise match the prompt against the tree: if matched/prompt > cache_threshold,
    the worker holding the deepest match; else the worker with the smallest tree.
    Either way the prompt is then inserted into the chosen worker's tree.

    Approximations: the tree holds block hashes, not characters, and the match
    rate is matched tokens / prompt tokens. Ties (the original takes whichever
    tenant its DashMap yields first) are broken by the seeded RNG. The tree bound
    is `max_tree_blocks` per worker, enforced at every insert by evicting the
    worker's least recently used leaves; the original trims to max_tree_size every
    eviction interval and lets it grow in between. The default 32768 blocks
    (512k tokens at block size 16) is an 80 GB GPU's KV cache for an 8B model and
    keeps 32 workers under ~140 MB; 2^26 chars would be ~1M blocks per worker.
    """

    name = "sglang_cache_aware"

    def __init__(self, *, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_tree_blocks: int = 32768,
                 seed: int = 0) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.index = PrefixIndex(max_blocks_per_instance=max_tree_blocks)
        self._rng = random.Random(seed)

    def route(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot],
              now: float) -> RouteDecision:
        if not candidates:
            return no_candidates(profile)
        pool = _pool(candidates)
        blocks = profile.block_hashes
        bs = profile.block_size
        loads = [i.inflight for i in pool]
        hi, lo = max(loads), min(loads)
        ids = [i.instance_id for i in pool]
        matches = self.index.match_many(ids, blocks)
        sizes = [self.index.size(iid) for iid in ids]
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            k = loads.index(lo)
            reason = f"imbalanced (max {hi}, min {lo} in flight): shortest queue"
            scores: list[int] = loads
        else:
            best = max(matches)
            rate = min(1.0, best * bs / profile.prompt_tokens) if profile.prompt_tokens > 0 else 0.0
            if rate > self.cache_threshold:
                k = self._tie([j for j, m in enumerate(matches) if m == best])
                reason = f"cache match {rate:.2f} > {self.cache_threshold}: deepest match"
                scores = [-m for m in matches]
            else:
                small = min(sizes)
                k = self._tie([j for j, sz in enumerate(sizes) if sz == small])
                reason = f"cache match {rate:.2f} <= {self.cache_threshold}: smallest tree"
                scores = sizes
        cands = _Scored(("inflight", "match_blocks", "tree_blocks"),
                        list(zip(ids, scores, loads, matches, sizes)))
        pick = pool[k]
        self.index.insert(pick.instance_id, blocks, now)
        return RouteDecision(pick.instance_id, reason, cands, cached_tokens=matches[k] * bs)

    def _tie(self, idx: list[int]) -> int:
        return idx[0] if len(idx) == 1 else idx[self._rng.randrange(len(idx))]

    def observe(self, outcome: RequestOutcome) -> None:
        pass  # the original's on_request_complete keeps no state either


@dataclass(slots=True)
class _Active:
    """A request Dynamo's ActiveSequences tracks on a worker until it completes."""

    instance_id: str
    blocks: tuple[int, ...]
    prefill_tokens: int
    routed_at: float
    prefill_open: bool = True
    handle: object = None            # its entry in ActiveBlocks


@dataclass(slots=True)
class _Worker:
    prefill: deque[_Active]          # requests whose prefill may still be running, by routed_at
    prefill_tokens: int = 0


class DynamoKv(_HistoryIndexed):
    """NVIDIA Dynamo KV router (approximate mode, `--no-kv-events`).

    Source: ai-dynamo/dynamo `lib/llm/src/kv_router/scheduler.rs`
    (`DefaultWorkerSelector::select_worker`, `softmax_sample`), `sequence.rs`
    (`ActiveSequences::potential_blocks_and_tokens`) and `approx.rs`
    (`ApproxKvIndexer`), v0.4-0.6. Defaults (`KvRouterConfig`): overlap_score_weight
    1.0, router_temperature 0.0, router_ttl_secs 120, router_max_tree_size 2^20,
    router_prune_target_ratio 0.8, track_active_blocks on, track_output_blocks off,
    assume_kv_reuse on.
    Rule, per worker: overlap = cached prefix blocks (approx indexer); prefill_blocks
    = (prompt tokens - overlap x block_size + prefill tokens of the worker's requests
    still prefilling) / block_size; decode_blocks = distinct blocks of the worker's
    active requests plus the request's blocks not among them; logit =
    overlap_score_weight x prefill_blocks + decode_blocks. Temperature 0: the
    minimum logit, ties to the smallest indexer tree, then random; temperature > 0:
    softmax over -logit / (max - min) / T. The chosen worker's indexer gets the
    prompt's blocks (TTL 120 s, refreshed on reuse; pruned LRU-first to 0.8 x
    max when over the bound) and its active set the request until `observe`.

    Approximations: the original learns that a prefill finished from the first
    streamed token; `observe` only sees the end of a request, so a prefill counts
    as outstanding until routed_at + an EWMA of observed TTFTs (until completion
    before any TTFT is seen). Active requests carry their full prompt blocks only
    (no partial tail block; output blocks are off by default in Dynamo too). Requests
    never reported are dropped after 300 s like Dynamo's `force_expiry`. The index
    bound counts (worker, block) pairs where Dynamo counts tree nodes.
    """

    name = "dynamo_kv"
    _EXPIRY_CHECK_S = 30.0

    def __init__(self, *, overlap_score_weight: float = 1.0, router_temperature: float = 0.0,
                 router_ttl_secs: float = 120.0, router_max_tree_size: int = 2 ** 20,
                 router_prune_target_ratio: float = 0.8, track_prefill_tokens: bool = True,
                 stale_request_s: float = 300.0, ttft_ewma_alpha: float = 0.2,
                 seed: int = 0) -> None:
        if router_temperature < 0:
            raise ValueError("router_temperature must be >= 0")
        self.overlap_score_weight = overlap_score_weight
        self.router_temperature = router_temperature
        self.track_prefill_tokens = track_prefill_tokens
        self.stale_request_s = stale_request_s
        self.ttft_ewma_alpha = ttft_ewma_alpha
        self.index = PrefixIndex(max_blocks_total=router_max_tree_size,
                                 prune_ratio=router_prune_target_ratio, ttl_s=router_ttl_secs)
        self._rng = random.Random(seed)
        self._active = ActiveBlocks()
        self._workers: dict[str, _Worker] = {}
        self._requests: dict[str, _Active] = {}
        self._ttft_s: float | None = None
        self._next_expiry_check = -math.inf

    # -- active sequence bookkeeping --

    def _worker(self, iid: str) -> _Worker:
        w = self._workers.get(iid)
        if w is None:
            w = self._workers[iid] = _Worker(deque())
        return w

    def _close_prefill(self, req: _Active) -> None:
        if req.prefill_open:
            req.prefill_open = False
            self._workers[req.instance_id].prefill_tokens -= req.prefill_tokens

    def _open_prefill_tokens(self, w: _Worker, now: float) -> int:
        q = w.prefill
        while q and (not q[0].prefill_open
                     or (self._ttft_s is not None and q[0].routed_at + self._ttft_s <= now)):
            self._close_prefill(q.popleft())
        return w.prefill_tokens

    def _free(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        self._close_prefill(req)
        self._active.remove(req.instance_id, req.handle)

    def active_blocks(self, instance_id: str) -> int:
        return self._active.count(instance_id)

    # -- routing --

    def route(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot],
              now: float) -> RouteDecision:
        if not candidates:
            return no_candidates(profile)
        self.index.expire(now)
        if now >= self._next_expiry_check:
            self._next_expiry_check = now + self._EXPIRY_CHECK_S
            for rid in [r for r, a in self._requests.items() if a.routed_at < now - self.stale_request_s]:
                self._free(rid)
        self._free(profile.request_id)  # a retry re-routes the same request
        pool = _pool(candidates)
        blocks = profile.block_hashes
        bs = max(1, profile.block_size)
        isl = profile.prompt_tokens
        w_ov = self.overlap_score_weight
        logits: list[float] = []
        overlaps: list[int] = []
        rows: list[tuple[str, float, int, float, int]] = []
        cache_tree, active_tree, workers = self.index.tree, self._active.tree, self._workers
        for inst in pool:
            iid = inst.instance_id
            t = cache_tree(iid)
            overlap = t.match(blocks) if t is not None else 0
            w = workers.get(iid)
            a = active_tree(iid)
            if w is None or a is None:
                active, shared, queued = 0, 0, 0
            else:
                active, shared = a.size, a.match(blocks)   # kv reuse: shared blocks count once
                queued = self._open_prefill_tokens(w, now) if self.track_prefill_tokens else 0
            prefill_blocks = (max(0, isl - overlap * bs) + queued) / bs
            decode_blocks = active + len(blocks) - shared
            logit = w_ov * prefill_blocks + decode_blocks
            logits.append(logit)
            overlaps.append(overlap)
            rows.append((iid, logit, overlap, prefill_blocks, decode_blocks))
        k = self._select(logits, pool)
        pick = pool[k]
        iid = pick.instance_id
        self.index.insert(iid, blocks, now)
        req = _Active(iid, tuple(blocks), max(0, isl - overlaps[k] * bs) if self.track_prefill_tokens else 0, now)
        w = self._worker(iid)
        req.handle = self._active.add(iid, req.blocks, now)
        if req.prefill_tokens:
            w.prefill.append(req)
            w.prefill_tokens += req.prefill_tokens
        else:
            req.prefill_open = False
        self._requests[profile.request_id] = req
        return RouteDecision(iid, f"min cost {logits[k]:.1f} = {w_ov:g} x prefill blocks + decode blocks "
                                  f"({overlaps[k]} blocks cached)",
                             _Scored(("overlap_blocks", "prefill_blocks", "decode_blocks"), rows),
                             cached_tokens=overlaps[k] * bs)

    def _select(self, logits: list[float], pool: list[InstanceSnapshot]) -> int:
        if self.router_temperature == 0.0 or len(logits) == 1:
            best = min(logits)
            ties = [j for j, v in enumerate(logits) if v == best]
            if len(ties) > 1:  # Dynamo: smallest indexer tree, then arbitrary
                sizes = {j: self.index.size(pool[j].instance_id) for j in ties}
                small = min(sizes.values())
                ties = [j for j in ties if sizes[j] == small]
            return ties[0] if len(ties) == 1 else ties[self._rng.randrange(len(ties))]
        hi, lo = max(logits), min(logits)
        if hi == lo:
            return self._rng.randrange(len(logits))
        span = hi - lo
        weights = [math.exp(-(v - lo) / span / self.router_temperature) for v in logits]
        return self._rng.choices(range(len(logits)), weights=weights)[0]

    def observe(self, outcome: RequestOutcome) -> None:
        if outcome.ttft_s is not None and outcome.ok:
            a = self.ttft_ewma_alpha
            self._ttft_s = outcome.ttft_s if self._ttft_s is None else (1 - a) * self._ttft_s + a * outcome.ttft_s
        self._free(outcome.request_id)


class LlmdScheduler(_HistoryIndexed):
    """llm-d inference scheduler (Gateway API Inference Extension EPP), default profile.

    Source: kubernetes-sigs/gateway-api-inference-extension `pkg/epp/scheduling/
    framework/plugins`: `multi/prefix/plugin.go` (prefix-cache-scorer, defaults
    hashBlockSize 64 chars, maxPrefixBlocksToMatch 256, lruCapacityPerServer 31250),
    `scorer/queue.go`, `scorer/kvcache_utilization.go`, `picker/max_score_picker.go`;
    weights prefix 3, queue 2, kv-cache-utilization 2 from llm-d's default
    EndpointPickerConfig (llm-d v0.2-v0.3 helm chart).
    Rule: score = 3 x prefix + 2 x queue + 2 x kv, each in [0, 1]:
    prefix = matched blocks / request blocks (first 256 blocks; 0 without a full
    block) from a per-pod LRU index fed with each routed request's blocks;
    queue = (max - q) / (max - min) over the candidates' waiting queues (1 when all
    equal); kv = 1 - KV-cache usage. The max-score picker takes the highest score,
    breaking ties at random (it shuffles, then stable-sorts).

    Approximations: blocks are the engine's 16-token blocks (GIE's 64-char blocks
    are sized as "~16 tokens" by its own comment); GIE's extra leading model-name
    hash is left out (every candidate serves the model). GIE adds a request's
    hashes root first to a golang-lru, so under pressure it evicts a prompt's
    leading blocks first; this index keeps prefixes closed (evicts deepest first).
    """

    name = "llm_d"

    def __init__(self, *, prefix_weight: float = 3.0, queue_weight: float = 2.0,
                 kv_cache_weight: float = 2.0, max_prefix_blocks_to_match: int = 256,
                 lru_capacity_per_server: int = 31250, seed: int = 0) -> None:
        self.prefix_weight = prefix_weight
        self.queue_weight = queue_weight
        self.kv_cache_weight = kv_cache_weight
        self.max_prefix_blocks_to_match = max_prefix_blocks_to_match
        self.index = PrefixIndex(max_blocks_per_instance=lru_capacity_per_server)
        self._rng = random.Random(seed)

    def route(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot],
              now: float) -> RouteDecision:
        if not candidates:
            return no_candidates(profile)
        pool = _pool(candidates)
        blocks = profile.block_hashes[:self.max_prefix_blocks_to_match]
        total = len(blocks)
        queues = [i.num_waiting for i in pool]
        qmax, qmin = max(queues), min(queues)
        scores: list[float] = []
        matches: list[int] = []
        rows: list[tuple[str, float, float, float, float]] = []
        for inst, q in zip(pool, queues):
            m = self.index.match(inst.instance_id, blocks)
            prefix = m / total if total else 0.0
            queue = 1.0 if qmax == qmin else (qmax - q) / (qmax - qmin)
            kv = 1.0 - min(1.0, max(0.0, inst.kv_usage))
            s = self.prefix_weight * prefix + self.queue_weight * queue + self.kv_cache_weight * kv
            scores.append(s)
            matches.append(m)
            rows.append((inst.instance_id, -s, prefix, queue, kv))
        best = max(scores)
        ties = [j for j, s in enumerate(scores) if s == best]
        k = ties[0] if len(ties) == 1 else ties[self._rng.randrange(len(ties))]
        pick = pool[k]
        self.index.insert(pick.instance_id, blocks, now)  # the plugin's PreRequest hook
        return RouteDecision(pick.instance_id, f"max weighted score {best:.3f} (prefix {matches[k]}/{total} blocks)",
                             _Scored(("prefix", "queue", "kv"), rows), cached_tokens=matches[k] * profile.block_size)


class AIBrixPrefixCache(_HistoryIndexed):
    """AIBrix gateway prefix-cache router.

    Source: vllm-project/aibrix `pkg/plugins/gateway/algorithms/prefix_cache.go`
    (`prefixCacheRouter.Route`, `getTargetPodOnLoadImbalance`,
    `getTargetPodFromMatchedPods`) and `pkg/utils/prefixcacheindexer/hash.go`
    (`PrefixHashTable`), v0.3. Defaults: pod running-request imbalance abs count 8,
    standard deviation factor 1, 200,000 index blocks of 4 characters, entries
    idle for 20 min evicted.
    Rule: with running = the gateway's in-flight count per pod, if max - min > 8,
    route to a least-request pod (random among minima). Otherwise match the prompt:
    each pod's match percent = matched blocks x 100 // prompt blocks; order matched
    pods by percent desc, then running asc (random among equals); take the first
    whose running <= mean + 1 x std (population, over all candidates). No match or
    none within that bound: least request. The chosen pod gets the prompt's blocks.

    Approximations: blocks are the engine's 16-token blocks; the default bound is the
    published 200,000 x 4 chars ~ 200k tokens = 12,500 engine blocks across the pool
    (an LRU over (pod, block) pairs where AIBrix keeps one LRU entry per block).
    """

    name = "aibrix_prefix"

    def __init__(self, *, imbalance_abs_count: int = 8, standard_deviation_factor: float = 1.0,
                 max_blocks: int = 12_500, eviction_duration_s: float = 1200.0,
                 seed: int = 0) -> None:
        self.imbalance_abs_count = imbalance_abs_count
        self.standard_deviation_factor = standard_deviation_factor
        self.index = PrefixIndex(max_blocks_total=max_blocks, ttl_s=eviction_duration_s)
        self._rng = random.Random(seed)

    def route(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot],
              now: float) -> RouteDecision:
        if not candidates:
            return no_candidates(profile)
        self.index.expire(now)
        pool = _pool(candidates)
        blocks = profile.block_hashes
        running = [i.inflight for i in pool]
        hi, lo = max(running), min(running)
        cands = _Scored((), [(i.instance_id, r) for i, r in zip(pool, running)])
        cached = 0
        reason = ""
        pick: InstanceSnapshot | None = None
        if hi - lo > self.imbalance_abs_count:
            pick = _least_inflight(pool, self._rng)
            reason = f"imbalanced (running spread {hi - lo} > {self.imbalance_abs_count}): least request"
        else:
            n = len(blocks)
            matches = self.index.match_many([i.instance_id for i in pool], blocks)
            matched = [j for j, m in enumerate(matches) if m > 0]
            if matched:
                mean = sum(running) / len(running)
                std = math.sqrt(sum((r - mean) ** 2 for r in running) / len(running))  # population
                bound = mean + self.standard_deviation_factor * std
                self._rng.shuffle(matched)
                matched.sort(key=lambda j: (-(matches[j] * 100 // n), running[j]))
                for j in matched:
                    if running[j] <= bound:
                        pick, cached = pool[j], matches[j]
                        reason = f"prefix match {matches[j] * 100 // n}% within mean+std running ({bound:.1f})"
                        break
            if pick is None:
                pick = _least_inflight(pool, self._rng)
                reason = ("matched pods over mean+std running: least request" if matched
                          else "no prefix match: least request")
        self.index.insert(pick.instance_id, blocks, now)
        return RouteDecision(pick.instance_id, reason, cands, cached_tokens=cached * profile.block_size)


PEER_ROUTERS: dict[str, type] = {
    RandomRouter.name: RandomRouter,
    PowerOfTwo.name: PowerOfTwo,
    LeastRequest.name: LeastRequest,
    PrefixHash.name: PrefixHash,
    SGLangCacheAware.name: SGLangCacheAware,
    DynamoKv.name: DynamoKv,
    LlmdScheduler.name: LlmdScheduler,
    AIBrixPrefixCache.name: AIBrixPrefixCache,
}
