"""How well TokenPilot predicts TTFT and TPOT: its predictions at each decision against what the request got.

    .venv/bin/python bench/latency_error.py TRACE [--fleet FILE] [--rate-scale X] [--max-requests N]
        [--admission fcfs|slomax] [--placement fleetmind|home] [--live-shape RATE]

Runs TokenPilot in the simulator (virtual time; the learned model is refitted there as the
gateway's background task would, every `LearnedLatency.refit_every` outcomes) and prints the
median and P90 absolute percentage error of the predicted TTFT and TPOT of the chosen instance
against the observed ones, for the cost model's physics (its queue + prefill seconds), the
scheduler-forward TTFT (`tokenpilot.forward`; since i19-unify at the instance's fitted step
costs, `tokenpilot.learning.StepFit`, once it has a fit), the decision's TTFT ("learned": the
forward TTFT where a step fit is in, the learned model over it where not; what the site chooser and
the P/D decision read) and what the decision reports (since i19-rtt the decision's TTFT plus the round
trip to the chosen site, added by `fleetmind.place`, as the simulator keeps it for the first-byte
deadline and the gateway sends it in `x-tokenfleet-predicted-ttft-ms`; from i19-unify to it the
decision's TTFT alone; before, the step-fitted forward TTFT of a second token backlog where the site
chooser read the learned model over the prior's; its TPOT column is the learned one), over all
requests and over the second half of the run (once the model has data). The last line: observed /
reported TTFT quantiles after dispatch and network (bias and spread, second half).

A prediction is made at dispatch, of the time from dispatch to the first token; a request
held by admission before it has waited `held` seconds already, which is known at dispatch.
"TTFT" columns compare held + prediction with the TTFT the request got (from its arrival,
the issue's measure); "after dispatch" columns compare the prediction with TTFT - held - the
network round trip to the site (smaller denominators: the stricter measure; the models' predictions
are of the engine's time; the reported one, which holds the round trip since i19-rtt, less the
outcome's round trip, `RequestOutcome.network_s`). TPOT is the request's mean time per output token.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without installing

import numpy as np  # noqa: E402

from bench.latency_recorder import arguments, run_recorded  # noqa: E402  (its argparse parser: `arguments`)


def errors(pred: np.ndarray, obs: np.ndarray) -> tuple[float, float]:
    e = 100 * np.abs(pred - obs) / obs
    return float(np.median(e)), float(np.percentile(e, 90))


def main(argv: Sequence[str] | None = None) -> int:
    router = run_recorded(arguments(__doc__, argv))
    from fleetmind.site_choice import rtt_ms
    sites = {s.name: s for s in router.fleet.sites}

    def network(x):  # type: ignore[no-untyped-def]
        """The round trip to the site inside the observed TTFT (`RequestOutcome.network_s`; in a checkout
        older than i19-unify, which has no such field, the fleet file's figure, as the simulator takes it)."""
        n = getattr(x.outcome, "network_s", None)
        return n if n is not None else rtt_ms(sites[x.outcome.site], x.region) / 1000 if x.outcome.site in sites else 0.0

    # the chosen instance's physics (queue + prefill), forward prior and learned TTFT; physics and
    # learned TPOT; the hold; then what the request got
    rows = [(x.detail["prior_ttft_s"], x.detail.get("forward_ttft_s", float("nan")), x.detail["predicted_ttft_s"],
             x.detail["prior_tpot_s"], x.detail["tpot_s"], x.held, x.outcome.ttft_s, x.outcome.mean_tpot_s,
             x.detail.get("reported_ttft_s", float("nan")), network(x), float(x.outcome.prompt_tokens))
            for x in router.rows
            if x.outcome.ok and x.outcome.ttft_s and x.outcome.mean_tpot_s and x.outcome.output_tokens > 1]
    r = np.array(rows)
    held, ttft, tpot, net = r[:, 5], r[:, 6], r[:, 7], r[:, 9]
    # Whether the reported TTFT holds the round trip (`fleetmind.place.network_rtt_s`, since i19-rtt):
    # then its engine time is it less the round trip (in an older checkout it is the engine time).
    try:
        from fleetmind.place import network_rtt_s  # noqa: F401
        with_network = True
    except ImportError:
        with_network = False
    print(f"{len(r)} requests ({100 * np.mean(held > 0):.0f}% held by admission); learned model fitted: "
          f"TTFT {router.latency.ttft is not None}, TPOT {router.latency.tpot is not None}")
    run = router.summary
    if run:  # (the run's own figures, as `tokenfleet simulate` reports them)
        slo = run.get("slo_attainment")
        print(f"goodput {run['goodput_tok_s']:.0f} tok/s, SLO {100 * slo if slo is not None else 0:.1f}%")
    print("| model | requests | TTFT median err | TTFT P90 err | after dispatch, network median | P90 "
          "| TPOT median err | TPOT P90 err |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, rows in (("all", slice(None)), ("second half", slice(len(r) // 2, None))):
        for name, ti, pi in (("cost model physics", 0, 3), ("scheduler-forward prior", 1, 3), ("learned", 2, 4),
                             ("reported (decision + round trip to the site)" if with_network
                             else "reported (step-fitted forward once fitted)", 8, 4)):
            tm, t90 = errors(held[rows] + r[rows, ti], ttft[rows])
            engine = r[rows, ti] - (net[rows] if ti == 8 and with_network else 0.0)
            dm, d90 = errors(engine, np.maximum(ttft[rows] - held[rows] - net[rows], 1e-6))
            pm, p90 = errors(r[rows, pi], tpot[rows])
            print(f"| {name} ({label}) | {len(r[rows])} | {tm:.0f}% | {t90:.0f}% | {dm:.0f}% | {d90:.0f}% "
                  f"| {pm:.0f}% | {p90:.0f}% |")
    # The reported TTFT's bias and spread: what a threshold on it against an SLO must allow for
    # (FleetMind's spill test, `fleetmind.site_choice.FleetMindConfig`).
    half = slice(len(r) // 2, None)
    reported_engine = r[half, 8] - (net[half] if with_network else 0.0)
    q = np.percentile(np.maximum(ttft[half] - held[half] - net[half], 1e-6) / np.maximum(reported_engine, 1e-6),
                      (10, 50, 90))
    print(f"observed / reported TTFT after dispatch and network (second half): P10 {q[0]:.2f}, median {q[1]:.2f}, "
          f"P90 {q[2]:.2f}")
    # What the hold alone costs a report that leaves it out (the response header before i19-arrive, which
    # reported the prediction from the dispatch; since, the hold is in it, `RouteDecision.ttft_from_arrival_s`,
    # as in the "TTFT" columns above): the second half's reported TTFT with and without the hold against
    # the TTFT from arrival, and the median of the hold.
    wm, w90 = errors(r[half, 8], ttft[half])
    hm, h90 = errors(held[half] + r[half, 8], ttft[half])
    print(f"reported TTFT against the TTFT from arrival (second half): without the hold {wm:.0f}% / {w90:.0f}%, "
          f"with it {hm:.0f}% / {h90:.0f}% (median / P90); held {100 * np.mean(held[half] > 0):.0f}% of requests, "
          f"median {1e3 * np.median(held[half]):.1f} ms, P90 {1e3 * np.percentile(held[half], 90):.1f} ms")
    # By prompt length (fifths of the second half): the median reported / observed TTFT after dispatch and
    # network (the prediction's own shape), and from arrival without the hold (what the old header gave).
    prompt = r[half, 10]
    edges = np.quantile(prompt, np.linspace(0, 1, 6))
    which = np.clip(np.searchsorted(edges, prompt, side="right") - 1, 0, 4)
    engine_obs = np.maximum(ttft[half] - held[half] - net[half], 1e-6)
    fifths = [(f"{edges[q]:.0f}-{edges[q + 1]:.0f}", np.median(reported_engine[which == q] / engine_obs[which == q]),
               np.median(r[half, 8][which == q] / ttft[half][which == q])) for q in range(5) if np.any(which == q)]
    print("reported / observed by prompt fifth (second half), after dispatch: "
          + ", ".join(f"{e} {a:.2f}" for e, a, _ in fifths)
          + "; from arrival, the hold left out: " + ", ".join(f"{b:.2f}" for _, _, b in fifths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
