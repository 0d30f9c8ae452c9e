"""TokenPilot's learned speed factors on engines far slower than their prior (bench/ROUTING.md, "i19-cap").

Two set-ups in the simulator (virtual time), both with the router's prior wrong by `k`:

* `slow`: one 8B-on-H100 instance whose router's prior is `k` times too fast in every cost (the
  generic prior on hardware the roofline does not know: vLLM on CPU was ~10x slower than it), fed
  the Azure conversation trace at `--rate-scale` (requests queue). Reports the learned factors and,
  over the second half, observed / predicted for the routing cost's TTFT (its queue + prefill
  seconds, which the in-pool ranking reads) on queued and unqueued requests, and for its time per
  output token (the own-decode term).
* `mixed`: `--fast` instances on H100 and `--slow` on an accelerator with H100's memory and `k` times
  less compute and bandwidth, the router told every one is an H100 (a fleet file that gets the
  hardware wrong); goodput and SLO attainment of the Azure conversation trace.

    python bench/speed_bounds.py slow --k 10 --rate-scale 6 --requests 1200
    python bench/speed_bounds.py mixed --k 10 --rate-scale 8 --requests 3000 [--main-bounds]

It imports whichever `tokenpilot` the interpreter has: run it with another checkout's venv (from
that checkout's root) to measure that code on the same set-up.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from fleetcore import hardware
from fleetcore.fleet_config import parse_fleet
from fleetcore.policies import EnginePrior
from fleetcore.types import RequestOutcome
from fleetsim.metrics import summarize_all
from fleetsim.simulator import FleetSimulator, HashCache, fleet_instances, prepare, spec_prior
from tokenpilot.router import TokenPilot, TokenPilotConfig
from workloads import head, load_trace, scale_rate

TRACE = "traces/AzureLLMInferenceTrace_conv.csv"


def _fleet(deployments: list[dict[str, Any]]) -> Any:
    return parse_fleet({
        "sites": [{"name": "s", "region": "r", "jurisdiction": "x"}],
        "models": [{"name": "m", "engine": {"spec": "llama-3.1-8b", "max_model_len": 32768,
                                            "max_num_batched_tokens": 2048}}],
        "deployments": deployments,
        "tenants": [{"name": "t", "api_keys": ["k"]}]})


class Recorder(TokenPilot):
    """TokenPilot, recording per request what its routing cost predicted and what the request got."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.rows: list[tuple[str, float, float, float, float, float | None, int]] = []

    def observe(self, outcome: RequestOutcome) -> None:
        rec = self._inflight.get(outcome.request_id)
        if rec is not None and outcome.ok and outcome.ttft_s:
            # (instance, routing TTFT = queue + prefill, its queue, its time per token, TTFT, TPOT, output)
            self.rows.append((outcome.instance_id, rec.predicted_ttft_s, rec.predicted_queue_s,
                              rec.predicted_tpot_s, outcome.ttft_s, outcome.mean_tpot_s, outcome.output_tokens))
        super().observe(outcome)


def _main_bounds(router: TokenPilot) -> None:
    """The speed factors' bounds before i19-cap: prefill [1/16, 4], decode [1/4, 4] (the pool's TPOT factor
    kept [1/16, 4]): what main's code learns, measured on this code."""
    for learned in router._learned:
        learned.prefill.lo, learned.prefill.hi = 1 / 16, 4.0
        learned.decode.lo, learned.decode.hi = 0.25, 4.0


def _workload(root: Path, n: int, rate_scale: float) -> Any:
    return scale_rate(head(load_trace(root / TRACE), n), rate_scale)


def too_fast(p: EnginePrior, k: float) -> EnginePrior:
    """`p` with every cost `k` times too small: the prior of an engine `k` times slower than it says."""
    return replace(p, prefill_token_s=p.prefill_token_s / k, attn_s_per_token_ctx=p.attn_s_per_token_ctx / k,
                   kv_read_s_per_token=p.kv_read_s_per_token / k, step_overhead_s=p.step_overhead_s / k)


def slow(k: float, rate_scale: float, n: int, root: Path, main_bounds: bool = False) -> dict[str, Any]:
    fleet = _fleet([{"site": "s", "model": "m", "instances": 1, "gpu": "H100", "adapter": "sim"}])
    router = Recorder(config=TokenPilotConfig(explore=0.0))
    for spec in fleet_instances(fleet):
        router.register_instance(spec.instance_id, too_fast(spec_prior(spec), k))
    if main_bounds:
        _main_bounds(router)
    FleetSimulator(fleet, router).run(prepare(_workload(root, n, rate_scale).requests, fleet, hash_cache=HashCache()))
    rows = router.rows[len(router.rows) // 2:]
    ttft = np.array([r[4] / r[1] for r in rows])
    queued = np.array([r[2] > 0.1 * r[1] for r in rows])
    tpot = np.array([r[5] / r[3] for r in rows if r[5] is not None and r[6] > 1])
    iid = router._s.ids[0]
    ex = router.explain(iid)
    fit = router.forward_factors(iid)
    return {"k": k, "rate_scale": rate_scale, "requests": n, "queued_share": float(queued.mean()),
            "prefill_factor": ex["prefill_speed_factor"], "decode_factor": ex["decode_speed_factor"],
            "tpot_factor": ex["tpot_factor"], "step_fit": fit,
            "ttft_obs_over_cost": {"all": float(np.median(ttft)), "queued": float(np.median(ttft[queued])),
                                   "unqueued": float(np.median(ttft[~queued])) if (~queued).any() else None},
            "tpot_obs_over_cost": float(np.median(tpot)),
            # the cost's time per output token against the observed: median / P90 absolute error
            "tpot_error": [float(np.median(np.abs(1 / tpot - 1))), float(np.percentile(np.abs(1 / tpot - 1), 90))],
            "observed_ttft_median_s": float(np.median([r[4] for r in rows]))}


def mixed(k: float, rate_scale: float, n: int, root: Path, fast: int = 2, slow_n: int = 2,
          main_bounds: bool = False, seed: int = 0) -> dict[str, Any]:
    h100 = hardware.gpu("H100")
    name = f"h100-slow{k:g}"
    # (an accelerator of the run's own, in the roofline's table for the run only)
    hardware.GPUS[name] = replace(h100, name=name, peak_tflops_bf16=h100.peak_tflops_bf16 / k,
                                  mem_bw_tbs=h100.mem_bw_tbs / k)
    try:
        fleet = _fleet([{"site": "s", "model": "m", "instances": fast, "gpu": "H100", "adapter": "sim"},
                        {"site": "s", "model": "m", "instances": slow_n, "gpu": name, "adapter": "sim"}])
        router = Recorder(config=TokenPilotConfig(), seed=seed)  # (its exploration draws from `seed`)
        for spec in fleet_instances(fleet):
            router.register_instance(spec.instance_id, spec_prior(replace(spec, gpu="H100")))
        if main_bounds:
            _main_bounds(router)
        res = FleetSimulator(fleet, router).run(prepare(_workload(root, n, rate_scale).requests, fleet,
                                                       hash_cache=HashCache()))
        true = spec_prior(next(s for s in fleet_instances(fleet) if s.gpu == name))
        prior = spec_prior(next(s for s in fleet_instances(fleet) if s.gpu == "H100"))
    finally:
        hardware.GPUS.pop(name, None)
    summary = summarize_all(res.records, fleet.admission.slos())
    share: dict[str, int] = {}
    for r in res.records:
        if r.instance is not None:
            share[r.instance] = share.get(r.instance, 0) + 1
    factors = {iid: {key: round(v, 3) for key, v in router.explain(iid).items()
                     if key in ("prefill_speed_factor", "decode_speed_factor", "tpot_factor")}
               for iid in router._s.ids}
    return {"k": k, "rate_scale": rate_scale, "requests": n,
            "slow_over_prior": {"prefill_token_s": true.prefill_token_s / prior.prefill_token_s,
                                "step_overhead_s": true.step_overhead_s / prior.step_overhead_s},
            "goodput_tok_s": summary["goodput_tok_s"], "slo_attainment": summary["slo_attainment"],
            "throughput_tok_s": summary["throughput_tok_s"], "requests_per_instance": share, "factors": factors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("setup", choices=("slow", "mixed"))
    ap.add_argument("--k", type=float, default=10.0, help="how many times slower than the prior")
    ap.add_argument("--rate-scale", type=float, default=6.0)
    ap.add_argument("--requests", type=int, default=1200)
    ap.add_argument("--fast", type=int, default=2)
    ap.add_argument("--slow", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="mixed: the router's seed")
    ap.add_argument("--main-bounds", action="store_true",
                    help="the speed factors' bounds before i19-cap (prefill [1/16, 4], decode [1/4, 4])")
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1], help="where traces/ is")
    a = ap.parse_args()
    if a.setup == "slow":
        out = slow(a.k, a.rate_scale, a.requests, a.root, a.main_bounds)
    else:
        out = mixed(a.k, a.rate_scale, a.requests, a.root, a.fast, a.slow, a.main_bounds, a.seed)
    print(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
