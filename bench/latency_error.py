"""How well TokenPilot predicts TTFT and TPOT: its predictions at each decision against what the request got.

    .venv/bin/python bench/latency_error.py TRACE [--fleet FILE] [--rate-scale X] [--max-requests N]
        [--admission fcfs|slomax]

Runs TokenPilot in the simulator (virtual time; the learned model is refitted there as the
gateway's background task would, every `LearnedLatency.refit_every` outcomes) and prints the
median and P90 absolute percentage error of the predicted TTFT and TPOT of the chosen instance
against the observed ones, for the cost model's physics (its queue + prefill seconds), the
scheduler-forward prior (`tokenpilot.forward`) and the learned model over it (what the
decision reports), over all requests and over the second half of the run (once the model
has data).

A prediction is made at dispatch, of the time from dispatch to the first token; a request
held by admission before it has waited `held` seconds already, which is known at dispatch.
"TTFT" columns compare held + prediction with the TTFT the request got (from its arrival,
the issue's measure); "after dispatch" columns compare the prediction with TTFT - held
(smaller denominators: the stricter measure). TPOT is the request's mean time per output token.
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

from fleetcore.fleet_config import load_fleet_file  # noqa: E402
from fleetcore.types import RequestOutcome, RequestProfile  # noqa: E402
from fleetsim.cli import DEFAULT_SIM_FLEET  # noqa: E402
from fleetsim.simulator import FleetSimulator, HashCache, fleet_instances, prepare, spec_prior  # noqa: E402
from slomax import make_admission  # noqa: E402
from slomax import from_fleet as slomax_config  # noqa: E402
from tokenpilot.router import TokenPilot  # noqa: E402


class Recorder(TokenPilot):
    """TokenPilot that keeps, per request, its predictions for the chosen instance and the outcome."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.rows: list[tuple[float, ...]] = []
        self._pred: dict[str, tuple[float, ...]] = {}

    def route(self, profile: RequestProfile, candidates: Any, now: float) -> Any:
        d = super().route(profile, candidates, now)
        c = next((c for c in d.candidates if c.name == d.instance_id), None)
        if c is not None:
            held = max(0.0, now - profile.arrival) if profile.arrival > 0 else 0.0
            self._pred[profile.request_id] = (c.detail["prior_ttft_s"], c.detail.get("forward_ttft_s", float("nan")),
                                              c.detail["predicted_ttft_s"], c.detail["prior_tpot_s"],
                                              c.detail["tpot_s"], held)
        return d

    def observe(self, outcome: RequestOutcome) -> None:
        p = self._pred.pop(outcome.request_id, None)
        if p is not None and outcome.ok and outcome.ttft_s and outcome.mean_tpot_s and outcome.output_tokens > 1:
            self.rows.append((*p, outcome.ttft_s, outcome.mean_tpot_s))
        super().observe(outcome)


def errors(pred: np.ndarray, obs: np.ndarray) -> tuple[float, float]:
    e = 100 * np.abs(pred - obs) / obs
    return float(np.median(e)), float(np.percentile(e, 90))


def main(argv: Sequence[str] | None = None) -> int:
    from workloads import head, load_trace, scale_rate

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--fleet", default=str(DEFAULT_SIM_FLEET))
    p.add_argument("--rate-scale", type=float, default=1.0)
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--admission", default="fcfs")
    a = p.parse_args(argv)
    fleet = load_fleet_file(Path(a.fleet))
    wl = load_trace(a.trace)
    if a.max_requests:
        wl = head(wl, a.max_requests)
    inputs = prepare(scale_rate(wl, a.rate_scale).requests, fleet, hash_cache=HashCache())
    router = Recorder(seed=0)
    for spec in fleet_instances(fleet):  # as fleetsim.cli.make_policy registers them
        router.register_instance(spec.instance_id, spec_prior(spec))
    FleetSimulator(fleet, router, admission=make_admission(a.admission, slomax_config(fleet))).run(inputs)
    r = np.array(router.rows)
    held, ttft, tpot = r[:, 5], r[:, 6], r[:, 7]
    print(f"{len(r)} requests ({100 * np.mean(held > 0):.0f}% held by admission); learned model fitted: "
          f"TTFT {router.latency.ttft is not None}, TPOT {router.latency.tpot is not None}")
    print("| model | requests | TTFT median err | TTFT P90 err | after dispatch median | after dispatch P90 "
          "| TPOT median err | TPOT P90 err |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, rows in (("all", slice(None)), ("second half", slice(len(r) // 2, None))):
        for name, ti, pi in (("cost model physics", 0, 3), ("scheduler-forward prior", 1, 3), ("learned", 2, 4)):
            tm, t90 = errors(held[rows] + r[rows, ti], ttft[rows])
            dm, d90 = errors(r[rows, ti], np.maximum(ttft[rows] - held[rows], 1e-6))
            pm, p90 = errors(r[rows, pi], tpot[rows])
            print(f"| {name} ({label}) | {len(r[rows])} | {tm:.0f}% | {t90:.0f}% | {dm:.0f}% | {d90:.0f}% "
                  f"| {pm:.0f}% | {p90:.0f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
