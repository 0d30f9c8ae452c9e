"""`tokenfleet simulate --plot DIR`: the run's figures as PNG files (matplotlib, the [plot] extra).

    ttft_cdf.png        TTFT CDF per run (log x), dashed lines at each class's TTFT target
    tpot_cdf.png        the same for TPOT (mean inter-token time of each completed request)
    goodput_time.png    goodput over simulated time per run (tokens/s of requests that met their SLO,
                        booked when they ended, in equal bins)
    sites.png           per site: goodput and throughput per run (bars)
    classes.png         per class: SLO attainment and goodput per run (bars)

`--plot` given a name ending in `.png` (the older form) writes the TTFT CDF there and the
others beside it as `NAME-tpot_cdf.png` and so on. matplotlib is imported only here;
`require_matplotlib` is called before any simulation work, so a missing one is a clear
error at once, not after a long run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fleetcore.slo import ClassSLO

from .metrics import RequestRecord, slo_met

FIGURES = ("ttft_cdf", "tpot_cdf", "goodput_time", "sites", "classes")
TIME_BINS = 40


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed (an optional extra of TokenFleet)."""


def require_matplotlib() -> Any:
    """The pyplot module on the file-only backend; PlotUnavailable with the fix otherwise."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only, never a window
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib, which TokenFleet does not install by default: "
                              "pip install 'tokenfleet[plot]' (or pip install matplotlib)") from None
    return plt


def plot_paths(target: str | Path) -> dict[str, Path]:
    """Where each figure goes: DIR/NAME.png, or for `X.png` X.png (the TTFT CDF) and X-NAME.png."""
    t = Path(target)
    if t.suffix.lower() == ".png":
        return {name: t if name == "ttft_cdf" else t.with_name(f"{t.stem}-{name}.png") for name in FIGURES}
    return {name: t / f"{name}.png" for name in FIGURES}


@dataclass(frozen=True, slots=True)
class Run:
    """One simulated run: its label, its result row (`report.result_row` + by_site) and records."""

    label: str
    row: Mapping[str, Any]
    records: Sequence[RequestRecord]


def write_plots(target: str | Path, runs: Sequence[Run], slos: Mapping[str, ClassSLO], title: str = "") -> list[Path]:
    """Draw every figure; returns the files written. Raises PlotUnavailable or OSError."""
    plt = require_matplotlib()
    paths = plot_paths(target)
    next(iter(paths.values())).parent.mkdir(parents=True, exist_ok=True)
    cdf(plt, [(r.label, [x.ttft_s for x in r.records if x.status == "completed" and x.ttft_s is not None])
              for r in runs], "ttft_s", slos, "TTFT", paths["ttft_cdf"], title)
    cdf(plt, [(r.label, [x.tpot_s for x in r.records if x.status == "completed" and x.tpot_s is not None])
              for r in runs], "tpot_s", slos, "TPOT", paths["tpot_cdf"], title)
    goodput_over_time(plt, runs, slos, paths["goodput_time"], title)
    groups(plt, runs, "by_site", "site", paths["sites"], title,
           [("goodput_tok_s", "goodput (tok/s)"), ("throughput_tok_s", "throughput (tok/s)")])
    groups(plt, runs, "by_class", "class", paths["classes"], title,
           [("slo_attainment", "SLO attainment"), ("goodput_tok_s", "goodput (tok/s)")])
    return list(paths.values())


def _save(plt: Any, fig: Any, path: Path, title: str) -> None:
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def cdf(plt: Any, curves: Sequence[tuple[str, Sequence[float]]], slo_field: str, slos: Mapping[str, ClassSLO],
        what: str, path: Path, title: str = "") -> None:
    """One CDF per run in ms on a log x axis, the classes' targets as dashed reference lines:
    where a curve crosses one is the bound on that class's attainment."""
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    drawn = False
    for name, values in curves:
        v = np.sort(np.asarray(values, dtype=float) * 1e3)
        v = v[v > 0]  # a log axis has no zero
        if len(v) == 0:
            continue
        ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=f"{name} ({len(v)})")
        drawn = True
    for name, slo in sorted(slos.items()):
        bound = getattr(slo, slo_field)
        if bound is not None:
            ax.axvline(bound * 1e3, color="grey", linestyle="--", linewidth=0.8)
            ax.text(bound * 1e3, 0.02, f" {name} SLO", rotation=90, fontsize=7, color="grey", va="bottom")
    ax.set_xscale("log")
    ax.set_xlabel(f"{what} (ms, log scale)")
    ax.set_ylabel("fraction of completed requests")
    ax.set_ylim(0, 1)
    ax.grid(True, which="both", alpha=0.3)
    if drawn:
        ax.legend(fontsize=8, loc="lower right")
    else:
        ax.text(0.5, 0.5, f"no completed request has a {what}", transform=ax.transAxes, ha="center")
    _save(plt, fig, path, title)


def goodput_series(records: Sequence[RequestRecord], slos: Mapping[str, ClassSLO], t0: float, t1: float,
                   bins: int = TIME_BINS) -> tuple[np.ndarray, np.ndarray]:
    """(bin centres in s from t0, goodput tok/s per bin): output of requests that met their SLO,
    booked to the bin they ended in."""
    edges = np.linspace(t0, max(t1, t0 + 1e-9), bins + 1)
    ends = [(r.end_s if r.end_s is not None else r.arrival_s + (r.e2e_s or 0.0), r.output_tokens)
            for r in records if slo_met(r, slos)]
    tokens, _ = np.histogram([e for e, _ in ends], bins=edges, weights=[n for _, n in ends])
    width = edges[1] - edges[0]
    return (edges[:-1] + width / 2) - t0, tokens / width


def goodput_over_time(plt: Any, runs: Sequence[Run], slos: Mapping[str, ClassSLO], path: Path,
                      title: str = "") -> None:
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    times = [r.arrival_s for run in runs for r in run.records]
    ends = [r.end_s for run in runs for r in run.records if r.end_s is not None]
    if times:
        t0, t1 = min(times), max(times + ends)
        for run in runs:  # one time axis for all runs, so their curves line up
            x, y = goodput_series(run.records, slos, t0, t1)
            ax.plot(x, y, label=run.label, linewidth=1.2, drawstyle="steps-mid")  # binned: steps, not slopes
        ax.legend(fontsize=8)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("goodput (tok/s of requests within SLO)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    _save(plt, fig, path, title)


def groups(plt: Any, runs: Sequence[Run], key: str, noun: str, path: Path, title: str,
           panels: Sequence[tuple[str, str]]) -> None:
    """Grouped bars: one group per site (or class), one bar per run, one panel per figure."""
    names = sorted({g for run in runs for g in run.row.get(key, {})})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), dpi=120, squeeze=False)
    width = 0.8 / max(1, len(runs))
    for ax, (field, label) in zip(axes[0], panels):
        for i, run in enumerate(runs):
            vals = [run.row.get(key, {}).get(g, {}).get(field) for g in names]
            ax.bar(np.arange(len(names)) + (i - (len(runs) - 1) / 2) * width,
                   [0.0 if v is None else v for v in vals], width, label=run.label)
        ax.set_xticks(np.arange(len(names)), names, rotation=30 if len(names) > 4 else 0, fontsize=8)
        ax.set_xlabel(noun)
        ax.set_ylabel(label)
        if field == "slo_attainment":
            ax.set_ylim(0, 1)
        ax.grid(True, axis="y", alpha=0.3)
        if not names:
            ax.text(0.5, 0.5, f"no {noun} in the results", transform=ax.transAxes, ha="center")
    axes[0][0].legend(fontsize=8)
    _save(plt, fig, path, title)
