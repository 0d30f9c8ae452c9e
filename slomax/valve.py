"""The engine valve: how long an engine would take to start one more prefill.

An engine (vLLM V1, SGLang, the simulated one) moves a request to "running" as soon as
its KV cache has room, long before its prompt is through, and then works running
prompts off in order, a chunk per step. So neither its waiting count nor its running
count says how long a new arrival will wait for its first token; the prefill it has
been given and not yet finished does. The valve keeps that figure per instance:

* `dispatched(request, instance, tokens)` adds a request's expected uncached prompt
  tokens to the instance's backlog (callers report where the router sent it);
* `first_token(request)` takes them off, and samples the instance's speed as
  (backlog ahead of it + its own tokens) / (dispatch to first token): the instance
  worked all of that off in that time, which holds under load too (decode steps
  sharing the engine included), unlike tokens / TTFT of one request;
* `wait_s(instance)` = backlog / speed, the predicted wait of a new prefill there, and
  `pool_wait(instances)` the same for the pool as a whole.

Admission opens while the pool would start a new prefill within the controller's
target (`engine_wait_s`), so waiting moves to the gateway, where it is ordered by class
and can be refused. Pure bookkeeping: times come from the caller.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .predict import Ewma


@dataclass(slots=True)
class _Sent:
    instance: str
    tokens: float
    at: float
    ahead: float


class EngineValve:
    def __init__(self, alpha: float = 0.1) -> None:
        self.alpha = alpha
        self.backlog: dict[str, float] = {}
        self.speed: dict[str, Ewma] = {}
        self.pool_speed = Ewma(alpha)  # any instance's, for instances not yet sampled
        self._sent: dict[str, _Sent] = {}

    def dispatched(self, request_id: str, instance: str, tokens: float, now: float) -> None:
        """`request_id` went to `instance` (again, on a retry: it moves)."""
        self.forget(request_id)
        ahead = self.backlog.get(instance, 0.0)
        self.backlog[instance] = ahead + tokens
        self._sent[request_id] = _Sent(instance, tokens, now, ahead)

    def first_token(self, request_id: str, now: float) -> float | None:
        """Its prefill is through; returns dispatch-to-first-token seconds (None if unknown)."""
        s = self._sent.pop(request_id, None)
        if s is None:
            return None
        self._drop(s)
        took = now - s.at
        if took > 0:
            rate = (s.ahead + s.tokens) / took
            sp = self.speed.get(s.instance)
            if sp is None:
                sp = self.speed[s.instance] = Ewma(self.alpha)
            # Token counts are estimates (prefix hits vary): clip single samples so one
            # fully cached prompt cannot claim the engine got five times faster.
            ref = sp.value or self.pool_speed.value
            if ref:
                rate = min(max(rate, ref / 3), ref * 3)
            sp.add(rate)
            self.pool_speed.add(rate)
        return took

    def forget(self, request_id: str) -> None:
        """It ended (or moved) without a first token: its tokens leave the backlog."""
        s = self._sent.pop(request_id, None)
        if s is not None:
            self._drop(s)

    def _drop(self, s: _Sent) -> None:
        left = self.backlog.get(s.instance, 0.0) - s.tokens
        self.backlog[s.instance] = left if left > 1e-6 else 0.0

    def tracked(self, request_id: str) -> bool:
        return request_id in self._sent

    def speed_of(self, instance: str) -> float | None:
        sp = self.speed.get(instance)
        if sp is not None and sp.value:
            return sp.value
        return self.pool_speed.value

    def wait_s(self, instance: str) -> float | None:
        """Predicted wait for a new prefill there (None: no speed sample yet)."""
        b = self.backlog.get(instance, 0.0)
        if b <= 0:
            return 0.0
        sp = self.speed_of(instance)
        return b / sp if sp else None

    def pool_wait(self, instances: Iterable[str], unrouted: float = 0.0) -> float | None:
        """Seconds for `instances` together to work off their backlog (plus `unrouted` tokens
        not placed yet): the wait a new prefill can expect whatever instance the router picks.

        The pool figure, not the best instance's: routers weigh cache affinity and their own
        load models, so a new request does not reliably land where the backlog is shortest.
        None when nothing is measured yet and some prefill is outstanding.
        """
        backlog = unrouted
        speed = 0.0
        for iid in instances:
            backlog += self.backlog.get(iid, 0.0)
            sp = self.speed_of(iid)
            speed += sp or 0.0
        if backlog <= 0:
            return 0.0
        return backlog / speed if speed > 0 else None

    def best_wait(self, instances: Iterable[str]) -> float | None:
        """The shortest predicted wait among `instances`; None when there are none, or when
        every busy one is still unmeasured (then only an idle instance counts as room)."""
        best: float | None = None
        for iid in instances:
            w = self.wait_s(iid)
            if w is None:
                continue
            best = w if best is None else min(best, w)
        return best
