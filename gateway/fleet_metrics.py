"""Prometheus figures of the fleet and of FleetMind's planner, read at scrape time.

    tokenfleet_replicas{site,model,version,state}    ready starting draining unready
    tokenfleet_site_probe_rtt_ms{site}                lowest recent health-probe round trip
    tokenfleet_engine_restarts_total{instance,site,model}  dead engines started again by their adapter
    tokenfleet_planner_decisions_total{kind}          plan apply keep rollback
    tokenfleet_planner_actions_total{kind}            start ready drain stop failed skipped
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.fleet_state import FleetState
from gateway.placement import PlacementLoop

_STATES = ("ready", "starting", "draining", "unready")


class FleetCollector(Collector):
    def __init__(self, state: FleetState, placement: PlacementLoop | None) -> None:
        self.state = state
        self.placement = placement

    def collect(self) -> Iterator[Metric]:
        replicas = GaugeMetricFamily("tokenfleet_replicas", "Engine instances by site, model, version and state",
                                     labels=["site", "model", "version", "state"])
        for (site, model, version), c in sorted(self.state.pools().items()):
            for st in _STATES:
                replicas.add_metric([site, model, version, st], getattr(c, st))
        rtt = GaugeMetricFamily("tokenfleet_site_probe_rtt_ms", "Lowest recent health-probe round trip to a site",
                                labels=["site"])
        for site, ms in sorted(self.state.probe_rtt_ms().items()):
            rtt.add_metric([site], ms)
        restarts = CounterMetricFamily("tokenfleet_engine_restarts",
                                       "Engine processes that died and were started again by their adapter",
                                       labels=["instance", "site", "model"])
        for adapter in self.state.adapters:
            site, model = str(getattr(adapter, "site", "")), str(getattr(adapter, "model", ""))
            for iid, n in sorted(adapter.restart_counts().items()):
                restarts.add_metric([iid, site, model], n)
        yield from (replicas, rtt, restarts)
        if self.placement is None:
            return
        decisions = CounterMetricFamily("tokenfleet_planner_decisions", "The placement planner's decisions",
                                        labels=["kind"])
        for kind, n in sorted(Counter(e.kind for e in self.placement.core.planner.log).items()):
            decisions.add_metric([kind], n)
        actions = CounterMetricFamily("tokenfleet_planner_actions", "Steps carrying out the planner's moves",
                                      labels=["kind"])
        for kind, n in sorted(self.placement.core.action_counts.items()):
            actions.add_metric([kind], n)
        yield from (decisions, actions)
