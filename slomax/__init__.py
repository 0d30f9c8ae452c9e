"""SLOMax: class-based admission with tenant budgets, early rejection and goodput feedback (pure policy).

    config      classes, tenants and knobs (defaults; `from_fleet` reads the fleet file)
    classify    request → class (explicit, task type, length, output budget, tenant default)
    budgets     token buckets (tokens/min, requests/min) and concurrent streams per tenant
    queues      per-class queues, the prefill budget with shares, protected capacity, caps, EDF
    valve       prefill not yet through per instance, and each instance's measured speed
    predict     exponentially weighted means (service times, prefix hit rates)
    ledger      goodput per tenant x class x window (rejected and abandoned count against)
    controller  bounded-step feedback on the prefill budget, the valve and the long-context cap
    admission   the SLOMax policy object (admit / poll / observe / cancel / on_*)
    fcfs        admit-all baseline with the same ledger

No I/O and no clock: the gateway and the simulator pass `now` in.
"""

from slomax.admission import SLOMax
from slomax.classify import Classification, UnknownClass, classify
from slomax.config import ClassPolicy, Knobs, SLOMaxConfig, TenantPolicy, from_fleet
from slomax.fcfs import FCFS
from slomax.ledger import GoodputLedger, LedgeredAdmission

ADMISSION_NAMES: tuple[str, ...] = ("fcfs", "slomax")


def make_admission(name: str, config: SLOMaxConfig | None = None) -> SLOMax | FCFS:
    """A fresh admission policy by name (`fcfs` or `slomax`)."""
    if name == "slomax":
        return SLOMax(config)
    if name == "fcfs":
        return FCFS(config)
    raise ValueError(f"unknown admission policy {name!r} (known: {', '.join(ADMISSION_NAMES)})")


__all__ = [
    "ADMISSION_NAMES",
    "FCFS",
    "ClassPolicy",
    "Classification",
    "GoodputLedger",
    "Knobs",
    "LedgeredAdmission",
    "SLOMax",
    "SLOMaxConfig",
    "TenantPolicy",
    "UnknownClass",
    "classify",
    "from_fleet",
    "make_admission",
]
