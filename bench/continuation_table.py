"""Goodput under engine failures, with and without continuation: the table of bench/CONTINUATION.md.

    .venv/bin/python bench/continuation_table.py [--trace FILE] [--rate-scale X] [--policy P]
        [--seeds 0,1,2] [--rates 1] [--max-requests N] [--out DIR] [--report-only] [--only PREFIX]

For every seed: one `tokenfleet simulate` run without failures (the baseline), and for every
rate R in `--rates` four runs — `--fail-rate R` and `--stall-rate R`, each with continuation
and with `--no-continuation` — each written to DIR/<label>-s<seed>.json (`--report-only`
reads them instead of running). Then a markdown table: per configuration the mean over the
seeds of goodput, its ratio to the same seed's baseline (mean and worst), the same for the good
tokens (goodput x span: the rate moves with the span, which one late request stretches), SLO attainment,
failures, continuations, failed requests, re-prefilled tokens and the time lost per
continuation (mean over the seeds of each run's p50 and p95). The runs go through
`fleetsim.cli.main`, the same code as the command line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fleetsim.cli import main as simulate  # noqa: E402


def configs(rates: list[float]) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = [("none", [])]
    for r in rates:
        for kind, flag in (("deaths", "--fail-rate"), ("stalls", "--stall-rate")):
            out.append((f"{kind}-{r:g}", [flag, f"{r:g}"]))
            out.append((f"{kind}-{r:g}-nocont", [flag, f"{r:g}", "--no-continuation"]))
    return out


def describe(label: str) -> str:
    if label == "none":
        return "no failures"
    kind, rate, *rest = label.split("-")
    return f"{kind} {rate}/instance-h, " + ("no continuation" if rest else "continuation")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_all(args: argparse.Namespace, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        for label, flags in configs(args.rates):
            if args.only and not label.startswith(args.only):
                continue
            dest = out / f"{label}-s{seed}.json"
            argv = ["simulate", "--trace", args.trace, "--policy", args.policy, "--rate-scale", f"{args.rate_scale:g}",
                    "--seed", str(seed), "--no-progress", "--json", str(dest), *flags]
            if args.max_requests:
                argv += ["--max-requests", str(args.max_requests)]
            print("+ tokenfleet " + " ".join(argv), file=sys.stderr, flush=True)
            if simulate(argv) != 0:
                raise SystemExit(f"run failed: {argv}")


def _row(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())["results"][0]


def _good_tokens(row: dict[str, Any]) -> float:
    """Output tokens of the requests that met their SLO: goodput x the run's span. The rate alone
    moves with the span (first arrival to last end), which one late request can stretch."""
    return row["goodput_tok_s"] * row["sim"]["span_s"]


def table(args: argparse.Namespace, out: Path) -> str:
    lines = ["| configuration | goodput tok/s | vs no failures (mean / worst) | good tokens vs no failures "
             "(mean / worst) | SLO % | deaths / stalls | continued requests | failed requests | re-prefilled tokens "
             "| time lost p50 / p95 ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = {s: _row(out / f"none-s{s}.json") for s in args.seeds}
    for label, _ in configs(args.rates):
        rows = [_row(out / f"{label}-s{s}.json") for s in args.seeds]
        good = [r["goodput_tok_s"] for r in rows]
        ratio = [r["goodput_tok_s"] / base[s]["goodput_tok_s"] for r, s in zip(rows, args.seeds)]
        tokens = [_good_tokens(r) / _good_tokens(base[s]) for r, s in zip(rows, args.seeds)]
        slo = statistics.mean(100 * r["slo_attainment"] for r in rows)
        f = [r.get("failures") for r in rows]
        if f[0] is None:
            fails = conts = failed = reprefill = lost = "-"
        else:
            fails = f"{statistics.mean(x['deaths'] for x in f):.1f} / {statistics.mean(x['stalls'] for x in f):.1f}"
            conts = f"{statistics.mean(x['continued_requests'] for x in f):.1f}"
            failed = f"{statistics.mean(x['failed_requests'] for x in f):.1f}"
            reprefill = f"{statistics.mean(x['reprefill_tokens'] for x in f):,.0f}"
            p50 = [x["time_lost_per_continuation_ms"]["p50"] for x in f if x["time_lost_per_continuation_ms"]["p50"]]
            p95 = [x["time_lost_per_continuation_ms"]["p95"] for x in f if x["time_lost_per_continuation_ms"]["p95"]]
            lost = f"{statistics.mean(p50):,.0f} / {statistics.mean(p95):,.0f}" if p50 else "-"
        lines.append(f"| {describe(label)} | {statistics.mean(good):,.0f} | {statistics.mean(ratio):.4f} / "
                     f"{min(ratio):.4f} | {statistics.mean(tokens):.4f} / {min(tokens):.4f} | {slo:.2f} | {fails} "
                     f"| {conts} | {failed} | {reprefill} | {lost} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=str(ROOT / "traces" / "conversation_trace.jsonl.gz"))
    p.add_argument("--rate-scale", type=float, default=3.46)
    p.add_argument("--policy", default="tokenpilot")
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2, 3, 4])
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[1.0])
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--out", default="bench_out/continuation")
    p.add_argument("--report-only", action="store_true", help="only build the table from the JSON in --out")
    p.add_argument("--only", default="", metavar="PREFIX",
                   help="run only the configurations whose label starts so (none, deaths, stalls); the table "
                        "still reads them all")
    args = p.parse_args(argv)
    out = Path(args.out)
    if not args.report_only:
        run_all(args, out)
    print(f"trace {args.trace} sha256 {sha256(Path(args.trace))}, policy {args.policy}, "
          f"rate-scale {args.rate_scale:g}, seeds {','.join(map(str, args.seeds))}"
          + (f", first {args.max_requests} requests" if args.max_requests else ""))
    print(table(args, out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
