"""SLOMax's settings: request classes, tenants, and the knobs the controller starts from.

Plain frozen data. `from_fleet` reads a fleet file's `admission:` block and tenants and
fills in the defaults; tests and the simulator build `SLOMaxConfig` directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from fleetcore.fleet_config import FleetConfig
from fleetcore.slo import (
    BATCH,
    DEFAULT_SLOS,
    INTERACTIVE,
    LONG_CONTEXT,
    LONG_CONTEXT_MIN_TOKENS,
    ClassSLO,
)

Order = Literal["fifo", "edf"]


@dataclass(frozen=True, slots=True)
class ClassPolicy:
    """One request class. "Capacity" is the pool's prefill budget (prompt tokens per second)."""

    name: str
    slo: ClassSLO
    share: float = 1.0  # weight when classes compete for the prefill budget
    protected: float = 0.0  # fraction of the budget other classes may not take from this one
    max_share: float = 1.0  # cap on this class's fraction of the budget while others wait
    max_concurrency: float | None = None  # in flight per ready instance (None: no cap)
    order: Order = "fifo"
    max_queue: int = 10_000
    rank: int = 1  # tie-break between classes, lower first


# Interactive gets most of a contended budget and a reserve nobody else may take, so a
# chat arriving at a busy fleet starts at once; long prompts are capped in concurrency so
# their prefills cannot freeze everyone's streams; batch has a small guaranteed share
# (its deadlines) and otherwise soaks up what the others leave idle.
DEFAULT_CLASSES: Mapping[str, ClassPolicy] = {
    INTERACTIVE: ClassPolicy(INTERACTIVE, DEFAULT_SLOS[INTERACTIVE], share=6.0, protected=0.2, rank=0),
    LONG_CONTEXT: ClassPolicy(LONG_CONTEXT, DEFAULT_SLOS[LONG_CONTEXT], share=3.0, max_share=0.5,
                              max_concurrency=2.0, rank=1),
    BATCH: ClassPolicy(BATCH, DEFAULT_SLOS[BATCH], share=1.0, order="edf", rank=2),
}


@dataclass(frozen=True, slots=True)
class Budgets:
    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None
    concurrent_streams: int | None = None

    @property
    def unlimited(self) -> bool:
        return self.tokens_per_minute is None and self.requests_per_minute is None \
            and self.concurrent_streams is None


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    name: str
    default_class: str = INTERACTIVE
    priority: int = 0
    budgets: Budgets = field(default_factory=Budgets)
    slos: Mapping[str, ClassSLO] = field(default_factory=dict)  # overrides of the class SLO
    class_shares: Mapping[str, float] = field(default_factory=dict)

    def share(self, request_class: str) -> float:
        return self.class_shares.get(request_class, 1.0)


@dataclass(frozen=True, slots=True)
class Knobs:
    """Starting points of what the controller tunes, and the fixed safety valves.

    The prefill budget is in uncached prompt tokens per second per ready instance. It
    starts unlimited (None): until admitted work misses its TPOT SLO there is nothing to
    protect, and SLOMax knows nothing about the hardware; the controller then starts it
    from the rate the engines were really taking and tunes it from there.
    """

    prefill_rate: float | None = None
    prefill_rate_min: float = 50.0
    prefill_rate_max: float = 1e7
    burst_s: float = 2.0  # the budget holds this many seconds of it
    engine_wait_s: float = 0.25  # the valve's starting target: an engine starts a new prefill within this
    kv_high_water: float = 0.96  # an instance above this takes no new work from admission
    reject_slack: float = 1.0  # reject early when predicted TTFT > slack x SLO
    default_output_tokens: int = 256  # budget charge when a request sets no max_tokens
    control_interval_s: float = 5.0
    usage_tau_s: float = 10.0  # memory of who took the budget, for shares


@dataclass(frozen=True, slots=True)
class SLOMaxConfig:
    classes: Mapping[str, ClassPolicy] = field(default_factory=lambda: dict(DEFAULT_CLASSES))
    tenants: Mapping[str, TenantPolicy] = field(default_factory=dict)
    long_context_min_tokens: int = LONG_CONTEXT_MIN_TOKENS
    long_output_tokens: int | None = None
    task_classes: Mapping[str, str] = field(default_factory=dict)
    window_s: float = 60.0  # goodput ledger window
    feedback: bool = True
    knobs: Knobs = field(default_factory=Knobs)

    def tenant(self, name: str) -> TenantPolicy:
        t = self.tenants.get(name)
        return t if t is not None else TenantPolicy(name)

    # What the hot path reads of a tenant, without building the TenantPolicy of a tenant the
    # config does not name (a frozen dataclass and its Budgets: ~3 us, several times a request).

    def default_class(self, tenant: str) -> str:
        """`tenant(tenant).default_class`."""
        t = self.tenants.get(tenant)
        return t.default_class if t is not None else ANY_TENANT.default_class

    def share(self, tenant: str, request_class: str) -> float:
        """`tenant(tenant).share(request_class)`."""
        t = self.tenants.get(tenant)
        return (t if t is not None else ANY_TENANT).share(request_class)

    def slo(self, tenant: str, request_class: str) -> ClassSLO:
        t = self.tenants.get(tenant)
        if t is not None and request_class in t.slos:
            return t.slos[request_class]
        c = self.classes.get(request_class)
        return c.slo if c is not None else ClassSLO()

    def slos_for(self, tenant: str) -> dict[str, ClassSLO]:
        return {c: self.slo(tenant, c) for c in self.classes}


ANY_TENANT = TenantPolicy("")  # what `SLOMaxConfig.tenant` gives a tenant it does not name, but the name


def from_fleet(fleet: FleetConfig, knobs: Knobs | None = None) -> SLOMaxConfig:
    """The fleet file's admission settings over SLOMax's defaults."""
    adm = fleet.admission
    fleet_slos = adm.slos()  # the fleet's SLO map, the one FleetMind and the reports use too
    classes = dict(DEFAULT_CLASSES)
    for name, c in adm.classes.items():
        base = classes.get(name) or ClassPolicy(name, ClassSLO(), rank=1)
        classes[name] = replace(
            base, slo=fleet_slos[name],
            share=c.share if c.share is not None else base.share,
            protected=c.protected if c.protected is not None else base.protected,
            max_share=c.max_share if c.max_share is not None else base.max_share,
            max_concurrency=c.max_concurrency if c.max_concurrency is not None else base.max_concurrency,
            order=c.order or base.order, max_queue=c.max_queue if c.max_queue is not None else base.max_queue)
    tenants: dict[str, TenantPolicy] = {}
    for t in fleet.tenants:
        b = t.budgets
        slos = {cls: classes[cls].slo.overridden(s.ttft_s, s.tpot_s, s.deadline_s) for cls, s in t.slos.items()}
        tenants[t.name] = TenantPolicy(
            t.name, t.default_class, t.priority,
            Budgets(b.tokens_per_minute, b.requests_per_minute, b.concurrent_streams) if b else Budgets(),
            slos, dict(t.class_shares))
    return SLOMaxConfig(classes=classes, tenants=tenants, long_context_min_tokens=adm.long_context_min_tokens,
                        long_output_tokens=adm.long_output_tokens, task_classes=dict(adm.task_classes),
                        window_s=adm.report_window_s, feedback=adm.feedback, knobs=knobs or Knobs())
