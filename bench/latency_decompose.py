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

import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without installing

import numpy as np  # noqa: E402

from bench.latency_recorder import arguments, run_recorded  # noqa: E402
from engine_adapters.sim import engine as sim_engine  # noqa: E402

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


def err(pred: np.ndarray, obs: np.ndarray) -> str:
    e = 100 * np.abs(pred - obs) / np.maximum(obs, 1e-9)
    return f"{np.median(e):.0f}% | {np.percentile(e, 90):.0f}%"


def main(argv: Sequence[str] | None = None) -> int:
    a = arguments(__doc__, argv)
    _instrument()
    router = run_recorded(a)
    got = [(x.held, x.at, x.detail["queue_s"], x.detail["prefill_s"], x.detail["prior_ttft_s"],
            x.detail.get("forward_ttft_s", float("nan")), x.outcome.ttft_s, ADMITTED[x.request_id], FIRST[x.request_id])
           for x in router.rows
           if x.outcome.ok and x.outcome.ttft_s and x.request_id in ADMITTED and x.request_id in FIRST]
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
