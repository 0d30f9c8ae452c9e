"""The router's learned model, fitted in the background: the live half of `InstanceRouter.refit`.

TokenPilot buffers request outcomes as they come (`observe`, on the event loop) and fits
its latency model only when asked (`refit`, scikit-learn). This task asks every
`interval_s` when the router says enough new outcomes are in (`refit_due`), and runs the
fit in a worker thread so that no decision waits for it: the fit works on a copy of the
buffer and installs its coefficients in one assignment. The simulator calls the same
`refit` in virtual time (`fleetsim.simulator`).
"""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import Counter

from fleetcore.policies import InstanceRouter
from gateway.background import cancel_and_wait

log = logging.getLogger("tokenfleet.router_refit")


class RouterRefit:
    """`results`: a Prometheus counter with one label, `result` (`GatewayMetrics.router_refits`):
    each fit's outcome, `installed`, `kept_prior` (no better than the prior on the newest
    outcomes: decisions go on with the prior, or the fit before) or `failed` (logged), so that an
    operator sees whether the learned model is doing anything at all."""

    def __init__(self, router: InstanceRouter, interval_s: float = 5.0, timeout_s: float = 30.0,
                 results: Counter | None = None) -> None:
        if not interval_s > 0 or not timeout_s > 0:
            raise ValueError("interval_s and timeout_s must be positive")
        self.router, self.interval_s, self.timeout_s = router, interval_s, timeout_s
        self.fits = 0  # fits installed (tests, operators)
        self._results = results
        self._task: asyncio.Task[None] | None = None

    async def prepare(self) -> None:
        """Load what the fits need (`InstanceRouter.prepare_refit`: scikit-learn for TokenPilot), in
        a worker thread, within `timeout_s`: called at start-up, before serving and before the
        gateway freezes its long-lived objects. The loop keeps running meanwhile (the thread holds
        the GIL for most of an import, but gives it back every switch interval); had the first fit
        imported it, requests being served would wait that long. A failure is logged: the fits
        will fail the same way, and are logged too."""
        try:
            await asyncio.wait_for(asyncio.to_thread(self.router.prepare_refit), self.timeout_s)
        except Exception:
            log.exception("router refit: could not load the fitter; fits will be retried as due")

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="router-refit")

    async def once(self) -> bool:
        """Fit now if due (in a worker thread, within `timeout_s`); True if a fit was installed."""
        if not self.router.refit_due():
            return False
        try:
            fitted = await asyncio.wait_for(asyncio.to_thread(self.router.refit), self.timeout_s)
        except Exception:
            self._count("failed")
            raise
        self.fits += bool(fitted)
        self._count("installed" if fitted else "kept_prior")
        return bool(fitted)

    def _count(self, result: str) -> None:
        if self._results is not None:
            self._results.labels(result).inc()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.once()
            except Exception:  # a failed fit keeps the previous model (or the prior); the gateway goes on
                log.exception("router refit failed")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait([task])
