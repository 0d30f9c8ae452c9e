"""Does TokenPilot's own-decode term predict the time per token a request gets? Per routing-table row.

    .venv/bin/python bench/tpot_predict.py GEN_DIR --rows "chat-60 azure-conv-60 agent-60" [--max 2000] [--min-out 50]

The cost ranks candidates partly by the request's own decode there, `decode_weight` x the mean answer
x the predicted time per token (`prior_tpot_s`, the kernel's `O_OWN_STEP`: the decode step stretched by
the instance's recent prefill duty). Per row this runs TokenPilot (seed 0; `latency_recorder`, as
`tokenfleet simulate` runs it) and, over the requests with at least `--min-out` output tokens, fits the
TPOT each got on its chosen instance against what the decision saw: the predicted time per token, the
streams there and their context (the latency model's features). Columns: the observed TPOT's mean and
standard deviation, the prediction's 5-95% range, the fitted slope (observed ms per predicted ms; 1 for a
calibrated predictor) and R^2 of each. GEN_DIR holds routing_tables.sh's chat.jsonl / agent.jsonl.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable from a checkout without installing
sys.path.insert(0, str(REPO / "bench"))

from fleetsim.cli import DEFAULT_SIM_FLEET  # noqa: E402
from latency_recorder import Recorded, run_recorded  # noqa: E402
from ranking_ab import table_rows  # noqa: E402

F_STREAMS, F_CONTEXT = 3, 4  # positions in `Recorded.features` (streams, context / 1e6)


def fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(R^2, slope of the first column) of the least-squares fit of y on x's columns and a constant."""
    a = np.c_[x, np.ones(len(y))]
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    res = y - a @ coef
    return (1.0 - float(res.var() / y.var()) if y.var() > 0 else 0.0), float(coef[0])


def table(rows: Sequence[Recorded], min_out: int) -> dict[str, float]:
    """The figures of one run from its recorded decisions (see the module doc)."""
    keep = [r for r in rows if r.outcome.ok and r.outcome.mean_tpot_s is not None and r.features is not None
            and r.outcome.output_tokens >= min_out]
    y = np.array([1e3 * r.outcome.mean_tpot_s for r in keep])  # type: ignore[operator]
    pred = np.array([1e3 * r.detail["prior_tpot_s"] for r in keep])
    streams = np.array([r.features[F_STREAMS] for r in keep])  # type: ignore[index]
    context = np.array([1e3 * r.features[F_CONTEXT] for r in keep])  # type: ignore[index]  (k tokens)
    r2_pred, slope = fit(pred[:, None], y)
    r2_streams, _ = fit(streams[:, None], y)
    r2_both, _ = fit(np.c_[streams, context], y)
    lo, hi = np.percentile(pred, [5, 95])
    return {"n": len(y), "mean": float(y.mean()), "sd": float(y.std()), "lo": float(lo), "hi": float(hi),
            "slope": slope, "r2_pred": r2_pred, "r2_streams": r2_streams, "r2_both": r2_both}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("gen_dir")
    p.add_argument("--rows", required=True)
    p.add_argument("--max", type=int, default=2000)
    p.add_argument("--min-out", type=int, default=50)
    p.add_argument("--fleet", default=str(DEFAULT_SIM_FLEET))
    a = p.parse_args(argv)
    want = set(a.rows.split())
    print("| row | requests | observed TPOT ms mean / sd | predicted 5-95% ms | slope obs / pred "
          "| R^2 predicted | R^2 streams | R^2 streams + context |")
    print("|---|---:|---|---|---:|---:|---:|---:|")
    for name, trace, scale, _ in table_rows(a.gen_dir, str(REPO / "traces")):
        if name not in want:
            continue
        run = argparse.Namespace(trace=trace, fleet=a.fleet, rate_scale=scale, max_requests=a.max,
                                 admission="fcfs", placement="fleetmind", live_shape=None)
        t = table(run_recorded(run).rows, a.min_out)
        print(f"| {name} | {t['n']} | {t['mean']:.1f} / {t['sd']:.2f} | {t['lo']:.1f}-{t['hi']:.1f} "
              f"| {t['slope']:.2f} | {t['r2_pred']:.2f} | {t['r2_streams']:.2f} | {t['r2_both']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
