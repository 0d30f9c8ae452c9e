"""The fleet file's admission vocabulary: request classes, tenant budgets and per-class SLOs.

Used by `fleet_config` (the `admission:` block, and `budgets` / `slos` / `priority` /
`class_shares` on tenants); read by `slomax.config`, which fills in the defaults.
Example::

    admission:
      policy: slomax                   # or fcfs (admit everything, no queues)
      long_context_min_tokens: 8192    # prompts this long are long_context, not interactive
      classes:                         # the three defaults, tuned; or new classes
        long_context: {max_concurrency: 1.5}   # per ready instance
        premium: {ttft_s: 0.5, tpot_s: 0.03, share: 2}
      task_classes: {nightly-eval: batch}   # x-tokenfleet-task-type → class
    tenants:
      - name: acme
        api_key_sha256: ["..."]
        priority: 1
        budgets: {tokens_per_minute: 2000000, requests_per_minute: 600, concurrent_streams: 64}
        slos: {interactive: {ttft_s: 0.8}}
        class_shares: {long_context: 0.5}
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fleetcore.slo import DEFAULT_SLOS, ClassSLO

CLASS_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ClassSLOConfig(_Strict):
    """Latency bounds of one request class, seconds; a bound left out is not checked."""

    ttft_s: float | None = Field(default=None, gt=0)
    tpot_s: float | None = Field(default=None, gt=0)
    deadline_s: float | None = Field(default=None, gt=0)


class BudgetConfig(_Strict):
    """A tenant's limits; one left out is unlimited. Over budget: 429 with Retry-After."""

    tokens_per_minute: int | None = Field(default=None, gt=0, description="input + output tokens")
    requests_per_minute: int | None = Field(default=None, gt=0)
    concurrent_streams: int | None = Field(default=None, gt=0, description="admitted, unfinished requests")


class AdmissionClassConfig(_Strict):
    """One request class: its SLO (default: fleetcore.slo) and how it shares capacity.

    Capacity here is the pool's prefill budget (prompt tokens per second SLOMax lets the
    engines take). `share`: relative weight when classes compete for it; `protected`:
    fraction of it the other classes may not take; `max_share`: cap on its fraction while
    other classes wait; `max_concurrency`: requests of the class in flight per ready
    instance; `order`: `fifo`, or `edf` (earliest deadline first); `max_queue`: queued
    requests beyond which new ones are turned away.
    """

    ttft_s: float | None = Field(default=None, gt=0)
    tpot_s: float | None = Field(default=None, gt=0)
    deadline_s: float | None = Field(default=None, gt=0)
    share: float | None = Field(default=None, gt=0)
    protected: float | None = Field(default=None, ge=0, le=1)
    max_share: float | None = Field(default=None, gt=0, le=1)
    max_concurrency: float | None = Field(default=None, gt=0)
    order: Literal["fifo", "edf"] | None = None
    max_queue: int | None = Field(default=None, ge=0)


class AdmissionConfig(_Strict):
    """The `admission:` block. Left out: SLOMax with the default classes, and tenants without
    budgets are unlimited, so an existing fleet file keeps admitting whatever the fleet can serve."""

    policy: Literal["slomax", "fcfs"] = "slomax"
    classes: dict[str, AdmissionClassConfig] = Field(default_factory=dict)
    long_context_min_tokens: int = Field(default=8192, gt=0)
    long_output_tokens: int | None = Field(default=None, gt=0,
                                           description="an output budget this large makes a request long_context")
    task_classes: dict[str, str] = Field(default_factory=dict, description="x-tokenfleet-task-type → class")
    report_window_s: float = Field(default=60.0, gt=0, description="goodput ledger window")
    feedback: bool = Field(default=True, description="let the controller tune limits and shares")

    @model_validator(mode="after")
    def _consistent(self) -> AdmissionConfig:
        for name in self.classes:
            if not CLASS_NAME.match(name):
                raise ValueError(f"classes: bad class name {name!r} (letters, digits, '_', '.', '-')")
        known = self.class_names
        for task, cls in self.task_classes.items():
            if cls not in known:
                raise ValueError(f"task_classes[{task}]: unknown class {cls!r} (known: {sorted(known)})")
        protected = sum(c.protected or 0.0 for c in self.classes.values())
        if protected > 1.0:
            raise ValueError(f"classes: protected fractions add up to {protected:g}, more than 1")
        return self

    @property
    def class_names(self) -> set[str]:
        return set(DEFAULT_SLOS) | set(self.classes)

    def slos(self) -> dict[str, ClassSLO]:
        """The fleet's SLO map: every class's bounds, the fleet file's over the defaults (a bound
        it leaves out keeps the default's; a new class has only the bounds it sets). One map,
        built here, for everything that judges or plans by SLO — admission, FleetMind's spill
        rule, the planner's goodput, the simulator's reports — so they all agree."""
        out = dict(DEFAULT_SLOS)
        for name, c in self.classes.items():
            out[name] = out.get(name, ClassSLO()).overridden(c.ttft_s, c.tpot_s, c.deadline_s)
        return out


class _TenantLike(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def default_class(self) -> str: ...
    @property
    def slos(self) -> Mapping[str, ClassSLOConfig]: ...
    @property
    def class_shares(self) -> Mapping[str, float]: ...


def check_tenant_classes(admission: AdmissionConfig, tenants: Iterable[_TenantLike]) -> list[str]:
    """Errors for tenants that name classes the fleet does not define."""
    known = admission.class_names
    errors: list[str] = []
    for t in tenants:
        where = f"tenant {t.name!r}"
        if t.default_class not in known:
            errors.append(f"{where}: default_class {t.default_class!r} is not a class "
                          f"(known: {sorted(known)}; define it under admission.classes)")
        for field, names in (("slos", t.slos), ("class_shares", t.class_shares)):
            unknown = sorted(set(names) - known)
            if unknown:
                errors.append(f"{where}: {field} names unknown class(es) {unknown} (known: {sorted(known)})")
        for cls, w in t.class_shares.items():
            if not w > 0:
                errors.append(f"{where}: class_shares[{cls}] must be > 0, got {w}")
    return errors
