"""Plain data the policies read and return: request profiles, fleet snapshots, decisions.

Policies (`tokenpilot`, `fleetmind`, `slomax`) see the world only through these
types; the gateway and the simulator both build them, so one policy object runs
unchanged in production and in a benchmark.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

# An instance's part in prefill/decode disaggregation; `mixed` (both, as today) is the one
# spelling in the fleet file and in code.
Role = Literal["mixed", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("mixed", "prefill", "decode")
AdmissionAction = Literal["admit", "reject", "queue"]


@dataclass(frozen=True, slots=True)
class RequestProfile:
    """What the gateway knows about a request before it runs anywhere."""

    request_id: str
    model: str
    prompt_tokens: int
    block_hashes: tuple[int, ...] = ()
    block_size: int = 16
    max_tokens: int | None = None  # a constraint on output length, not a prediction of it
    n: int = 1  # choices asked for: each may produce up to max_tokens (budgets charge n x max_tokens)
    model_version: str | None = None  # None: any ready version
    tenant: str = "anonymous"
    request_class: str | None = None  # None until admission classifies it
    task_type: str | None = None
    stream: bool = False
    client_region: str | None = None
    arrival: float = 0.0
    deadline: float | None = None

    def held_s(self, now: float) -> float:
        """Seconds between its arrival at the gateway and `now` (0 where the arrival is not known):
        at a dispatch, what admission held it (and the gateway's own parsing took) before it, part of
        the TTFT the client sees, no engine's time."""
        return max(0.0, now - self.arrival) if self.arrival > 0 else 0.0


@dataclass(frozen=True, slots=True)
class InstanceSnapshot:
    """One engine instance as the policies see it at a moment.

    `inflight` is what the gateway itself has sent and not yet seen finish; the
    engine-reported `num_running` / `num_waiting` lag by one scrape.
    """

    instance_id: str
    site: str
    model: str
    version: str
    url: str
    ready: bool = True
    draining: bool = False
    role: Role = "mixed"
    inflight: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    block_size: int = 16
    max_model_len: int = 8192


@dataclass(frozen=True, slots=True)
class SiteSnapshot:
    name: str
    region: str
    jurisdiction: str
    rtt_ms: Mapping[str, float]
    instances: tuple[InstanceSnapshot, ...] = ()
    # The round trip the gateway measured to this site (its health probes' lowest recent one,
    # `gateway.fleet_state`), ms; None where nothing measured it (the simulator, whose network is
    # the fleet file's `rtt_ms`). What a TTFT the gateway reports carries (`fleetmind.place`).
    probe_rtt_ms: float | None = None

    def pool(self, model: str, version: str | None = None) -> tuple[InstanceSnapshot, ...]:
        """Ready, non-draining instances serving `model` (and `version`, when given)."""
        return tuple(
            i for i in self.instances
            if i.model == model and i.ready and not i.draining
            and (version is None or i.version == version)
        )


@dataclass(frozen=True, slots=True)
class FleetView:
    sites: tuple[SiteSnapshot, ...]

    def site(self, name: str) -> SiteSnapshot:
        for s in self.sites:
            if s.name == name:
                return s
        raise KeyError(name)

    def instances(self) -> tuple[InstanceSnapshot, ...]:
        return tuple(i for s in self.sites for i in s.instances)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One option a policy weighed, kept for explanations (lower score is better)."""

    name: str
    score: float
    detail: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SiteDecision:
    site: str | None
    reason: str
    candidates: Sequence[Candidate] = ()


@dataclass(frozen=True, slots=True)
class RouteDecision:
    instance_id: str | None
    reason: str
    candidates: Sequence[Candidate] = ()
    predicted_ttft_s: float | None = None
    cached_tokens: int = 0
    # The round trip to the instance's site inside `predicted_ttft_s`: 0 from a router (its
    # prediction is of one instance's engine time); `fleetmind.place` adds the site's and says so here.
    network_s: float = 0.0
    # What the request had waited at the gateway when it was placed (`RequestProfile.held_s`: admission's
    # hold, parsing), set by `fleetmind.place`. Not in `predicted_ttft_s`, which is from the dispatch on
    # (what the first-byte deadline and the hedge's delay count from); in `ttft_from_arrival_s`.
    held_s: float = 0.0

    @property
    def ttft_from_arrival_s(self) -> float | None:
        """The TTFT the client sees from the request's arrival at the gateway: the time already held
        (known at the decision) plus the prediction from the dispatch on. What the response reports
        (`x-tokenfleet-predicted-ttft-ms`): leaving the hold out under-predicted every held request
        by all of it (live at 40/s, most of the error: bench/ROUTING.md, "i19-arrive")."""
        return None if self.predicted_ttft_s is None else self.held_s + self.predicted_ttft_s


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """What happened to a routed request; fed back to every policy's `observe`."""

    request_id: str
    instance_id: str
    site: str
    ok: bool
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    mean_tpot_s: float | None = None
    e2e_s: float | None = None
    error: str | None = None
    cancelled: bool = False
    # The network round trip between the gateway and the instance's site inside `ttft_s` (the
    # request's way there and its first token's way back): no engine step's time, so a router
    # learning engine speeds from TTFT leaves it out (0: not known, or in-site). The simulator's
    # is the fleet file's figure; the live gateway's what its health probes measured to the site.
    network_s: float = 0.0


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    """What admission says about one request; the gateway and the simulator act on it alike.

    "admit": dispatch now; "queue": the admission policy holds it and releases it later
    (a decision with `request_id` set, from its `poll`); "reject": end it with `reason`.
    `code` is machine-readable (e.g. `budget_tokens`, `slo_unattainable`), `retry_after_s`
    when a retry can be expected to succeed, `request_class` as admission classified it.
    """

    action: AdmissionAction
    reason: str = ""
    request_class: str | None = None
    code: str | None = None
    retry_after_s: float | None = None
    request_id: str | None = None
    # "admit", but not onto these instances: admission knows their queued prefill would
    # make this request miss its SLO there. Routing skips them (unless that leaves nothing).
    avoid_instances: tuple[str, ...] = ()
