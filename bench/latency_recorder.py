"""TokenPilot on the simulator, keeping what it predicted for each chosen instance: the shared
part of `latency_error.py` and `latency_decompose.py` (each reads its own columns from
`Recorded.detail` and picks its own requests from the outcomes).

The simulator runs TokenPilot as `fleetsim.cli` does (the learned model refitted in virtual
time, every `LearnedLatency.refit_every` outcomes; FleetMind choosing the site, as
`tokenfleet simulate`'s default placement: on a fleet of several sites the run, and so its
goodput, is the simulate command's, since i19-unify). To run either script in an older
checkout, copy this file there beside it.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetcore.fleet_config import load_fleet_file
from fleetcore.types import RequestOutcome, RequestProfile
from fleetsim.cli import DEFAULT_SIM_FLEET
from fleetsim.simulator import FleetSimulator, HashCache, fleet_instances, prepare, spec_prior
from slomax import from_fleet as slomax_config
from slomax import make_admission
from tokenpilot.router import TokenPilot


@dataclass(frozen=True, slots=True)
class Recorded:
    """One routed request: its decision's view of the chosen instance, and what it got."""

    request_id: str
    held: float  # seconds admission held it before dispatch (known at dispatch)
    at: float  # virtual time of the decision
    detail: Mapping[str, float]  # the chosen candidate's cost terms (`Candidate.detail`)
    outcome: RequestOutcome
    region: str | None = None  # the client's region (the site's round trip from it: `network_s`)
    # the learned latency model's features of the chosen instance at the decision (`sk.O_FEATURES`
    # rows: queue, prefill, uncached/1e3, streams, context/1e6, ...); None where none was kept
    features: tuple[float, ...] | None = None


class Recorder(TokenPilot):
    """TokenPilot that keeps, per request, the chosen candidate's cost terms and the outcome,
    in the order the outcomes came."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.rows: list[Recorded] = []
        self.summary: Mapping[str, Any] = {}  # the run's metrics (`fleetsim.metrics.summarize_all`)
        self.fleet: Any = None  # the fleet file it ran (`run_recorded`)
        self._at: dict[str, tuple[float, float, Mapping[str, float]]] = {}
        self._region: dict[str, str | None] = {}
        self._features: dict[str, tuple[float, ...]] = {}

    def route(self, profile: RequestProfile, candidates: Any, now: float) -> Any:
        d = super().route(profile, candidates, now)
        c = next((c for c in d.candidates if c.name == d.instance_id), None)
        if c is not None:
            held = max(0.0, now - profile.arrival) if profile.arrival > 0 else 0.0
            # (with the router's own TTFT, the one the site was chosen by, and what the decision reports:
            # the same until `reported` says what the simulator took from `fleetmind.place`, since
            # i19-rtt that plus the round trip to the site)
            self._at[profile.request_id] = (held, now, {**c.detail, "decision_ttft_s": d.predicted_ttft_s,
                                                        "reported_ttft_s": d.predicted_ttft_s})
            self._region[profile.request_id] = profile.client_region
            f = self._inflight.get(profile.request_id)
            if f is not None:
                self._features[profile.request_id] = tuple(float(v) for v in f.features)
        return d

    def reported(self, request_id: str, ttft_s: float | None) -> None:
        """The TTFT the placed decision reports (what the simulator acts on: the first-byte deadline)."""
        p = self._at.get(request_id)
        if p is not None and ttft_s is not None:
            self._at[request_id] = (p[0], p[1], {**p[2], "reported_ttft_s": ttft_s})

    def observe(self, outcome: RequestOutcome) -> None:
        p = self._at.pop(outcome.request_id, None)
        if p is not None:
            self.rows.append(Recorded(outcome.request_id, *p, outcome, self._region.pop(outcome.request_id, None),
                                      self._features.pop(outcome.request_id, None)))
        super().observe(outcome)


class _ReportingSimulator(FleetSimulator):
    """The simulator, telling the Recorder what each placement reported (`fleetmind.place`'s
    `route.predicted_ttft_s`, which the simulator keeps for the first-byte deadline)."""

    def __init__(self, *args: Any, recorder: Recorder, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._recorder = recorder

    def _place(self, r: Any, *args: Any, **kw: Any) -> Any:
        out = super()._place(r, *args, **kw)
        if not isinstance(out, str):
            self._recorder.reported(r.inp.request_id, r.predicted_ttft)
        return out


def arguments(doc: str, argv: Sequence[str] | None) -> argparse.Namespace:
    """TRACE [--fleet FILE] [--rate-scale X] [--max-requests N] [--admission fcfs|slomax]
    [--placement fleetmind|home] [--live-shape RATE]."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--fleet", default=str(DEFAULT_SIM_FLEET))
    p.add_argument("--rate-scale", type=float, default=1.0)
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--admission", default="fcfs")
    p.add_argument("--placement", default="fleetmind", help="fleetmind (as `tokenfleet simulate`) or home")
    p.add_argument("--live-shape", type=float, default=None, metavar="RATE",
                   help="the workload of bench/latency_live.py's sim setup in virtual time: the trace's lengths "
                        "clipped as there, fresh text per request (nothing cached), arrivals evenly spaced at "
                        "RATE per second (--rate-scale then unused; with bench/fleet_noisy_sim.yaml, RATE = the "
                        "live rate x 0.25, the live workers' time_scale)")
    return p.parse_args(argv)


def live_shaped(trace: str, n: int, rate: float) -> list[Any]:
    """bench/latency_live.py's sim workload as trace rows: its first `n` requests' lengths clipped to
    the live setup's ranges, each prompt its own blocks (the live text is fresh per request), one
    arrival every 1 / `rate` seconds (its open-loop client)."""
    from bench.latency_live import sim_setup
    from workloads import head, load_trace
    from workloads.trace import TraceRequest

    setup = sim_setup()
    (lo, hi), (out_lo, out_hi) = setup.prompt_range, setup.output_range
    rows = []
    for i, r in enumerate(head(load_trace(trace), n).requests):
        tokens = min(max(r.input_length, lo), hi)
        ids = tuple(range(10**9 + 100 * i, 10**9 + 100 * i + (tokens + 511) // 512))
        rows.append(TraceRequest(1000 * i / rate, tokens, max(out_lo, min(r.output_length, out_hi)), ids))
    return rows


def run_recorded(a: argparse.Namespace) -> Recorder:
    """The trace (its first `max_requests`, rate scaled) through the simulator with a Recorder
    (the run's goodput and SLO attainment, as `tokenfleet simulate` reports them, in `router.summary`)."""
    from fleetsim.cli import make_placement
    from fleetsim.metrics import summarize_all
    from workloads import head, load_trace, scale_rate

    fleet = load_fleet_file(Path(a.fleet))
    if getattr(a, "live_shape", None):
        inputs = prepare(live_shaped(a.trace, a.max_requests or 1200, a.live_shape), fleet, hash_cache=HashCache())
    else:
        wl = load_trace(a.trace)
        if a.max_requests:
            wl = head(wl, a.max_requests)
        inputs = prepare(scale_rate(wl, a.rate_scale).requests, fleet, hash_cache=HashCache())
    router = Recorder(seed=0)
    for spec in fleet_instances(fleet):  # as fleetsim.cli.make_policy registers them
        router.register_instance(spec.instance_id, spec_prior(spec))
    res = _ReportingSimulator(fleet, router,
                              site_chooser=make_placement(getattr(a, "placement", "fleetmind"), fleet, router),
                              admission=make_admission(a.admission, slomax_config(fleet)), recorder=router).run(inputs)
    router.summary = summarize_all(res.records, fleet.admission.slos())
    router.fleet = fleet
    return router
