"""Where TokenPilot's TTFT prediction goes wrong, on the simulator: hold, engine queue, or prefill.

    .venv/bin/python bench/latency_decompose.py TRACE [--fleet FILE] [--rate-scale X] [--max-requests N]
        [--admission fcfs|slomax]

Runs TokenPilot as `latency_error.py` does and, for every request, splits what it got into
the time admission held it before dispatch, the engine queue (dispatch to the engine step
that first schedules it, the network hop included) and its prefill span (that step to its
first token), against the cost model's queue and prefill seconds at the decision. Then it
swaps one predicted part for the truth at a time: the part whose swap removes most of the
error is where the model is wrong. The engine's admissions are seen by wrapping
`SimEngine.step` (a benchmark's instrument, not the simulator's API). Runs on versions
without the forward model too (those columns then read nan).
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

from engine_adapters.sim import engine as sim_engine  # noqa: E402
from fleetcore.fleet_config import load_fleet_file  # noqa: E402
from fleetcore.types import RequestOutcome, RequestProfile  # noqa: E402
from fleetsim.cli import DEFAULT_SIM_FLEET  # noqa: E402
from fleetsim.simulator import FleetSimulator, HashCache, fleet_instances, prepare, spec_prior  # noqa: E402
from slomax import from_fleet as slomax_config  # noqa: E402
from slomax import make_admission  # noqa: E402
from tokenpilot.router import TokenPilot  # noqa: E402

ADMITTED: dict[str, float] = {}  # engine request id -> start of the step that first scheduled it
FIRST: dict[str, float] = {}  # ... -> end of the step that made its first token


def _instrument() -> None:
    step = sim_engine.SimEngine.step

    def watched(self: sim_engine.SimEngine, now: float) -> sim_engine.StepResult:
        head = [r.rid for r in list(self._waiting)[:64]]
        before = len(self._waiting)
        res = step(self, now)
        for rid in head[:max(0, before - len(self._waiting))]:  # FCFS: they leave from the head
            ADMITTED.setdefault(rid, now)
        for ev in res.events:
            if ev.first_token:
                FIRST.setdefault(ev.request_id, now + res.duration)
        return res

    sim_engine.SimEngine.step = watched  # type: ignore[method-assign]


class Recorder(TokenPilot):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.rows: list[tuple[Any, ...]] = []
        self._at: dict[str, tuple[float, ...]] = {}

    def route(self, profile: RequestProfile, candidates: Any, now: float) -> Any:
        d = super().route(profile, candidates, now)
        c = next((c for c in d.candidates if c.name == d.instance_id), None)
        if c is not None:
            held = max(0.0, now - profile.arrival) if profile.arrival > 0 else 0.0
            self._at[profile.request_id] = (held, now, c.detail["queue_s"], c.detail["prefill_s"],
                                            c.detail["prior_ttft_s"], c.detail.get("forward_ttft_s", float("nan")))
        return d

    def observe(self, outcome: RequestOutcome) -> None:
        p = self._at.pop(outcome.request_id, None)
        if p is not None and outcome.ok and outcome.ttft_s:
            self.rows.append((outcome.request_id, *p, outcome.ttft_s))
        super().observe(outcome)


def err(pred: np.ndarray, obs: np.ndarray) -> str:
    e = 100 * np.abs(pred - obs) / np.maximum(obs, 1e-9)
    return f"{np.median(e):.0f}% | {np.percentile(e, 90):.0f}%"


def main(argv: Sequence[str] | None = None) -> int:
    from workloads import head, load_trace, scale_rate

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--fleet", default=str(DEFAULT_SIM_FLEET))
    p.add_argument("--rate-scale", type=float, default=1.0)
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--admission", default="fcfs")
    a = p.parse_args(argv)
    _instrument()
    fleet = load_fleet_file(Path(a.fleet))
    wl = load_trace(a.trace)
    if a.max_requests:
        wl = head(wl, a.max_requests)
    inputs = prepare(scale_rate(wl, a.rate_scale).requests, fleet, hash_cache=HashCache())
    router = Recorder(seed=0)
    for spec in fleet_instances(fleet):
        router.register_instance(spec.instance_id, spec_prior(spec))
    FleetSimulator(fleet, router, admission=make_admission(a.admission, slomax_config(fleet))).run(inputs)
    got = [(*row[1:], ADMITTED[row[0]], FIRST[row[0]]) for row in router.rows
           if row[0] in ADMITTED and row[0] in FIRST]
    held, now, queue, prefill, physics, forward, ttft, admitted, first = np.array(got).T
    queue_obs, span_obs = admitted - now, first - admitted
    print(f"{len(got)} requests; held by admission: {100 * np.mean(held > 0):.0f}% "
          f"(P90 hold {np.percentile(held, 90):.2f} s)")
    print(f"median engine queue: predicted {1000 * np.median(queue):.0f} ms, got {1000 * np.median(queue_obs):.0f} ms; "
          f"median prefill span: predicted {1000 * np.median(prefill):.0f} ms, got {1000 * np.median(span_obs):.0f} ms")
    print("| TTFT predicted as | median err | P90 err |")
    print("|---|---:|---:|")
    print(f"| cost model (queue + prefill), hold left out | {err(physics, ttft)} |")
    print(f"| held + cost model | {err(held + physics, ttft)} |")
    print(f"| held + true engine queue + predicted prefill | {err(held + queue_obs + prefill, ttft)} |")
    print(f"| held + predicted queue + true prefill span | {err(held + queue + span_obs, ttft)} |")
    print(f"| held + scheduler-forward | {err(held + forward, ttft)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
