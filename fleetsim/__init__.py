"""FleetSim: the discrete-event fleet simulator and benchmark harness (`tokenfleet simulate`).

Replays a workload through the production policy objects (admission hook, site
chooser, instance router) in front of simulated engines in virtual time, and
reports latency, throughput, goodput and SLO attainment per policy.

    simulator  FleetSimulator, prepare, estimate_capacity, the Admission hook
    metrics    RequestRecord and the metric arithmetic (pure, numpy)
    report     the --json document, the stdout table, the TTFT CDF plot
    cli        add_simulate_parser / run_simulate / main
"""

from fleetsim.metrics import RequestRecord, slo_met, summarize, summarize_all
from fleetsim.simulator import (
    Admission,
    AdmissionDecision,
    AdmitAll,
    FleetSimulator,
    HashCache,
    SimInput,
    SimResult,
    estimate_capacity,
    fleet_instances,
    prepare,
    simulate,
)

__all__ = [
    "Admission", "AdmissionDecision", "AdmitAll", "FleetSimulator", "HashCache", "RequestRecord", "SimInput",
    "SimResult", "estimate_capacity", "fleet_instances", "prepare", "simulate", "slo_met", "summarize",
    "summarize_all",
]
