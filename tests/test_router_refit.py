"""The gateway's background refit: fits the router's learned model off the loop, only when due."""

from __future__ import annotations

import asyncio

from fleetcore.types import InstanceSnapshot, RequestOutcome, RequestProfile
from gateway.router_refit import RouterRefit
from tokenpilot.latency_model import LearnedLatency
from tokenpilot.priors import prior_from_physics
from tokenpilot.router import TokenPilot, TokenPilotConfig


def test_refit_runs_when_due_and_installs_a_fit() -> None:
    prior = prior_from_physics("llama-3.1-8b", "H100")
    tp = TokenPilot({"a": prior}, config=TokenPilotConfig(explore=0.0),
                    latency=LearnedLatency(min_samples=64, refit_every=64))
    a = InstanceSnapshot(instance_id="a", site="s", model="m", version="v", url="http://a")
    task = RouterRefit(tp, interval_s=0.01)

    async def main() -> None:
        assert not await task.once()  # nothing observed yet: not due
        for i in range(200):
            tokens = 200 + 17 * i
            p = RequestProfile(request_id=f"r{i}", model="m", prompt_tokens=tokens, stream=True,
                               block_hashes=tuple(range(i * 1000, i * 1000 + tokens // 16)))
            d = tp.route(p, [a], float(i))
            tp.observe(RequestOutcome(p.request_id, "a", "s", ok=True, prompt_tokens=tokens, output_tokens=1,
                                      ttft_s=0.1 + 3 * d.candidates[0].detail["prior_ttft_s"]))
        assert tp.refit_due()
        assert await task.once()
        assert task.fits == 1 and tp.latency.ttft is not None and not tp.refit_due()

    asyncio.run(main())
