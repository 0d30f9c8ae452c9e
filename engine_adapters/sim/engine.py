"""Continuous-batching engine state machine (vLLM V1 scheduler, simulated).

Pure and clock-free: ``step(now)`` schedules one batch starting at ``now`` and
returns its duration (from the roofline StepTimer) with the per-request
outcomes that take effect at ``now + duration``. The engine's state advances at
``step()`` time, so the caller (live worker or discrete-event simulator) must
not call ``step`` again before ``start + duration``; events of a request
aborted in between should be dropped by the caller.

Scheduling, as vLLM V1 with chunked prefill and prefix caching:
  1. Running requests in admission order, each computing its remaining known
     tokens (prompt chunk or one decode token) within max_num_batched_tokens.
     If KV blocks run out, the most recently admitted running request is
     preempted (recompute: blocks freed, back to the head of waiting).
  2. If nothing was preempted, waiting requests FCFS while token budget,
     max_num_seqs and KV blocks allow; the prefix cache decides cached_tokens;
     a prompt longer than the remaining budget is chunked.
A request samples a token whenever a step computes all its known tokens
(prompt + outputs so far): the end of prefill gives the first token, each
decode one more; a preempted request's recompute ends with its next token.

Prefill/decode disaggregation (issue 17), per request:
  * ``mode="prefill"``: prefill only. It ends with its first token (event
    ``finished``), but its blocks stay held (the KV is being sent) until the
    caller says the transfer is over: ``release_kv``.
  * decode only: ``receive(req)`` reserves the blocks for the whole prompt on
    arrival of a transfer (a prefix this engine already caches is reused and
    need not cross: the return value), ``kv_arrived`` makes it runnable with
    its first token already made; it then decodes like any running request
    (admitted ahead of new prompts: its prefill is paid for). Preempted, it
    recomputes here, as vLLM's decode instances do.
Both ends hold the request's KV for the transfer's duration.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from fleetcore.hardware import GpuSpec, ModelSpec
from fleetcore.roofline import StepTimer

from .kv_cache import KVCacheManager, KVEvent


@dataclass(slots=True)
class EngineConfig:
    model: ModelSpec
    gpu: GpuSpec
    tp: int = 1
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None  # None: the model's; always capped by KV capacity
    num_gpu_blocks_override: int | None = None
    enable_kv_events: bool = True  # simulators that never drain events can turn them off
    # vLLM's `--long-prefill-token-threshold`: at most this many prompt tokens of one request per
    # step (0: off, vLLM's default with one partial prefill), so a long prompt's chunk leaves the
    # rest of the budget to other requests, KV-arrived ones included (bench/DISAGG.md "TPOT by role").
    long_prefill_token_threshold: int = 0
    # (tokens per step, compute efficiency) points for the roofline; None: its constant
    compute_efficiency_curve: Sequence[tuple[int, float]] | None = None


@dataclass(slots=True)
class SimRequest:
    request_id: str
    prompt_len: int
    block_hashes: Sequence[int]  # chained hash per FULL prompt block
    output_len: int  # exactly the tokens it will generate (caller decided stop vs length)
    arrival: float
    mode: Literal["full", "prefill"] = "full"  # prefill: stop after the first token, hold the KV


@dataclass(slots=True)
class RequestEvent:
    request_id: str
    new_tokens: int  # 1 when the step sampled a token for it, else 0 (preempted)
    first_token: bool
    finished: bool
    cached_tokens: int  # prefix-cache hit at its (latest) admission
    preempted: bool = False


@dataclass(slots=True)
class StepResult:
    start: float
    duration: float
    events: list[RequestEvent]
    num_tokens: int = 0  # tokens computed in the step (prefill + decode)
    num_seqs: int = 0


class _Req:
    """Engine-side request state (mutable, slotted, never copied)."""

    __slots__ = ("req", "rid", "known", "num_computed", "num_output", "cached_tokens", "cap", "is_running",
                 "target")

    def __init__(self, req: SimRequest) -> None:
        self.req = req
        self.rid = req.request_id
        self.known = req.prompt_len  # prompt + outputs so far: tokens that must be in KV
        self.num_computed = 0  # tokens written to KV
        self.num_output = 0
        self.cached_tokens = 0
        self.cap = 0  # tokens the held blocks can take (fast path around ensure_capacity)
        self.is_running = False
        self.target = 1 if req.mode == "prefill" else req.output_len  # tokens it makes here


class SimEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.timer = StepTimer(config.model, config.gpu, config.tp,
                               compute_efficiency_curve=config.compute_efficiency_curve)
        if config.num_gpu_blocks_override is not None:
            num_blocks = config.num_gpu_blocks_override
        else:
            num_blocks = self.timer.kv_capacity_tokens(config.gpu_memory_utilization) // config.block_size
        if num_blocks < 1:
            raise ValueError("no KV cache blocks fit")
        self.kv = KVCacheManager(num_blocks, config.block_size, enable_events=config.enable_kv_events)
        self.block_size = config.block_size
        # vLLM refuses to start if max_model_len exceeds the KV cache; we cap instead so
        # tiny test caches work with long-context models.
        self.max_model_len = min(config.max_model_len or config.model.max_model_len, num_blocks * config.block_size)
        self._waiting: deque[_Req] = deque()
        self._running: list[_Req] = []
        self._by_id: dict[str, _Req] = {}
        # Disaggregation: prefilled requests whose KV is being sent out; requests whose KV is
        # coming in (blocks reserved); requests whose KV has arrived, to be admitted to decode.
        self._held: dict[str, _Req] = {}
        self._receiving: dict[str, _Req] = {}
        self._arrived: deque[_Req] = deque()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_preemptions = 0
        self.num_finished = 0
        self.num_aborted = 0

    # -- state --------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_usage(self) -> float:
        return self.kv.usage()

    @property
    def num_gpu_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def prefix_queries_tokens(self) -> int:
        return self.kv.prefix_queries_tokens

    @property
    def prefix_hits_tokens(self) -> int:
        return self.kv.prefix_hits_tokens

    def has_work(self) -> bool:
        return bool(self._running or self._waiting or self._arrived)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._by_id

    def is_queued(self, request_id: str) -> bool:
        """Whether the request waits here with nothing computed and no blocks (aborting it
        loses no work)."""
        r = self._by_id.get(request_id)
        return r is not None and not r.is_running and r.num_computed == 0 and r in self._waiting

    # -- requests -------------------------------------------------------------

    def add_request(self, req: SimRequest) -> None:
        """Queue a request. ValueError if it can never run here (the gateway should
        have rejected it: too long for max_model_len, or duplicate id)."""
        if req.request_id in self._by_id:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if req.prompt_len < 1 or req.output_len < 1:
            raise ValueError("prompt_len and output_len must be >= 1")
        if req.prompt_len + req.output_len > self.max_model_len:
            raise ValueError(
                f"prompt {req.prompt_len} + output {req.output_len} tokens exceed max_model_len {self.max_model_len}"
            )
        r = _Req(req)
        self._by_id[req.request_id] = r
        self._waiting.append(r)

    def abort(self, request_id: str) -> bool:
        """Drop a waiting or running request, freeing its blocks. False if unknown."""
        r = self._by_id.pop(request_id, None)
        if r is None:
            return False
        if self._held.pop(request_id, None) is not None or self._receiving.pop(request_id, None) is not None:
            self.kv.free(r.rid)
        elif r in self._arrived:
            self._arrived.remove(r)
            self.kv.free(r.rid)
        elif r.is_running:
            self._running.remove(r)
            self.kv.free(r.rid)
        else:
            self._waiting.remove(r)
        self.num_aborted += 1
        return True

    # -- disaggregation ---------------------------------------------------------

    def release_kv(self, request_id: str) -> bool:
        """A prefill-only request's KV has been sent: free its blocks (its prompt blocks stay
        cached here). False if it is not held here."""
        r = self._held.pop(request_id, None)
        if r is None:
            return False
        del self._by_id[request_id]
        self.kv.free(r.rid)
        return True

    def receive(self, req: SimRequest) -> int | None:
        """Reserve blocks for a request whose KV another engine prefilled. Returns the prompt
        tokens this engine's prefix cache already holds (those need not be sent), or None,
        changing nothing, when the blocks cannot be had now."""
        if req.request_id in self._by_id:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if req.output_len < 2:
            raise ValueError("a request with one output token is done at prefill; nothing to decode")
        if req.prompt_len + req.output_len > self.max_model_len:
            raise ValueError(
                f"prompt {req.prompt_len} + output {req.output_len} tokens exceed max_model_len {self.max_model_len}"
            )
        cached = self.kv.allocate_prompt(req.request_id, req.block_hashes, req.prompt_len + 1)
        if cached is None:
            return None
        r = _Req(req)
        r.cached_tokens = cached
        self._by_id[req.request_id] = r
        self._receiving[req.request_id] = r
        return cached

    def kv_arrived(self, request_id: str) -> None:
        """The transfer is complete: the prompt's KV and first token are here; decode next."""
        r = self._receiving.pop(request_id)
        p = r.req.prompt_len
        self.kv.commit_full_blocks(r.rid, p)  # received prompt blocks are reusable prefixes here too
        r.num_computed = p
        r.num_output = 1
        r.known = p + 1
        r.cap = self.kv.num_blocks_of(r.rid) * self.block_size
        self._arrived.append(r)

    def holds(self, request_id: str) -> bool:
        """Whether a prefill-only request has finished here and its KV waits to be sent."""
        return request_id in self._held

    @property
    def num_receiving(self) -> int:
        """Requests whose KV is coming in (blocks reserved, not arrived yet)."""
        return len(self._receiving)

    @property
    def num_held(self) -> int:
        """Requests whose KV is in transfer out of (held) or into (receiving) this engine."""
        return len(self._held) + len(self._receiving)

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def drain_kv_events(self) -> list[KVEvent]:
        return self.kv.drain_events()

    # -- scheduling -----------------------------------------------------------

    def step(self, now: float) -> StepResult:
        """Schedule and account one batch starting at ``now``."""
        running = self._running
        waiting = self._waiting
        kv = self.kv
        bs = self.block_size
        budget = self.config.max_num_batched_tokens
        long_cap = self.config.long_prefill_token_threshold
        events: list[RequestEvent] = []
        sched: list[tuple[_Req, int]] = []
        preempted = False

        # 1. Running requests, admission order.
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            n = r.known - r.num_computed
            if n > budget:
                n = budget
            if long_cap and n > long_cap:
                n = long_cap
            total = r.num_computed + n
            if total > r.cap:
                while not kv.ensure_capacity(r.rid, total):
                    victim = running.pop()
                    self._preempt(victim, events)
                    preempted = True
                    if victim is r:
                        break
                else:
                    r.cap = kv.num_blocks_of(r.rid) * bs
                if r.cap == 0:  # r itself was preempted
                    break
            sched.append((r, n))
            budget -= n
            i += 1

        # 2. Waiting requests, FCFS (vLLM V1 admits none in a step that preempted); requests
        #    whose KV arrived from a prefill engine first (one decode token each).
        if not preempted:
            max_seqs = self.config.max_num_seqs
            arrived = self._arrived
            while arrived and budget > 0 and len(running) < max_seqs:
                r = arrived.popleft()
                r.is_running = True
                running.append(r)
                sched.append((r, 1))
                budget -= 1
            while waiting and budget > 0 and len(running) < max_seqs:
                r = waiting[0]
                cached = kv.allocate_prompt(r.rid, r.req.block_hashes, r.known, budget)
                if cached is None:
                    break  # head-of-line blocking, as vLLM: no skipping ahead
                waiting.popleft()
                r.cached_tokens = cached
                r.num_computed = cached
                n = r.known - cached
                if n > budget:
                    n = budget
                if long_cap and n > long_cap:
                    n = long_cap
                r.cap = kv.num_blocks_of(r.rid) * bs
                r.is_running = True
                running.append(r)
                sched.append((r, n))
                budget -= n

        if not sched:
            return StepResult(now, 0.0, events)

        # 3. Account the batch: timing totals, KV commits, sampled tokens.
        tokens = pairs = ctx = 0
        finished_any = False
        sampled = 0
        for r, n in sched:
            p = r.num_computed
            tokens += n
            ctx += p
            pairs += n * p + ((n * (n + 1)) >> 1)
            if p < r.req.prompt_len:
                # The chunk covers prompt tokens: newly full prompt blocks become
                # shareable now (vLLM V1 caches blocks at allocation, before the kernel).
                kv.commit_full_blocks(r.rid, p + n)
            p += n
            r.num_computed = p
            if p == r.known:
                r.num_output += 1
                r.known += 1
                sampled += 1
                first = r.num_output == 1
                if first:
                    self.prompt_tokens_total += r.req.prompt_len
                done = r.num_output >= r.target
                if done:
                    finished_any = True
                events.append(RequestEvent(r.rid, 1, first, done, r.cached_tokens))
        self.generation_tokens_total += sampled

        if finished_any:
            keep: list[_Req] = []
            for r in running:
                if r.num_output >= r.target:
                    r.is_running = False
                    if r.req.mode == "prefill":
                        self._held[r.rid] = r  # KV stays until release_kv
                    else:
                        kv.free(r.rid)
                        del self._by_id[r.rid]
                    self.num_finished += 1
                else:
                    keep.append(r)
            self._running = keep

        duration = self.timer.step_time_totals(tokens, len(sched), pairs, ctx)
        return StepResult(now, duration, events, tokens, len(sched))

    def _preempt(self, r: _Req, events: list[RequestEvent]) -> None:
        """Recompute-mode preemption: drop its KV, requeue at the head of waiting."""
        self.kv.free(r.rid)
        r.num_computed = 0
        r.cap = 0
        r.is_running = False
        self._waiting.appendleft(r)
        self.num_preemptions += 1
        events.append(RequestEvent(r.rid, 0, False, False, r.cached_tokens, True))
