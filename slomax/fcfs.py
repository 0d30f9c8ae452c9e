"""FCFS: admit everything, at once, in arrival order — the gateway without admission control.

It still classifies and books every request in a goodput ledger, so the reports and
metrics read the same under either policy and a comparison is like for like.
"""

from __future__ import annotations

from typing import Any

from fleetcore.types import AdmissionDecision, FleetView, RequestOutcome, RequestProfile

from .admission import judge, met_slo, request_deadline
from .classify import Classification, UnknownClass, classify_profile
from .config import SLOMaxConfig
from .ledger import GoodputLedger, LedgeredAdmission


class FCFS(LedgeredAdmission):
    name = "fcfs"
    holds_queue = True  # it never queues; hook-owned mode is how the gateway runs it too

    def __init__(self, config: SLOMaxConfig | None = None) -> None:
        self.config = config or SLOMaxConfig()
        self.ledger = GoodputLedger(self.config.window_s)
        self._reqs: dict[str, tuple[str, str, float, float | None]] = {}  # id -> tenant, class, arrival, deadline

    def classify(self, profile: RequestProfile) -> Classification:
        return classify_profile(profile, self.config)

    @property
    def class_names(self) -> list[str]:
        return sorted(self.config.classes)

    def admit(self, profile: RequestProfile, view: FleetView, now: float) -> AdmissionDecision:
        try:
            cls = self.classify(profile).request_class
        except UnknownClass as e:
            return AdmissionDecision("reject", str(e), None, "unknown_class")
        self.ledger.arrived(profile.tenant, cls, profile.arrival)
        self.ledger.admitted(profile.tenant, cls, profile.arrival)
        slo = self.config.slo(profile.tenant, cls)
        deadline = request_deadline(slo, profile)
        self._reqs[profile.request_id] = (profile.tenant, cls, profile.arrival, deadline)
        return AdmissionDecision("admit", "", cls)

    def note_retry(self, request_id: str) -> None:
        r = self._reqs.get(request_id)
        if r is not None:
            self.ledger.retried(r[0], r[1], r[2])

    def observe(self, outcome: RequestOutcome) -> None:
        r = self._reqs.pop(outcome.request_id, None)
        if r is None:
            return
        tenant, cls, arrival, deadline = r
        if outcome.cancelled:
            self.ledger.cancelled(tenant, cls, arrival, outcome.output_tokens)
        elif not outcome.ok:
            self.ledger.failed(tenant, cls, arrival, outcome.output_tokens)
        else:
            met = met_slo(self.config.slo(tenant, cls), outcome, arrival, deadline)
            self.ledger.completed(tenant, cls, arrival, outcome.output_tokens, met)

    def judge(self, profile: RequestProfile, outcome: RequestOutcome) -> bool:
        return judge(self.config, profile, outcome)

    def snapshot(self, now: float) -> dict[str, Any]:
        return {"policy": self.name, "pools": {}, "tenants": {}}
