"""What a request asks of the fleet, in the planner's units, and which site it counts for.

The placement planner (`fleetmind.planner`) plans replicas from demand measured as
engine work: seconds of one replica's time per second. A request's work is its prefill
plus its share of the decode steps it rides in, timed by the same roofline the simulated
engine and TokenPilot's priors use (model x GPU x TP of the model's first deployment:
the reference hardware; `replica_speed` says how a site's own hardware compares). It is booked to
the request's *home* site, the nearest site serving its model from where the client
entered, because that is where capacity was wanted (a spilled request still says its home
was short). The simulator's planner loop and the live gateway's both book demand here.
"""

from __future__ import annotations

import logging

from fleetcore import hardware
from fleetcore.fleet_config import FleetConfig
from fleetcore.roofline import StepTimer
from fleetmind.site_choice import rtt_ms

log = logging.getLogger("tokenfleet.fleetmind")

# Decode work is shared by a batch; this is its typical size on a busy replica.
DECODE_BATCH = 32
# The request replica speeds are compared on.
TYPICAL_PROMPT, TYPICAL_OUTPUT = 2048, 256
# Hardware the roofline falls back to when a deployment's model or GPU is not in its tables.
_FALLBACK = ("llama-3.1-8b", "H100", 1)


class DemandModel:
    """`wall_clock`: replicas work in wall seconds, as a live gateway sees them: a simulated
    worker with `time_scale: 0.1` does ten physical seconds of work per second, so it counts
    as ten times as fast (the simulator, in virtual time, leaves it False)."""

    def __init__(self, fleet: FleetConfig, decode_batch: int = DECODE_BATCH, wall_clock: bool = False) -> None:
        self.fleet = fleet
        self.decode_batch = decode_batch
        self.wall_clock = wall_clock
        self._home: dict[tuple[str | None, str], str] = {}
        self._timers: dict[tuple[str, str, int], StepTimer] = {}  # by hardware
        self._by_place: dict[tuple[str, str | None], StepTimer] = {}

    def home(self, client_region: str | None, model: str) -> str:
        """The nearest site that serves `model` (any site when none does) from `client_region`."""
        key = (client_region, model)
        if key not in self._home:
            region = client_region or self.fleet.entry_region
            serving = {d.site for d in self.fleet.deployments if d.model == model}
            sites = [s for s in self.fleet.sites if s.name in serving] or list(self.fleet.sites)
            self._home[key] = min(sites, key=lambda s: (rtt_ms(s, region), s.name)).name
        return self._home[key]

    def work_s(self, model: str, prompt_tokens: int, output_tokens: int) -> float:
        """Replica seconds a request needs: its prefill plus its share of decode steps."""
        t = self._timer(model)
        prefill = t.step_time([(prompt_tokens, 0)], [])
        decode = t.step_time([], [prompt_tokens] * self.decode_batch) / self.decode_batch
        return prefill + output_tokens * decode

    def replica_speed(self, site: str, model: str) -> float:
        """How much reference work one replica of `model` at `site` does per second (1.0 on the
        reference hardware, less on slower GPUs): a typical request's time there vs. here."""
        here, ref = self._timer(model, site), self._timer(model)
        p, o, b = TYPICAL_PROMPT, TYPICAL_OUTPUT, self.decode_batch

        def cost(t: StepTimer) -> float:
            return t.step_time([(p, 0)], []) + o * t.step_time([], [p] * b) / b

        speed = cost(ref) / cost(here)
        return speed / self._time_scale(site, model) if self.wall_clock else speed

    def _time_scale(self, site: str, model: str) -> float:
        d = next((d for d in self.fleet.deployments if d.site == site and d.model == model), None)
        return float(d.options.get("time_scale", 1.0)) if d is not None and d.adapter == "sim" else 1.0

    def _timer(self, model: str, site: str | None = None) -> StepTimer:
        """The roofline of `model` on the hardware of its first deployment (at `site`, when given
        and deployed there; else anywhere: the reference hardware). Memoised per place: `work_s`
        runs for every request the gateway sees."""
        t = self._by_place.get((model, site))
        if t is None:
            t = self._by_place[(model, site)] = self._hardware_timer(*self._hardware(model, site))
        return t

    def _hardware(self, model: str, site: str | None) -> tuple[str, str, int]:
        deps = [d for d in self.fleet.deployments if d.model == model]
        d = next((d for d in deps if d.site == site), deps[0] if deps else None)
        spec = next((m.engine.spec for m in self.fleet.models if m.name == model), _FALLBACK[0])
        return (spec, d.gpu, d.tp) if d is not None else (spec, *_FALLBACK[1:])

    def _hardware_timer(self, spec: str, gpu: str, tp: int) -> StepTimer:
        t = self._timers.get((spec, gpu, tp))
        if t is None:
            try:
                t = StepTimer(hardware.model(spec), hardware.gpu(gpu), tp=tp)
            except ValueError as e:
                log.warning("demand of %s timed on %s/%s (%s)", spec, _FALLBACK[0], _FALLBACK[1], e)
                t = StepTimer(hardware.model(_FALLBACK[0]), hardware.gpu(_FALLBACK[1]), tp=_FALLBACK[2])
            self._timers[(spec, gpu, tp)] = t
        return t
