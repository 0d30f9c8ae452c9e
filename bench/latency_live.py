"""TokenPilot's TTFT and TPOT predictions live: the real gateway over real engine processes (real HTTP, real time).

    .venv/bin/python bench/latency_live.py [--engine sim|vllm] [--requests 1200] [--rate 40] [--models prior,learned]
        [--gateway process|embedded|process,embedded] [--seed 0] [--save PREFIX]

`--engine sim` (the default): bench/fleet_noisy_live.yaml, 2 x Llama-3.1-70B on 2 x H200
simulated workers 4x faster than real time, which the routers' physics prior does not know
(it starts 4x off); prompt lengths from the Azure conversation trace capped at 8,000 tokens.

`--engine vllm`: real vLLM engines on this machine's CPU (`--instances`, 1 or 2), serving the
tiny random-weight Llama of tests/vllm_tiny_model.py (made in `--model-dir` if it is not there,
with the vLLM venv's python: deploy/vllm-cpu/make-venv.sh) with max_model_len 2048, the fleet of
tests/test_vllm_real.py. The fleet file calls the engine `llama-3.1-8b` on `gpu: CPU`: a GPU the
roofline has no figures for, so TokenPilot starts from the generic `EnginePrior` and has to
learn the CPU's speed online. Prompt lengths from the same trace clipped to 300-1,500 tokens of
the tiny model's tokenizer, outputs to 16-64: prefills of ~40-200 ms, well above this machine's
jitter.

Either way `--requests` completions are streamed, `--rate` per second, open loop; the text is
fresh per request (nothing cached) and the same for every run of one `--seed`. Per request the
gateway's `x-tokenfleet-predicted-ttft-ms` is compared with the TTFT the client measured and with
the gateway's own (its arrival to its first token, what its router observes), and the router's
predicted time per output token of the chosen instance (the decision's `tpot_s`) with the
gateway's mean time per output token (what the router learns from). `prior`: TokenPilot with its
learned latency model never fitted (the scheduler-forward prior with its online speed factors);
`learned`: as shipped (the gateway's background task fits it once enough outcomes are in).
Errors are over the second half of each run, once the models have data. One fresh fleet per run.

`--gateway process` (the default): the gateway is `tokenfleet up` in a process of its own over
the fleet file (written with `gateway: {health_interval_s: 0.2, learned_latency: false}` for
`prior`), which launches the engines as its children; this process runs only the client. The
gateway's TTFT and TPOT come from its access log (`--log-level info --log-format json`:
`ttft_ms`, `tpot_ms`, `tokens_in`), the predicted TPOT from `/debug/decisions` (polled every
second), SLOMax's state from `/admin/v1/admission` (every 0.5 s, into the run's folder as
`admission.jsonl`), and at the end the gateway's refits of its learned model, its worst loop stall
and SLOMax's knobs from `/metrics` (printed). `--gateway embedded`: the gateway in this process, on the client's event loop (the
router wrapped to read its decisions and outcomes; the learned model switched off by an
unfittable `LearnedLatency`): the client then sees the loop it shares with the gateway as well.
Several modes (`process,embedded`) run interleaved, model by model, in one command; a model named
again (`--models prior,learned,prior,learned`) is another round. The machine's
load average is printed before and after every run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable from a checkout without installing
sys.path.insert(0, str(REPO / "bench"))

import numpy as np  # noqa: E402

from fleetcore.fleet_config import FleetConfig, parse_fleet  # noqa: E402
from fleetcore.types import InstanceSnapshot, RequestOutcome, RequestProfile, RouteDecision  # noqa: E402
from workloads import head, load_trace  # noqa: E402
from workloads.prompts import prompt_text  # noqa: E402
from noisy_live import all_ready, read_stream  # noqa: E402
import peers  # noqa: E402  (its process helpers: `tokenfleet up` in a process of its own)

FLEET = REPO / "bench" / "fleet_noisy_live.yaml"
TRACE = REPO / "traces" / "AzureLLMInferenceTrace_conv.csv"
KEY = "sk-live-chat"
VLLM_VENV = Path(os.environ.get("TOKENFLEET_VLLM_VENV", "~/.cache/tokenfleet/vllm-venv")).expanduser()
HEALTH_INTERVAL_S = 0.2  # how often the gateway polls the engines, in both modes
DECISIONS_POLL_S = 1.0  # how often the process mode reads /debug/decisions (it keeps the last 256)
ADMISSION_POLL_S = 0.5  # ... and SLOMax's state (/admin/v1/admission), into the run's admission.jsonl
ADMIN_KEY = "sk-live-admin"
MODES = ("process", "embedded")
# Columns of a run's rows: predicted TTFT, the client's, the gateway's; predicted TPOT, the
# client's, the gateway's (s); the prompt's tokens as the gateway counted them; the time from the
# client's send to the router's decision (s, both on the wall clock: the HTTP request, the
# gateway's parsing, tokenizing and admission); the part of the predicted TTFT that is the time the
# gateway had held the request at the decision (s: since i19-arrive the header is the TTFT from the
# gateway's arrival, that hold plus the prediction from the dispatch; 0 before, when it held none).
P_TTFT, C_TTFT, G_TTFT, P_TPOT, C_TPOT, G_TPOT, PROMPT, PRE, HELD = range(9)
NAN6 = (math.nan,) * 6


@dataclass(frozen=True)
class Setup:
    """What differs between the two engines: the fleet, and how many tokens a word of prompt text is."""

    fleet: dict[str, Any]  # the fleet file's contents
    model: str
    prompt_range: tuple[int, int]  # trace input lengths clipped to this (tokens)
    output_range: tuple[int, int]  # ... output lengths
    tokens_per_word: float  # prompt_text's words are one token each under fleetcore's tokenizer

    def words(self, tokens: int) -> int:
        return max(1, round(tokens / self.tokens_per_word))

    def config(self) -> FleetConfig:
        return parse_fleet(self.fleet)

    def instances(self) -> int:
        return sum(d.instance_count for d in self.config().deployments)


def sim_setup() -> Setup:
    return Setup(yaml.safe_load(FLEET.read_text()), "llama-3.1-70b", (1, 8000), (2, 64), 1.0)


def vllm_setup(model_dir: Path, python: Path, instances: int, log_dir: Path) -> Setup:
    """The CPU fleet of tests/test_vllm_real.py (its engine config), `instances` engines."""
    if not (model_dir / "tokenfleet-tiny.json").exists():
        subprocess.run([str(python), str(REPO / "tests" / "vllm_tiny_model.py"), str(model_dir)],
                       check=True, capture_output=True, timeout=300)
    fleet = {
        "sites": [{"name": "cpu", "region": "local", "jurisdiction": "none"}],
        "models": [{"name": "tiny", "engine": {"spec": "llama-3.1-8b", "max_model_len": 2048, "block_size": 32,
                                               "max_num_batched_tokens": 2048, "max_num_seqs": 16}}],
        "deployments": [{"site": "cpu", "model": "tiny", "adapter": "vllm", "instances": instances, "gpu": "CPU",
                         "options": {"model": str(model_dir), "python": str(python), "enforce_eager": True,
                                     "ready_timeout_s": 600, "stop_grace_s": 20, "log_dir": str(log_dir)}}],
        "tenants": [{"name": "chat", "api_keys": [KEY]}],
    }
    from fleetcore.model_tokenizer import HFTokenizer

    sample = 4000  # words: prompt_text's words split into a few BPE pieces each under the tiny tokenizer
    per_word = (len(HFTokenizer(model_dir).text_ids(prompt_text(range(10**9, 10**9 + 8), sample))) - 1) / sample
    return Setup(fleet, "tiny", (300, 1500), (16, 64), per_word)


@dataclass(frozen=True)
class Sent:
    """What the client saw of one answered request."""

    request_id: str
    sent_at: float  # wall clock (time.time()), as the decision log's times
    predicted_ttft_s: float  # the gateway's x-tokenfleet-predicted-ttft-ms
    ttft_s: float  # the client's: its send to the first token
    tpot_s: float  # the client's mean time per output token after the first


# What the gateway saw of a request: its TTFT, the decision's predicted TPOT, its mean TPOT (s),
# the prompt's tokens, the decision's wall-clock time, the hold in its predicted TTFT (s, HELD above).
Seen = tuple[float, float, float, float, float, float]


async def one(s: aiohttp.ClientSession, url: str, model: str, prompt: str, out: int) -> Sent | None:
    try:
        return await _one(s, url, model, prompt, out)
    except aiohttp.ClientError:  # counted as not answered (the summary's last column), the run goes on
        return None


async def _one(s: aiohttp.ClientSession, url: str, model: str, prompt: str, out: int) -> Sent | None:
    body = {"model": model, "prompt": prompt, "max_tokens": out, "stream": True, "ignore_eos": True}
    sent_at, t0 = time.time(), time.monotonic()
    async with s.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
        if r.status != 200:
            await r.read()
            return None
        predicted = r.headers.get("x-tokenfleet-predicted-ttft-ms")
        rid = r.headers.get("x-request-id", "")
        st = await read_stream(r)
        first, last, n = st.first_token_at, st.last_token_at, st.output_tokens()
        if first is None or predicted is None:
            return None
        tpot = (last - first) / (n - 1) if last is not None and n > 1 else math.nan
        return Sent(rid, sent_at, float(predicted) / 1000, first - t0, tpot)


def prompts(setup: Setup, n: int, seed: int) -> list[tuple[str, int]]:
    """(text, max_tokens) per request: the trace's first `n` lengths, clipped; fresh text per
    request (its own blocks), the same text for every run of one seed."""
    lo, hi = setup.prompt_range
    out_lo, out_hi = setup.output_range
    base = (seed + 2) * 10**9  # clear of vllm_setup's sample (10**9 ...)
    got = []
    for i, r in enumerate(head(load_trace(TRACE), n).requests):
        tokens = min(max(r.input_length, lo), hi)
        text = prompt_text(range(base + 100 * i, base + 100 * i + max(1, tokens // 512)), setup.words(tokens))
        got.append((text, max(out_lo, min(r.output_length, out_hi))))
    return got


async def send_all(url: str, setup: Setup, work: Sequence[tuple[str, int]], rate: float) -> list[Sent | None]:
    """Every request, open loop at `rate` per second, streamed; each answered one's `Sent`."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120),
                                     connector=aiohttp.TCPConnector(limit=0)) as s:
        tasks = []
        for text, out in work:
            tasks.append(asyncio.create_task(one(s, url, setup.model, text, out)))
            await asyncio.sleep(1 / rate)
        return list(await asyncio.gather(*tasks))


def joined(sent: Sequence[Sent | None], seen: dict[str, Seen]) -> list[tuple[float, ...]]:
    """One row (the columns above) per answered request, in sending order."""
    rows = []
    for c in sent:
        if c is None:
            continue
        gw_ttft, pred_tpot, gw_tpot, prompt_tokens, decided_at, held = seen.get(c.request_id, NAN6)
        rows.append((c.predicted_ttft_s, c.ttft_s, gw_ttft, pred_tpot, c.tpot_s, gw_tpot, prompt_tokens,
                     decided_at - c.sent_at, held))
    return rows


async def run_embedded(setup: Setup, model: str, work: Sequence[tuple[str, int]], rate: float,
                       workdir: Path, probe: Probe | None = None) -> tuple[list[Sent | None], dict[str, Seen]]:
    """The gateway in this process (`gateway.embedded`), its router wrapped to see what it decided and
    observed; with a `probe`, also what TokenPilot's forward TTFT was made of and the engines' own view."""
    from gateway.embedded import serve_fleet
    from tokenpilot.latency_model import LearnedLatency

    async with serve_fleet(setup.config(), poll_interval_s=HEALTH_INTERVAL_S) as f:
        router = f.app.state.tokenfleet.relay.router
        if model == "prior":
            router.latency = LearnedLatency(min_samples=10**9)
        decided: dict[str, tuple[float, float, float]] = {}  # the chosen one's predicted TPOT, when (wall), held
        seen: dict[str, Seen] = {}  # what the gateway saw, per request id
        route, observe = router.route, router.observe
        # (the header holds the time held before the decision since i19-arrive; a checkout before it: 0)
        header_holds = hasattr(RouteDecision, "ttft_from_arrival_s")
        if probe is not None:
            probe.attach(router)

        def routed(profile: RequestProfile, candidates: Sequence[InstanceSnapshot], now: float) -> RouteDecision:
            d = route(profile, candidates, now)
            chosen = next((c for c in d.candidates if c.name == d.instance_id), None)
            if chosen is not None:
                held = max(0.0, now - profile.arrival) if header_holds and profile.arrival > 0 else 0.0
                decided[profile.request_id] = (chosen.detail["tpot_s"], time.time(), held)
            if probe is not None:
                probe.decided(router, profile, candidates, d, now)
            return d

        def watch(outcome: RequestOutcome) -> None:
            if probe is not None:
                probe.observed(outcome)
            if outcome.ttft_s is not None:
                tpot, at, held = decided.pop(outcome.request_id, (math.nan, math.nan, math.nan))
                seen[outcome.request_id] = (outcome.ttft_s, tpot,
                                            outcome.mean_tpot_s if outcome.mean_tpot_s is not None else math.nan,
                                            float(outcome.prompt_tokens), at, held)
            observe(outcome)
        router.route, router.observe = routed, watch  # type: ignore[method-assign]
        await all_ready(f.url, setup.instances())
        stop = asyncio.Event()
        poller = asyncio.create_task(probe.poll([i.url for a in f.adapters for i in a.instances], stop)) \
            if probe is not None else None
        try:
            sent = await send_all(f.url, setup, work, rate)
        finally:
            stop.set()
            if poller is not None:
                await poller
        await asyncio.sleep(0)  # the relay's release (the router's outcome) runs after a stream's end
    return sent, seen


# -- the probe (`--probe`): what the reported TTFT was made of, request by request ------------------
# The engine's own histograms (vLLM and the sim worker share the names): per request, from its
# arrival at the engine to its first scheduling, and from there to its first token.
ENGINE_HISTOGRAMS = ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                     "vllm:time_to_first_token_seconds")
ENGINE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
# The sim worker's own (since i19-arrive): its steps, and the wall seconds they went out late (its loop
# behind the engine's schedule on a busy host: time in TTFTs that no model of the engine predicts).
WORKER_COUNTERS = ("tokenfleet_sim:steps_total", "tokenfleet_sim:step_late_seconds_total")
METRICS_POLL_S = 0.25


def engine_metrics(text: str) -> dict[str, float]:
    """The gauges, and each histogram's _sum and _count, summed over label sets, from Prometheus text."""
    got: dict[str, float] = {}
    wanted = ENGINE_GAUGES + WORKER_COUNTERS + tuple(f"{h}_{x}" for h in ENGINE_HISTOGRAMS for x in ("sum", "count"))
    for line in text.splitlines():
        if line.startswith(wanted):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in wanted:
                try:
                    got[name] = got.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
                except ValueError:
                    continue
    return got


class Probe:
    """Per request, at TokenPilot's decision on the chosen instance: the forward TTFT's split (a, b, c:
    `tokenpilot.forward.forward_parts`) and the factors it was made with (the step fit's fixed-cost and
    per-token factors, the prefill speed factor), the tokens ahead it queued the request behind (the
    fitted backlog, the engine's waiting count as the gateway last scraped it), the decoding streams,
    the part of the reported TTFT that is its own prefill (the same forward TTFT with nothing ahead),
    and the engine's running / waiting counts as this probe last read them (every METRICS_POLL_S); at
    its outcome, the TTFT the router learns from. Over the run, the engines' own queue / prefill /
    TTFT histograms, to compare with the predicted queue and own parts. Reads the router's internals:
    a benchmark's instrument, on the embedded gateway only."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, float]] = {}
        self.timeline: list[tuple[float, dict[str, float]]] = []  # (wall time, summed over engines)
        self._col: list[float] | None = None

    def attach(self, router: Any) -> None:
        """Keep the chosen candidate's result column, which `_forward_parts` is handed at the commit."""
        parts = router._forward_parts

        def kept(k: int, prompt: float, col: list[float]) -> tuple[float, float, float, float]:
            self._col = col
            return parts(k, prompt, col)
        router._forward_parts = kept

    def decided(self, router: Any, profile: RequestProfile, candidates: Sequence[InstanceSnapshot],
                d: RouteDecision, now: float) -> None:
        from tokenpilot import score_kernel as sk
        from tokenpilot.forward import forward_parts

        rec = router._inflight.get(profile.request_id)
        col, self._col = self._col, None
        if rec is None or col is None or rec.forward_parts is None:
            return
        k, m = rec.slot, router._s.m
        snap = next(c for c in candidates if c.instance_id == d.instance_id)
        overhead_f, token_f = router.forward_factors(d.instance_id)
        prefill_f = float(m[sk.PREFILL_FACTOR, k])
        f = sk.O_FEATURES
        cached, decoding, context = col[sk.O_CACHED], col[f + 10], col[f + 4] * 1e6
        tf = prefill_f if token_f is None else token_f
        own = forward_parts(0.0, profile.prompt_tokens - cached, cached, decoding, context, float(m[sk.BUDGET, k]),
                            float(m[sk.TOKEN_S, k]), float(m[sk.ATTN_S, k]), float(m[sk.KV_EFF, k]),
                            float(m[sk.OVERHEAD_S, k]), tf, overhead_f)
        *split, fitted = rec.forward_parts  # (a, b, c[, d: the steps, i19-vllm's per-step cost counts them])
        a, b, c = split[:3]
        add = float(m[sk.FWD_STEP_S, k]) if hasattr(sk, "FWD_STEP_S") else math.nan
        own_s = overhead_f * own[0] + tf * own[1] + own[2] + (add * own[3] if len(own) > 3 else 0.0)
        last = self.timeline[-1][1] if self.timeline else {}
        self.rows[profile.request_id] = {
            "now": now, "wall": time.time(), "prompt": float(profile.prompt_tokens), "held": rec.held_s,
            "reported": float(d.predicted_ttft_s or math.nan), "a": a, "b": b, "c": c, "fitted": fitted,
            "own": own_s, "prior_forward": col[sk.O_FORWARD], "steps": split[3] if len(split) > 3 else math.nan,
            "overhead_f": overhead_f, "token_f": math.nan if token_f is None else token_f, "prefill_f": prefill_f,
            "step_add": add,  # the fit's additive seconds per step (i19-vllm; NaN on versions without it)
            "ahead_fit": col[sk.O_AHEAD], "ahead": col[sk.O_AHEAD],  # (one token backlog since i19-unify)
            "decoding": decoding, "context": context,
            "out_tok": float(m[sk.OUT_TOK, k]), "out_n": float(m[sk.OUT_N, k]), "streams": float(m[sk.STREAMS, k]),
            "snap_running": float(snap.num_running), "snap_waiting": float(snap.num_waiting),
            "engine_running": last.get("vllm:num_requests_running", math.nan),
            "engine_waiting": last.get("vllm:num_requests_waiting", math.nan)}

    def observed(self, outcome: RequestOutcome) -> None:
        r = self.rows.get(outcome.request_id)
        if r is not None and outcome.ok and outcome.ttft_s is not None:
            r["ttft"] = outcome.ttft_s
            r["ttft_dispatch"] = max(outcome.ttft_s - r["held"], 1e-6)  # what the router learns from
            r["output_tokens"] = float(outcome.output_tokens)

    async def poll(self, urls: Sequence[str], stop: asyncio.Event) -> None:
        """Every engine's /metrics every METRICS_POLL_S until `stop`, once more after it."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
            while True:
                stopping = stop.is_set()
                total: dict[str, float] = {}
                for url in urls:
                    try:
                        async with s.get(f"{url}/metrics") as r:
                            for name, x in engine_metrics(await r.text()).items():
                                total[name] = total.get(name, 0.0) + x
                    except (aiohttp.ClientError, TimeoutError):
                        pass
                if total:
                    self.timeline.append((time.time(), total))
                if stopping:
                    return
                try:
                    await asyncio.wait_for(stop.wait(), METRICS_POLL_S)
                except TimeoutError:
                    pass

    def table(self) -> np.ndarray:
        """The rows with an outcome, in decision order, as PROBE_COLUMNS."""
        rows = sorted((r for r in self.rows.values() if "ttft" in r), key=lambda r: r["wall"])
        return np.array([[r.get(c, math.nan) for c in PROBE_COLUMNS] for r in rows], dtype=float).reshape(
            -1, len(PROBE_COLUMNS))

    def engine_means(self, since_wall: float) -> dict[str, float]:
        """Each engine histogram's mean over the requests it recorded from `since_wall` to the end (s), and
        the sim workers' mean lateness a step (`late_per_step`, wall s: a first token goes out that late)."""
        if not self.timeline:
            return {}
        first = next((v for t, v in self.timeline if t >= since_wall), self.timeline[-1][1])
        last = self.timeline[-1][1]
        means = {}
        for h in ENGINE_HISTOGRAMS:
            n = last.get(f"{h}_count", 0.0) - first.get(f"{h}_count", 0.0)
            means[h] = (last.get(f"{h}_sum", 0.0) - first.get(f"{h}_sum", 0.0)) / n if n > 0 else math.nan
        steps, late = (last.get(c, math.nan) - first.get(c, math.nan) for c in WORKER_COUNTERS)
        means["late_per_step"] = late / steps if steps > 0 else math.nan  # wall s (NaN: a worker without them)
        return means


PROBE_COLUMNS = ("now", "wall", "prompt", "held", "reported", "a", "b", "c", "fitted", "own", "prior_forward",
                 "overhead_f", "token_f", "prefill_f", "step_add", "steps", "ahead_fit", "ahead", "decoding", "context", "out_tok",
                 "out_n", "streams", "snap_running", "snap_waiting", "engine_running", "engine_waiting", "ttft",
                 "ttft_dispatch", "output_tokens")


def probe_report(mode: str, model: str, probe: Probe, parts: int = 5) -> list[str]:
    """The second half, by prompt-length quintile: the reported TTFT against the TTFT after dispatch,
    split into its queue part (reported - own) and its own prefill; the factors it was made with;
    the tokens ahead and the streams it assumed, against the engine's counts; then, over the whole
    second half, the engine's own mean queue and prefill time against the predicted parts."""
    t = probe.table()
    col = {c: j for j, c in enumerate(PROBE_COLUMNS)}
    h = t[len(t) // 2:]
    if len(h) < parts:
        return [f"| {mode} | {model} | too few rows |"]
    edges = np.quantile(h[:, col["prompt"]], np.linspace(0, 1, parts + 1))
    which = np.clip(np.searchsorted(edges, h[:, col["prompt"]], side="right") - 1, 0, parts - 1)
    lines = []
    med = lambda r, c, x=1.0: float(np.nanmedian(r[:, col[c]])) * x  # noqa: E731
    for q in range(parts):
        r = h[which == q]
        if not len(r):
            continue
        obs = r[:, col["ttft_dispatch"]]
        err = 100 * np.abs(r[:, col["reported"]] - obs) / obs
        lines.append(
            f"| {mode} | {model} | {edges[q]:.0f}-{edges[q + 1]:.0f} | {len(r)} | {np.median(err):.0f}% "
            f"| {np.percentile(err, 90):.0f}% | {np.median(r[:, col['reported']] / obs):.2f} "
            f"| {med(r, 'reported', 1e3):.0f} | {med(r, 'own', 1e3):.0f} | {med(r, 'ttft_dispatch', 1e3):.0f} "
            f"| {med(r, 'overhead_f'):.2f} | {med(r, 'token_f'):.2f} | {med(r, 'prefill_f'):.2f} "
            f"| {med(r, 'ahead_fit'):.0f} | {med(r, 'snap_waiting'):.1f} / {med(r, 'engine_waiting'):.1f} "
            f"| {med(r, 'decoding'):.1f} / {med(r, 'snap_running'):.1f} / {med(r, 'engine_running'):.1f} |")
    eng = probe.engine_means(float(h[0, col["wall"]]))
    queue_pred = float(np.mean(h[:, col["reported"]] - h[:, col["own"]]))
    lines.append("")
    lines.append(f"second half ({len(h)} requests), means: reported {1e3 * np.mean(h[:, col['reported']]):.0f} ms "
                 f"= queue part {1e3 * queue_pred:.0f} + own prefill {1e3 * np.mean(h[:, col['own']]):.0f}; "
                 f"TTFT after dispatch {1e3 * np.mean(h[:, col['ttft_dispatch']]):.0f} ms; engine's own "
                 f"(its histograms): queue {1e3 * eng.get(ENGINE_HISTOGRAMS[0], math.nan):.0f} + prefill "
                 f"{1e3 * eng.get(ENGINE_HISTOGRAMS[1], math.nan):.0f}, TTFT {1e3 * eng.get(ENGINE_HISTOGRAMS[2], math.nan):.0f} ms; "
                 f"factors at the end: fixed {h[-1, col['overhead_f']]:.3g}, per token {h[-1, col['token_f']]:.3g}, "
                 f"prefill {h[-1, col['prefill_f']]:.3g}, per step {1e3 * h[-1, col['step_add']]:.1f} ms; the workers' "
                 f"steps went out {1e3 * eng.get('late_per_step', math.nan):.2f} ms late on average (wall)")
    return lines


PROBE_HEADER = ("| gateway | model | prompt tokens | requests | median err (after dispatch) | P90 | median ratio "
                "| median reported ms | its own prefill ms | observed ms | fixed-cost factor | per-token factor "
                "| prefill factor | tokens ahead (fitted backlog) | waiting: gateway's scrape / probe's "
                "| decoding: assumed / gateway's running / probe's |\n"
                "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")


def process_fleet(setup: Setup, model: str) -> dict[str, Any]:
    """The fleet file of the gateway's own process: the setup's, polled as the embedded one is,
    with the learned model off for `prior` (`gateway.learned_latency`)."""
    gateway = {**setup.fleet.get("gateway", {}), "health_interval_s": HEALTH_INTERVAL_S,
               "learned_latency": model != "prior"}
    return {**setup.fleet, "gateway": gateway, "admin_api_keys": [ADMIN_KEY]}


def access_records(log_text: str) -> dict[str, Seen]:
    """The gateway's TTFT, mean TPOT and prompt tokens per request id, from its JSON access log
    (the predicted TPOT, the decision's time and the hold left NaN: the decision log carries them)."""
    seen: dict[str, Seen] = {}
    for line in log_text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("logger") != "tokenfleet.access" or rec.get("ttft_ms") is None:
            continue
        tpot = rec.get("tpot_ms")
        seen[rec["request_id"]] = (rec["ttft_ms"] / 1000, math.nan, tpot / 1000 if tpot is not None else math.nan,
                                   float(rec.get("tokens_in") or math.nan), math.nan, math.nan)
    return seen


def decisions_seen(decisions: Sequence[dict[str, Any]], into: dict[str, tuple[float, float, float]]) -> None:
    """The chosen instance's predicted TPOT, the decision's wall-clock time and the time the gateway
    had held the request (`held_s`, in the header's TTFT since i19-arrive; 0 where the log has none:
    before it, when the header held none) per request id, from /debug/decisions' entries (a request's
    later decision, e.g. a retry's, overrides its earlier one)."""
    for d in decisions:
        chosen = next((c for c in d.get("candidates", ()) if c.get("name") == d.get("instance")), None)
        if chosen is not None and "tpot_s" in chosen.get("detail", {}):
            into[d["request_id"]] = (float(chosen["detail"]["tpot_s"]), float(d["time"]), float(d.get("held_s", 0.0)))


async def poll_decisions(url: str, limit: int, into: dict[str, tuple[float, float, float]],
                         stop: asyncio.Event) -> None:
    """Read /debug/decisions every DECISIONS_POLL_S until `stop`, once more after it."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        while True:
            stopping = stop.is_set()
            try:
                async with s.get(f"{url}/debug/decisions", params={"limit": str(limit)},
                                 headers={"Authorization": f"Bearer {KEY}"}) as r:
                    if r.status == 200:
                        decisions_seen((await r.json())["decisions"], into)
            except (aiohttp.ClientError, TimeoutError, ValueError):
                pass  # a missed poll shows as requests without a predicted TPOT (counted)
            if stopping:
                return
            try:
                await asyncio.wait_for(stop.wait(), DECISIONS_POLL_S)
            except TimeoutError:
                pass


END_METRICS = ("tokenfleet_router_refits_total", "tokenfleet_event_loop_lag_max_seconds",
               "tokenfleet_event_loop_lag_busy_max_seconds", "tokenfleet_admission_engine_wait_target_seconds",
               "tokenfleet_admission_prefill_rate_per_instance")


async def end_metrics(url: str) -> str:
    """What the gateway's /metrics says at the end of a run: its learned model's fits by result,
    its event loop's worst stall, SLOMax's control knobs (which explain a run's rejections)."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s, \
                s.get(f"{url}/metrics") as r:
            text = await r.text()
    except (aiohttp.ClientError, TimeoutError) as e:
        return f"/metrics not read: {type(e).__name__}"
    return "; ".join(line.removeprefix("tokenfleet_") for line in text.splitlines() if line.startswith(END_METRICS))


async def poll_admission(url: str, into: Path, stop: asyncio.Event) -> None:
    """SLOMax's state (`/admin/v1/admission`) every ADMISSION_POLL_S until `stop`, one JSON line
    each with the seconds since the first poll (`--admission-trace`)."""
    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        with into.open("w") as f:
            while not stop.is_set():
                try:
                    async with s.get(f"{url}/admin/v1/admission", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
                        if r.status == 200:
                            f.write(json.dumps({"t": round(time.monotonic() - t0, 3), **(await r.json())}) + "\n")
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    pass
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), ADMISSION_POLL_S)


async def run_process(setup: Setup, model: str, work: Sequence[tuple[str, int]], rate: float,
                      workdir: Path) -> tuple[list[Sent | None], dict[str, Seen]]:
    """`tokenfleet up` in its own process (peers' helpers), its engines its children; this process
    only sends. What the gateway saw comes from its access log and its decision log."""
    procs = peers.Processes(workdir)
    gw = None
    try:
        gw = await peers.start_gateway_fleet(procs, process_fleet(setup, model), setup.instances(), "tokenpilot",
                                             name=f"gateway-{model}", args=("--log-level", "info", "--log-format",
                                                                            "json"), timeout_s=900)
        url = gw.url.removesuffix("/v1")
        decided: dict[str, tuple[float, float, float]] = {}
        stop = asyncio.Event()
        # Enough of the log's last entries to span two polls at this rate; at most what it keeps.
        poller = asyncio.create_task(poll_decisions(url, min(256, int(2 * rate * DECISIONS_POLL_S) + 16), decided, stop))
        admission = asyncio.create_task(poll_admission(url, workdir / "admission.jsonl", stop))
        try:
            sent = await send_all(url, setup, work, rate)
        finally:
            stop.set()
            await poller
            await admission
        print(f"at the end: {await end_metrics(url)}", flush=True)
    finally:
        if gw is not None:
            procs.stop(gw, grace_s=60)  # it stops its engines first (vLLM's take a while)
        procs.stop_all()
    seen: dict[str, Seen] = {}
    for rid, (ttft, _, tpot, prompt_tokens, _, _) in access_records(gw.log.read_text(errors="replace")).items():
        pred_tpot, at, held = decided.get(rid, (math.nan, math.nan, math.nan))
        seen[rid] = (ttft, pred_tpot, tpot, prompt_tokens, at, held)
    return sent, seen


RUNNERS: dict[str, Callable[..., Awaitable[tuple[list[Sent | None], dict[str, Seen]]]]] = {
    "process": run_process, "embedded": run_embedded}


def errors(predicted: np.ndarray, observed: np.ndarray) -> np.ndarray:
    """Absolute % error per request where both are known."""
    ok = np.isfinite(predicted) & np.isfinite(observed) & (observed > 0)
    return 100 * np.abs(predicted[ok] - observed[ok]) / observed[ok]


def _q(e: np.ndarray, pct: float) -> float:
    return float(np.percentile(e, pct)) if len(e) else math.nan


def summary(mode: str, model: str, got: np.ndarray, sent: int, load: tuple[float, float]) -> str:
    half = got[len(got) // 2:]
    e, g, t = errors(half[:, P_TTFT], half[:, C_TTFT]), errors(half[:, P_TTFT], half[:, G_TTFT]), \
        errors(half[:, P_TPOT], half[:, G_TPOT])
    med: Callable[[int], float] = lambda col: 1000 * float(np.nanmedian(half[:, col]))
    gap = 1000 * float(np.nanmedian(half[:, C_TTFT] - half[:, G_TTFT]))
    unseen = int(np.sum(~np.isfinite(half[:, G_TTFT]) | ~np.isfinite(half[:, P_TPOT])))
    return (f"| {mode} | {model} | {len(half)} | {_q(e, 50):.0f}% | {_q(e, 90):.0f}% | {med(P_TTFT):.0f} "
            f"| {med(C_TTFT):.0f} | {_q(g, 50):.0f}% | {_q(g, 90):.0f}% | {med(G_TTFT):.0f} | {gap:.1f} "
            f"| {_q(t, 50):.0f}% | {_q(t, 90):.0f}% | {med(P_TPOT):.1f} | {med(G_TPOT):.1f} | {sent - len(got)} "
            f"| {unseen} | {load[0]:.1f} -> {load[1]:.1f} |")


SUMMARY_HEADER = (
    "| gateway | model | requests (second half) | TTFT median err | TTFT P90 err | median predicted ms "
    "| median observed ms | vs gateway's TTFT: median err | P90 err | gateway's median ms "
    "| client - gateway median ms | TPOT median err | TPOT P90 err | median predicted TPOT ms "
    "| median observed TPOT ms | not answered | no gateway record | load (1 min) before -> after |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")


def bias(mode: str, model: str, got: np.ndarray) -> str:
    """Is the second half's error against the gateway's TTFT a bias? The median ratio of
    predicted to observed, their correlation, what is left after the best constant shift (the
    median of observed - predicted) and the best constant scale (the median ratio), the ratio
    for the shorter and the longer half of the prompts (a fixed cost the prediction leaves out
    shows as a higher ratio for long prompts than for short ones), and the error of the prediction
    from the dispatch (the header less the hold in it, HELD) against the client's TTFT from the
    decision on (the span that prediction is of), with the time before it and the hold."""
    half = got[len(got) // 2:]
    ok = np.isfinite(half[:, P_TTFT]) & np.isfinite(half[:, G_TTFT]) & (half[:, G_TTFT] > 0)
    h = half[ok]
    p, o = h[:, P_TTFT], h[:, G_TTFT]
    if len(p) < 4:
        return f"| {mode} | {model} | too few rows |"
    ratio = float(np.median(p / o))
    shift = float(np.median(o - p))
    e_shift, e_scale = errors(p + shift, o), errors(p / ratio, o)
    corr = float(np.corrcoef(p, o)[0, 1])
    long = h[:, PROMPT] > np.median(h[:, PROMPT])
    short_ratio, long_ratio = (float(np.median(p[m] / o[m])) if m.any() else math.nan for m in (~long, long))
    after = errors(p - np.nan_to_num(h[:, HELD]), h[:, C_TTFT] - h[:, PRE])
    pre = 1000 * float(np.nanmedian(h[:, PRE]))
    held = 1000 * np.nan_to_num(h[:, HELD])
    return (f"| {mode} | {model} | {ratio:.2f} | {corr:.2f} | {1000 * shift:+.1f} | {_q(e_shift, 50):.0f}% "
            f"| {_q(e_shift, 90):.0f}% | {_q(e_scale, 50):.0f}% | {_q(e_scale, 90):.0f}% | {short_ratio:.2f} "
            f"| {long_ratio:.2f} | {pre:.1f} | {np.median(held):.1f} / {_q(held, 90):.1f} | {_q(after, 50):.0f}% "
            f"| {_q(after, 90):.0f}% |")


BIAS_HEADER = (
    "| gateway | model | median predicted / gateway's TTFT | correlation | best shift ms | after shift: median err "
    "| P90 | after scale: median err | P90 | ratio, shorter half of prompts | longer half "
    "| send to decision median ms | held in the header: median / P90 ms "
    "| from the dispatch vs client's TTFT from the decision: median err | P90 |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")


def by_length(mode: str, model: str, got: np.ndarray, parts: int = 5) -> list[str]:
    """The second half's median predicted and gateway TTFT per prompt-length quantile: the
    prediction's shape against the prompt (a step floor it has too high, a per-token cost too low)."""
    half = got[len(got) // 2:]
    h = half[np.isfinite(half[:, G_TTFT]) & np.isfinite(half[:, P_TTFT])]
    if len(h) < parts:
        return []
    edges = np.quantile(h[:, PROMPT], np.linspace(0, 1, parts + 1))
    which = np.clip(np.searchsorted(edges, h[:, PROMPT], side="right") - 1, 0, parts - 1)
    lines = []
    for b in range(parts):
        r = h[which == b]
        if len(r) == 0:
            continue
        pm, om = 1000 * np.median(r[:, P_TTFT]), 1000 * np.median(r[:, G_TTFT])
        lines.append(f"| {mode} | {model} | {edges[b]:.0f}-{edges[b + 1]:.0f} | {len(r)} | {pm:.1f} | {om:.1f} "
                     f"| {np.median(r[:, P_TTFT] / r[:, G_TTFT]):.2f} | {_q(errors(r[:, P_TTFT], r[:, G_TTFT]), 50):.0f}% |")
    return lines


LENGTH_HEADER = ("| gateway | model | prompt tokens | requests | median predicted ms | median gateway's TTFT ms "
                 "| median ratio | median err |\n|---|---|---|---:|---:|---:|---:|---:|")


def provenance(argv: Sequence[str]) -> str:
    """What a doc needs beside the figures: the command, the commit, the inputs' checksums, the machine."""
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True).stdout.strip()
    dirty = " (+ uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else ""
    sha = hashlib.sha256(TRACE.read_bytes()).hexdigest()
    return (f"command: python bench/latency_live.py {shlex.join(argv)}\n"
            f"commit: {git('rev-parse', '--short', 'HEAD')}{dirty}; at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}\n"
            f"trace: {TRACE.relative_to(REPO)} sha256 {sha}; {os.cpu_count()} CPUs; "
            f"load average (1/5/15 min) {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    p.add_argument("--requests", type=int, default=1200)
    p.add_argument("--rate", type=float, default=40.0)
    p.add_argument("--models", default="prior,learned")
    p.add_argument("--gateway", default="process",
                   help=f"where the gateway runs: {' or '.join(MODES)}, or several, comma-separated, run "
                        "interleaved (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the prompts' text (the same for every run of one seed)")
    p.add_argument("--prompt-min", type=int, default=None, help="clip prompts from below (tokens; default: the engine's)")
    p.add_argument("--prompt-max", type=int, default=None, help="... from above")
    p.add_argument("--instances", type=int, default=1, help="vLLM engines (--engine vllm)")
    p.add_argument("--model-dir", type=Path, default=Path("~/.cache/tokenfleet/tiny-llama").expanduser(),
                   help="the tiny model (--engine vllm; made there if missing)")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/tokenfleet-latency-live"),
                   help="the vLLM engines' logs (--engine vllm), and the gateway processes' (a run's own folder)")
    p.add_argument("--probe", default=None, metavar="PREFIX",
                   help="embedded gateway only: per request, what TokenPilot's reported TTFT was made of and the "
                        "engine's own view (`Probe`), written to PREFIX.MODEL.json, and a table by prompt length")
    p.add_argument("--save", default=None,
                   help="write each run's rows (predicted, client, gateway TTFT s; the same for TPOT; "
                        "prompt tokens) to SAVE.MODE.MODEL.npy (SAVE.MODE.MODEL.I.npy for the I-th model named, I > 0)")
    a = p.parse_args(argv)
    modes = a.gateway.split(",")
    if not modes or any(m not in MODES for m in modes):
        p.error(f"--gateway: {a.gateway!r}: each of {', '.join(MODES)}")
    if a.probe and modes != ["embedded"]:
        p.error("--probe reads the router's internals: it needs --gateway embedded")
    a.log_dir.mkdir(parents=True, exist_ok=True)
    if a.engine == "vllm":
        setup = vllm_setup(a.model_dir, VLLM_VENV / "bin" / "python", a.instances, a.log_dir)
        print(f"vLLM on CPU, {a.instances} instance(s); prompt text: {setup.tokens_per_word:.2f} tokens a word")
    else:
        setup = sim_setup()
    if a.prompt_min is not None or a.prompt_max is not None:
        lo, hi = setup.prompt_range
        setup = replace(setup, prompt_range=(a.prompt_min or lo, a.prompt_max or hi))
    print(provenance(argv), flush=True)
    work = prompts(setup, a.requests, a.seed)
    runs = tempfile.mkdtemp(prefix="run-", dir=a.log_dir)
    print(f"gateway logs: {runs}")
    results = []
    probes: list[tuple[str, str, Probe]] = []
    for i, model in enumerate(a.models.split(",")):  # a model named again is another round
        for mode in modes:
            before = os.getloadavg()[0]
            workdir = Path(runs) / f"{i}-{mode}-{model}"
            workdir.mkdir()
            probe = Probe() if a.probe else None
            sent, seen = asyncio.run(run_embedded(setup, model, work, a.rate, workdir, probe) if probe
                                     else RUNNERS[mode](setup, model, work, a.rate, workdir))
            if probe is not None:
                Path(f"{a.probe}.{model}.json").write_text(json.dumps(
                    {"columns": PROBE_COLUMNS, "rows": probe.table().tolist(), "timeline": probe.timeline}))
                probes.append((mode, model, probe))
            got = np.array(joined(sent, seen), dtype=float).reshape(-1, HELD + 1)
            if a.save:
                Path(a.save).parent.mkdir(parents=True, exist_ok=True)
                np.save(f"{a.save}.{mode}.{model}{'.' + str(i) if i else ''}.npy", got)
            results.append((mode, model, got, len(sent), (before, os.getloadavg()[0])))
            print(f"done: {mode} {model}, {len(got)} of {len(sent)} answered, load {results[-1][4][1]:.2f}", flush=True)
    print(SUMMARY_HEADER)
    for mode, model, got, sent_n, load in results:
        print(summary(mode, model, got, sent_n, load))
    print()
    print(BIAS_HEADER)
    for mode, model, got, _, _ in results:
        print(bias(mode, model, got))
    print()
    print(LENGTH_HEADER)
    for mode, model, got, _, _ in results:
        print("\n".join(by_length(mode, model, got)))
    if probes:
        print()
        print(PROBE_HEADER)
        for mode, model, probe in probes:
            print("\n".join(probe_report(mode, model, probe)))
    print(f"load average after (1/5/15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
