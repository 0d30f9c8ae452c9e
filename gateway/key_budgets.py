"""A key's own budgets (`POST /admin/v1/keys` with `budgets`), on top of its tenant's.

A request passes only if both allow: the gateway checks the key's buckets first (here,
before the admission policy runs), then the policy checks the tenant's as always. SLOMax
stays pure and unaware of keys: this reuses its bucket arithmetic (`slomax.budgets.TenantBudget`)
keyed by key id. A request turned away by the tenant's budget or by the fleet gets its
tokens back from the key (its request still counts, as for a tenant).

Fleet-wide with several replicas: the key's buckets are checked and charged by the same
Redis script as tenant budgets (`gateway.budget_store.SharedBudgets.acquire`, scope "key"),
one round trip; the local buckets here are then only the fallback. Without Redis (one
replica) they enforce the whole budget; with Redis unreachable they enforce the same local
share as the tenants' (budget / live replicas, `SharedBudgets.share`).
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetcore.types import RequestProfile
from gateway.budget_store import Charge, SharedBudgets
from gateway.errors import rate_limited
from gateway.keys import KeyStore
from slomax.budgets import BudgetVerdict, TenantBudget
from slomax.config import Budgets

KEY_SCOPE = "key"  # the budget store's scope for API keys (tenants have their own)


@dataclass(frozen=True, slots=True)
class KeyCharge:
    key_id: str
    tokens: int
    shared: SharedBudgets | None = None  # charged fleet-wide there (and settled there), else locally
    charge: Charge | None = None


class KeyBudgets:
    def __init__(self, store: KeyStore, default_output_tokens: int = 256) -> None:
        self.store = store
        self.default_output_tokens = default_output_tokens
        self._buckets: dict[str, tuple[Budgets, TenantBudget]] = {}

    def _budget(self, key_id: str, now: float) -> TenantBudget | None:
        rec = self.store.record(key_id)
        if rec is None or not rec.budgets:
            self._buckets.pop(key_id, None)
            return None
        want = Budgets(**rec.budgets)
        held = self._buckets.get(key_id)
        if held is None or held[0] != want:
            held = self._buckets[key_id] = (want, TenantBudget(want, now))
        return held[1]

    async def admit(self, key_id: str | None, profile: RequestProfile, now: float,
                    shared: SharedBudgets | None = None) -> KeyCharge | None:
        """Charge the key (fleet-wide through `shared` when given and reachable), or raise the 429;
        None when the key has no budgets of its own."""
        if key_id is None:
            return None
        budget = self._budget(key_id, now)
        if budget is None:
            return None
        out = profile.max_tokens if profile.max_tokens is not None else self.default_output_tokens
        tokens = profile.prompt_tokens + out * max(1, profile.n)
        got = await shared.acquire(KEY_SCOPE, key_id, budget.budgets, tokens) if shared is not None else None
        if got is not None:
            verdict, charge = got
            _raise_unless(verdict)
            return KeyCharge(key_id, tokens, shared, charge)
        share = shared.share if shared is not None else 1.0  # Redis unreachable: this replica's share
        if budget.share != share:
            budget.set_share(share, now)
        _raise_unless(budget.check(tokens, now))
        budget.charge(tokens, now)
        return KeyCharge(key_id, tokens)

    def settle(self, charge: KeyCharge, used_tokens: int, now: float) -> None:
        if charge.shared is not None and charge.charge is not None:
            charge.shared.settle(charge.charge, used_tokens)
            return
        held = self._buckets.get(charge.key_id)
        if held is not None:
            held[1].settle(charge.tokens, used_tokens, now)


def _raise_unless(verdict: BudgetVerdict) -> None:
    if not verdict.ok:
        raise rate_limited(f"This API key's {verdict.reason}", verdict.retry_after_s or 1.0,
                           "tokens" if verdict.code == "budget_tokens" else "requests")
