"""Seeded synthetic workloads for shapes the public traces lack.

Every generator is deterministic for its arguments and draws block ids from its
own namespace (`id_namespace("<kind>:<seed>")`, or `id_base` when given), so
generated workloads can be merged with each other and with real traces without
false prefix sharing. Arrivals of sessions / agents / documents / bursts are a
Poisson process at `rate`; requests inside one follow from its own timeline.

Block granularity: a shared prefix (system prompt, tool schema, document) shares
only its *full* blocks; its remainder falls into the first block of what follows,
which is private. A growing context keeps its block ids: the partial last block of
turn k-1 keeps its id in turn k (where it is full), because replayed prompt text
for an id is a fixed chunk truncated at the end (`workloads.prompts`), so turn
k-1's prompt is a literal prefix of turn k's.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Any

from fleetcore.slo import BATCH, LONG_CONTEXT
from workloads.trace import DEFAULT_BLOCK_TOKENS, TraceRequest, Workload, id_namespace


@dataclass(frozen=True, slots=True)
class LengthDist:
    """Lognormal token count with the given mean, clipped to [lo, hi]; sigma 0 → constant."""

    mean: float
    sigma: float = 0.6
    lo: int = 1
    hi: int = 1 << 20

    def sample(self, rng: random.Random) -> int:
        if self.sigma <= 0:
            v = self.mean
        else:
            # mu chosen so the (unclipped) mean is `mean`, not exp(mu).
            v = rng.lognormvariate(math.log(self.mean) - self.sigma ** 2 / 2, self.sigma)
        return int(min(max(round(v), self.lo), self.hi))


Length = int | LengthDist


def _draw(rng: random.Random, d: Length) -> int:
    return d if isinstance(d, int) else d.sample(rng)


def _params(**kw: Any) -> dict[str, Any]:
    """Generator arguments as JSON-able metadata (LengthDist → dict)."""
    return {k: asdict(v) if isinstance(v, LengthDist) else v for k, v in kw.items()}


def _exp(rng: random.Random, mean_s: float) -> float:
    """Exponential gap with the given mean; 0 means no gap."""
    return rng.expovariate(1 / mean_s) if mean_s > 0 else 0.0


def _poisson_starts(rng: random.Random, rate: float, n: int, start_s: float) -> list[float]:
    if rate <= 0:
        raise ValueError("rate must be positive")
    t, out = start_s, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


class _Ids:
    """Fresh block ids from one namespace."""

    def __init__(self, base: int) -> None:
        self.next = base

    def take(self, n: int) -> list[int]:
        ids = list(range(self.next, self.next + n))
        self.next += n
        return ids


class _Context:
    """A prompt that grows by appending; its ids only ever extend (growing prefix)."""

    def __init__(self, ids: _Ids, block_tokens: int, shared: list[int] | None = None,
                 shared_tokens: int = 0) -> None:
        self.pool = ids
        self.bt = block_tokens
        # Only the full blocks of a shared prefix are shared; see module docstring.
        self.ids: list[int] = list(shared or [])
        self.tokens = shared_tokens

    def append(self, n: int) -> None:
        self.tokens += n
        need = -(-self.tokens // self.bt) - len(self.ids)
        if need > 0:
            self.ids.extend(self.pool.take(need))


def _shared_prefix(ids: _Ids, tokens: int, bt: int) -> tuple[list[int], int]:
    """Ids of the full blocks of a shared prefix and the tokens they cover."""
    n = tokens // bt
    return ids.take(n), n * bt


def chat_sessions(*, sessions: int = 200, rate: float = 1.0, seed: int = 0,
                  turns: Length = LengthDist(4, 0.7, 1, 30),
                  system_tokens: int = 1024,
                  user_tokens: Length = LengthDist(200, 1.0, 4, 8000),
                  output_tokens: Length = LengthDist(250, 0.8, 1, 2000),
                  think_time_s: float = 20.0, reply_s_per_token: float = 0.025,
                  block_tokens: int = DEFAULT_BLOCK_TOKENS, start_s: float = 0.0,
                  tenant: str | None = None, model: str | None = None,
                  id_base: int | None = None, name: str = "chat") -> Workload:
    """Multi-turn chat: each turn re-sends the whole conversation plus a new user message.

    All sessions share the app's system prompt (its full blocks). The next turn
    arrives after the reply would have streamed (output x reply_s_per_token) plus an
    exponential think time. Class is left to `mix.assign` (by length).
    """
    rng = random.Random(seed)
    ids = _Ids(id_namespace(f"chat:{seed}") if id_base is None else id_base)
    shared, shared_tok = _shared_prefix(ids, system_tokens, block_tokens)
    reqs: list[TraceRequest] = []
    for s, t in enumerate(_poisson_starts(rng, rate, sessions, start_s)):
        ctx = _Context(ids, block_tokens, shared, shared_tok)
        ctx.append(system_tokens - shared_tok)
        sid = f"{name}-{seed}-{s}"
        for _ in range(max(1, _draw(rng, turns))):
            ctx.append(_draw(rng, user_tokens))
            out = _draw(rng, output_tokens)
            reqs.append(TraceRequest(round(t * 1000, 3), ctx.tokens, out, tuple(ctx.ids),
                                     block_tokens, tenant=tenant, model=model, session=sid))
            ctx.append(out)  # the reply is part of the next turn's context
            t += out * reply_s_per_token + _exp(rng, think_time_s)
    return Workload(name, reqs, block_tokens, {"generator": "chat_sessions", "params": _params(
        sessions=sessions, rate=rate, seed=seed, turns=turns, system_tokens=system_tokens,
        user_tokens=user_tokens, output_tokens=output_tokens, think_time_s=think_time_s,
        reply_s_per_token=reply_s_per_token, block_tokens=block_tokens, start_s=start_s)})


def agent_loops(*, agents: int = 50, rate: float = 0.5, seed: int = 0,
                steps: Length = LengthDist(12, 0.5, 1, 60),
                shared_prefix_tokens: int = 6144, prefixes: int = 1,
                task_tokens: Length = LengthDist(400, 0.8, 8, 8000),
                observation_tokens: Length = LengthDist(600, 1.0, 1, 16000),
                output_tokens: Length = LengthDist(120, 0.7, 1, 1000),
                step_gap_s: float = 2.0, reply_s_per_token: float = 0.025,
                block_tokens: int = DEFAULT_BLOCK_TOKENS, start_s: float = 0.0,
                tenant: str | None = None, model: str | None = None,
                id_base: int | None = None, name: str = "agent") -> Workload:
    """Agent loops: many agents re-send one long system/tool prefix every step, then
    their own growing history (task, then action + tool observation per step).

    `prefixes` > 1 models several agent apps; each agent picks one uniformly. The gap
    between steps is the reply's streaming time plus an exponential tool latency.
    """
    if prefixes < 1:
        raise ValueError("prefixes must be >= 1")
    rng = random.Random(seed)
    ids = _Ids(id_namespace(f"agent:{seed}") if id_base is None else id_base)
    tools = [_shared_prefix(ids, shared_prefix_tokens, block_tokens) for _ in range(prefixes)]
    reqs: list[TraceRequest] = []
    for a, t in enumerate(_poisson_starts(rng, rate, agents, start_s)):
        shared, shared_tok = tools[rng.randrange(prefixes)]
        ctx = _Context(ids, block_tokens, shared, shared_tok)
        ctx.append(shared_prefix_tokens - shared_tok + _draw(rng, task_tokens))
        sid = f"{name}-{seed}-{a}"
        n_steps = max(1, _draw(rng, steps))
        for k in range(n_steps):
            out = _draw(rng, output_tokens)
            reqs.append(TraceRequest(round(t * 1000, 3), ctx.tokens, out, tuple(ctx.ids),
                                     block_tokens, tenant=tenant, model=model, session=sid))
            if k + 1 < n_steps:
                ctx.append(out + _draw(rng, observation_tokens))
                t += out * reply_s_per_token + _exp(rng, step_gap_s)
    return Workload(name, reqs, block_tokens, {"generator": "agent_loops", "params": _params(
        agents=agents, rate=rate, seed=seed, steps=steps, shared_prefix_tokens=shared_prefix_tokens,
        prefixes=prefixes, task_tokens=task_tokens, observation_tokens=observation_tokens,
        output_tokens=output_tokens, step_gap_s=step_gap_s, reply_s_per_token=reply_s_per_token,
        block_tokens=block_tokens, start_s=start_s)})


def document_analysis(*, documents: int = 40, rate: float = 0.1, seed: int = 0,
                      doc_tokens: Length = LengthDist(30000, 0.6, 8192, 120000),
                      questions: Length = LengthDist(4, 0.5, 1, 20),
                      question_tokens: Length = LengthDist(60, 0.6, 4, 1000),
                      output_tokens: Length = LengthDist(300, 0.6, 1, 2000),
                      question_gap_s: float = 30.0,
                      block_tokens: int = DEFAULT_BLOCK_TOKENS, start_s: float = 0.0,
                      tenant: str | None = None, model: str | None = None,
                      id_base: int | None = None, name: str = "docs") -> Workload:
    """Long-document analysis: each question re-sends the document plus that question
    (independent questions, not a growing chat). Class long_context."""
    rng = random.Random(seed)
    ids = _Ids(id_namespace(f"docs:{seed}") if id_base is None else id_base)
    reqs: list[TraceRequest] = []
    for d, t in enumerate(_poisson_starts(rng, rate, documents, start_s)):
        n_doc = _draw(rng, doc_tokens)
        doc_ids, doc_full = _shared_prefix(ids, n_doc, block_tokens)
        sid = f"{name}-{seed}-{d}"
        for _ in range(max(1, _draw(rng, questions))):
            ctx = _Context(ids, block_tokens, doc_ids, doc_full)
            ctx.append(n_doc - doc_full + _draw(rng, question_tokens))
            reqs.append(TraceRequest(round(t * 1000, 3), ctx.tokens, _draw(rng, output_tokens),
                                     tuple(ctx.ids), block_tokens, tenant=tenant,
                                     request_class=LONG_CONTEXT, model=model, session=sid))
            t += _exp(rng, question_gap_s)
    return Workload(name, reqs, block_tokens, {"generator": "document_analysis", "params": _params(
        documents=documents, rate=rate, seed=seed, doc_tokens=doc_tokens, questions=questions,
        question_tokens=question_tokens, output_tokens=output_tokens,
        question_gap_s=question_gap_s, block_tokens=block_tokens, start_s=start_s)})


def offline_batch(*, bursts: int = 3, rate: float = 1 / 300, seed: int = 0,
                  burst_size: Length = LengthDist(500, 0.3, 1, 100000),
                  spread_s: float = 2.0, template_tokens: int = 1024,
                  input_tokens: Length = LengthDist(800, 0.8, 1, 16000),
                  output_tokens: Length = LengthDist(200, 0.8, 1, 2000),
                  deadline_s: float = 600.0,
                  block_tokens: int = DEFAULT_BLOCK_TOKENS, start_s: float = 0.0,
                  tenant: str | None = None, model: str | None = None,
                  id_base: int | None = None, name: str = "batch") -> Workload:
    """Offline batch jobs: bursts (Poisson at `rate` bursts/s) of many requests submitted
    within `spread_s`, each the job's shared instruction template plus its own item.
    Class batch, with an end-to-end deadline."""
    rng = random.Random(seed)
    ids = _Ids(id_namespace(f"batch:{seed}") if id_base is None else id_base)
    reqs: list[TraceRequest] = []
    for b, t in enumerate(_poisson_starts(rng, rate, bursts, start_s)):
        template, tmpl_full = _shared_prefix(ids, template_tokens, block_tokens)
        sid = f"{name}-{seed}-{b}"
        for _ in range(max(1, _draw(rng, burst_size))):
            ctx = _Context(ids, block_tokens, template, tmpl_full)
            ctx.append(template_tokens - tmpl_full + _draw(rng, input_tokens))
            at = t + rng.uniform(0.0, spread_s)
            reqs.append(TraceRequest(round(at * 1000, 3), ctx.tokens, _draw(rng, output_tokens),
                                     tuple(ctx.ids), block_tokens, tenant=tenant,
                                     request_class=BATCH, model=model, session=sid,
                                     deadline_s=deadline_s))
    return Workload(name, reqs, block_tokens, {"generator": "offline_batch", "params": _params(
        bursts=bursts, rate=rate, seed=seed, burst_size=burst_size, spread_s=spread_s,
        template_tokens=template_tokens, input_tokens=input_tokens, output_tokens=output_tokens,
        deadline_s=deadline_s, block_tokens=block_tokens, start_s=start_s)})


GENERATORS = {
    "chat": chat_sessions,
    "agent": agent_loops,
    "docs": document_analysis,
    "batch": offline_batch,
}
