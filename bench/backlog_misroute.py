"""How often routing sends interactive requests onto a long prefill queue while another instance idles.

    .venv/bin/python bench/backlog_misroute.py TRACE [--fleet bench/fleet_slomax.yaml]
        [--rate-scale 1.3] [--hint on,off] [--max-requests N]

Runs TokenPilot behind SLOMax admission in the simulator, with and without SLOMax's
`avoid_instances` hint (off: a SLOMax whose hint is always empty), and at every routing
decision of an interactive request reads the engines' true state: the prompt tokens
queued for prefill (waiting, plus running prompts not through yet) on the chosen
instance and the fewest on any instance of the pool. A *misroute* is a decision whose
instance has over 8,192 tokens queued more than the best one. Prints one row per run:
goodput, SLO attainment, interactive attainment, misroutes and the median queued
tokens at the chosen instance over the misroutes (the "90k tokens" of bench/SLOMAX.md).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable from a checkout without installing

import numpy as np  # noqa: E402

from engine_adapters.sim.engine import SimEngine  # noqa: E402
from fleetcore.fleet_config import load_fleet_file  # noqa: E402
from fleetcore.policies import InstanceRouter  # noqa: E402
from fleetcore.types import InstanceSnapshot, RequestOutcome, RequestProfile, RouteDecision  # noqa: E402
from fleetsim.cli import make_policy  # noqa: E402
from fleetsim.metrics import summarize_all  # noqa: E402
from fleetsim.simulator import FleetSimulator, HashCache, prepare  # noqa: E402
from slomax import SLOMax  # noqa: E402
from slomax import from_fleet as slomax_config  # noqa: E402

MISROUTE_TOKENS = 8192


def queued_prefill_tokens(engine: SimEngine) -> int:
    """Prompt tokens an engine still has to prefill: waiting prompts, and running ones not through."""
    waiting = sum(r.known for r in engine._waiting)  # (a bench reads the simulated engine's insides)
    running = sum(r.known - r.num_computed for r in engine._running if r.num_output == 0)
    return waiting + running


class _NoHint(SLOMax):
    """SLOMax without its `avoid_instances` hint: what routing does on its own."""

    def _avoid(self, req: Any) -> tuple[str, ...]:
        return ()


class Watch(InstanceRouter):
    """Passes every call to the router and records, per interactive decision, the queued
    prefill of the chosen instance and the least queued one (engines' true state)."""

    def __init__(self, inner: InstanceRouter) -> None:
        self.inner = inner
        self.name = inner.name
        self.follows_kv_events = inner.follows_kv_events  # type: ignore[misc]
        self.engines: dict[str, SimEngine] = {}
        self.chosen: list[int] = []
        self.best: list[int] = []

    def route(self, profile: RequestProfile, candidates: Sequence[InstanceSnapshot], now: float) -> RouteDecision:
        d = self.inner.route(profile, candidates, now)
        if d.instance_id is not None and profile.request_class == "interactive" and self.engines:
            q = {c.instance_id: queued_prefill_tokens(self.engines[c.instance_id]) for c in candidates}
            self.chosen.append(q[d.instance_id])
            self.best.append(min(q.values()))
        return d

    def __getattribute__(self, name: str) -> Any:
        if name in ("route", "observe", "inner", "name", "follows_kv_events", "engines", "chosen", "best"):
            return object.__getattribute__(self, name)
        return getattr(object.__getattribute__(self, "inner"), name)

    def observe(self, outcome: RequestOutcome) -> None:
        self.inner.observe(outcome)


def run(trace: str, fleet_path: str, rate_scale: float, hint: bool, max_requests: int | None,
        policy: str = "tokenpilot") -> dict[str, Any]:
    from workloads import head, load_trace, scale_rate

    fleet = load_fleet_file(Path(fleet_path))
    wl = load_trace(trace)
    if max_requests:
        wl = head(wl, max_requests)
    wl = scale_rate(wl, rate_scale)
    inputs = prepare(wl.requests, fleet, hash_cache=HashCache())
    router = Watch(make_policy(policy, 0, fleet))
    admission = SLOMax(slomax_config(fleet)) if hint else _NoHint(slomax_config(fleet))
    sim = FleetSimulator(fleet, router, admission=admission)
    router.engines = {i.iid: i.engine for i in sim._insts}
    res = sim.run(inputs)
    s = summarize_all(res.records, fleet.admission.slos())
    chosen, best = np.array(router.chosen), np.array(router.best)
    mis = chosen - best > MISROUTE_TOKENS
    ic = s["by_class"].get("interactive", {})
    return {"policy": policy, "hint": "on" if hint else "off", "rate_scale": rate_scale,
            "goodput_tok_s": s["goodput_tok_s"], "slo": s["slo_attainment"],
            "interactive_slo": ic.get("slo_attainment"), "decisions": int(len(chosen)),
            "misroutes": int(mis.sum()),
            "misroute_median_queued": float(np.median(chosen[mis])) if mis.any() else 0.0,
            "wall_s": res.wall_s}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--fleet", default=str(REPO / "bench" / "fleet_slomax.yaml"))
    p.add_argument("--rate-scale", default="1.3", help="comma-separated")
    p.add_argument("--hint", default="on,off")
    p.add_argument("--policy", default="tokenpilot")
    p.add_argument("--max-requests", type=int, default=None)
    a = p.parse_args(argv)
    print("| policy | rate-scale | avoid hint | goodput tok/s | SLO % | interactive SLO % | interactive decisions "
          "| misroutes | median queued tokens at misroute |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for x in (float(v) for v in a.rate_scale.split(",")):
        for h in a.hint.split(","):
            r = run(a.trace, a.fleet, x, h == "on", a.max_requests, a.policy)
            print(f"| {r['policy']} | {x:g} | {r['hint']} | {r['goodput_tok_s']:,.0f} | {100 * r['slo']:.1f} "
                  f"| {100 * (r['interactive_slo'] or 0):.1f} | {r['decisions']} | {r['misroutes']} "
                  f"| {r['misroute_median_queued']:,.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
