"""The gateway's background refit: fits the router's learned model off the loop, only when due."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from typing import Any

import numpy as np
import pytest

from fleetcore.types import InstanceSnapshot, RequestOutcome, RequestProfile
from gateway.app import create_app
from gateway.embedded import serve_app
from gateway.router_refit import RouterRefit
from tokenpilot.latency_model import LearnedLatency
from tokenpilot.priors import prior_from_physics
from tokenpilot.router import TokenPilot, TokenPilotConfig


def test_refit_runs_when_due_and_installs_a_fit() -> None:
    prior = prior_from_physics("llama-3.1-8b", "H100")
    tp = TokenPilot({"a": prior}, config=TokenPilotConfig(explore=0.0),
                    latency=LearnedLatency(min_samples=64, refit_every=64))
    task = RouterRefit(tp, interval_s=0.01)
    rng = np.random.default_rng(3)

    async def main() -> None:
        assert not await task.once()  # nothing observed yet: not due
        for i in range(200):
            tokens = 200 + 17 * i
            # The TTFT grows with the instance's KV use, which only the residual's features see: a
            # slower engine, or a cost per step, the step fit alone learns since i19-vllm (the
            # residual then does not beat the prior on the held-out outcomes and is not installed).
            kv = float(rng.uniform(0.0, 0.9))
            a = InstanceSnapshot(instance_id="a", site="s", model="m", version="v", url="http://a", kv_usage=kv)
            p = RequestProfile(request_id=f"r{i}", model="m", prompt_tokens=tokens, stream=True,
                               block_hashes=tuple(range(i * 1000, i * 1000 + tokens // 16)))
            d = tp.route(p, [a], float(i))
            tp.observe(RequestOutcome(p.request_id, "a", "s", ok=True, prompt_tokens=tokens, output_tokens=1,
                                      ttft_s=d.candidates[0].detail["prior_ttft_s"] * (1.0 + 4.0 * kv)))
        assert tp.refit_due()
        assert await task.once()
        assert task.fits == 1 and tp.latency.ttft is not None and not tp.refit_due()

    asyncio.run(main())


class _Recording(TokenPilot):
    """TokenPilot noting where `prepare_refit` ran (and failing it when told to)."""

    fail = False

    def __init__(self) -> None:
        super().__init__({"a": prior_from_physics("llama-3.1-8b", "H100")}, config=TokenPilotConfig(explore=0.0))
        self.prepared_on: list[int] = []

    def prepare_refit(self) -> None:
        self.prepared_on.append(threading.get_ident())
        if self.fail:
            raise ImportError("no scikit-learn here")


def test_prepare_loads_the_fitter_in_a_worker_thread_and_survives_a_failure(caplog: pytest.LogCaptureFixture) -> None:
    """Start-up loads the fitter off the loop's thread (its import holds the GIL for most of a
    second: the loop keeps ticking between switch intervals); a failure is logged, not raised."""
    async def main() -> int:
        ok, bad = _Recording(), _Recording()
        bad.fail = True
        await RouterRefit(ok).prepare()
        await RouterRefit(bad).prepare()
        assert len(ok.prepared_on) == 1 and len(bad.prepared_on) == 1
        assert threading.get_ident() not in ok.prepared_on + bad.prepared_on
        return len(ok.prepared_on)

    assert asyncio.run(main()) == 1
    assert "could not load the fitter" in caplog.text


def test_tokenpilot_prepare_imports_scikit_learn() -> None:
    """What `prepare_refit` loads is what the first fit would have imported. A fresh interpreter:
    pytest's may have it already."""
    code = (
        "import sys\n"
        "from tokenpilot.priors import prior_from_physics\n"
        "from tokenpilot.router import TokenPilot\n"
        "assert 'sklearn.linear_model' not in sys.modules\n"
        "TokenPilot({'a': prior_from_physics('llama-3.1-8b', 'H100')}).prepare_refit()\n"
        "assert 'sklearn.linear_model' in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


async def test_gateway_start_up_prepares_the_refit_before_serving(
        fake_adapter: Any, instance_factory: Any, config_factory: Any, refused_url: str) -> None:
    router = _Recording()
    app = create_app(config_factory(), [fake_adapter([instance_factory("i0", refused_url)])], router=router)
    assert router.prepared_on == []
    async with serve_app(app):  # the lifespan has run when it serves
        assert len(router.prepared_on) == 1 and router.prepared_on[0] != threading.get_ident()


async def test_fleet_file_can_turn_the_learned_model_off(
        fake_adapter: Any, instance_factory: Any, config_factory: Any, refused_url: str) -> None:
    """`gateway.learned_latency: false` (bench/latency_live.py's `prior` in a gateway of its own):
    the refit is neither prepared nor started, so the router keeps its prior; the default does both."""
    def tasks() -> list[str]:
        return [t.get_name() for t in asyncio.all_tasks()]

    for learned in (True, False):
        config = config_factory()
        config = config.model_copy(update={"gateway": config.gateway.model_copy(update={"learned_latency": learned})})
        router = _Recording()
        app = create_app(config, [fake_adapter([instance_factory("i0", refused_url)])], router=router)
        async with serve_app(app):
            assert ("router-refit" in tasks()) is learned
            assert len(router.prepared_on) == int(learned)
        assert "router-refit" not in tasks()


def test_learned_latency_is_on_unless_the_fleet_file_says_off(config_factory: Any) -> None:
    from fleetcore.fleet_config import parse_fleet

    raw = config_factory().model_dump(mode="json", exclude_defaults=True)
    assert parse_fleet(raw).gateway.learned_latency is True
    assert parse_fleet({**raw, "gateway": {"learned_latency": False}}).gateway.learned_latency is False


class _Fits(TokenPilot):
    """TokenPilot whose fits give what the test says: True, False, or an error."""

    def __init__(self, results: list[Any]) -> None:
        super().__init__({"a": prior_from_physics("llama-3.1-8b", "H100")}, config=TokenPilotConfig(explore=0.0))
        self.results = results

    def refit_due(self) -> bool:
        return True

    def refit(self) -> bool:
        r = self.results.pop(0)
        if isinstance(r, Exception):
            raise r
        return bool(r)


def test_every_fit_is_counted_by_its_result() -> None:
    """tokenfleet_router_refits_total{result}: whether the learned model is doing anything at all."""
    from gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    task = RouterRefit(_Fits([True, False, False, RuntimeError("singular")]), results=metrics.router_refits)

    async def main() -> None:
        assert await task.once() and not await task.once() and not await task.once()
        with pytest.raises(RuntimeError):
            await task.once()

    asyncio.run(main())
    text = metrics.render().decode()
    assert 'tokenfleet_router_refits_total{result="installed"} 1.0' in text
    assert 'tokenfleet_router_refits_total{result="kept_prior"} 2.0' in text
    assert 'tokenfleet_router_refits_total{result="failed"} 1.0' in text
    assert task.fits == 1
