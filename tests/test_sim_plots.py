"""`tokenfleet simulate --plot`: the figures, the early matplotlib check, the per-class table."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fleetcore.slo import ClassSLO
from fleetsim import cli
from fleetsim.metrics import RequestRecord
from fleetsim.plots import FIGURES, goodput_series, plot_paths
from fleetsim.report import format_table

PNG = b"\x89PNG\r\n\x1a\n"


def _inputs(tmp_path: Path) -> tuple[Path, Path]:
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": 150 * i, "input_length": 600 if i % 3 else 9000, "output_length": 8,
             "hash_ids": [0, i + 1], "region": "r1" if i % 2 else "r2"} for i in range(24)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fleet = tmp_path / "f.yaml"
    fleet.write_text(json.dumps({
        "regions": ["r1", "r2"], "default_region": "r1",
        "sites": [{"name": "s1", "region": "r1", "jurisdiction": "j", "rtt_ms": {"r1": 1, "r2": 30}},
                  {"name": "s2", "region": "r2", "jurisdiction": "j", "rtt_ms": {"r1": 30, "r2": 1}}],
        "models": [{"name": "m", "engine": {"spec": "llama-3.1-8b"}}],
        "deployments": [{"site": "s1", "model": "m", "instances": 1, "gpu": "H100"},
                        {"site": "s2", "model": "m", "instances": 1, "gpu": "H100"}]}))
    return trace, fleet


def test_simulate_plot_dir_writes_every_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace, fleet = _inputs(tmp_path)
    out = tmp_path / "figs"
    rc = cli.main(["--trace", str(trace), "--fleet", str(fleet), "--policy", "round_robin,least_loaded",
                   "--plot", str(out), "--json", str(tmp_path / "r.json"), "--no-progress"])
    said = capsys.readouterr()
    err = said.out + said.err
    assert rc == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    assert set(report["results"][0]["by_site"]) == {"s1", "s2"}  # the site bars have two groups
    assert set(report["results"][0]["by_class"]) == {"interactive", "long_context"}
    for name in FIGURES:
        png = out / f"{name}.png"
        data = png.read_bytes()
        assert data[:8] == PNG and len(data) > 10_000, (name, len(data))  # an empty axes is ~5 KB
        assert str(png) in err


def test_plot_png_name_keeps_the_ttft_cdf_there_and_the_rest_beside_it(tmp_path: Path) -> None:
    paths = plot_paths(tmp_path / "run.png")
    assert paths["ttft_cdf"] == tmp_path / "run.png" and paths["sites"] == tmp_path / "run-sites.png"
    trace, fleet = _inputs(tmp_path)
    assert cli.main(["--trace", str(trace), "--fleet", str(fleet), "--policy", "round_robin",
                     "--plot", str(tmp_path / "run.png"), "--no-progress", "--max-requests", "6"]) == 0
    assert all(p.read_bytes()[:8] == PNG for p in paths.values())


def test_plot_without_matplotlib_fails_before_any_simulation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    trace, fleet = _inputs(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError

    def no_work(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("simulation work started before the matplotlib check")

    monkeypatch.setattr(cli, "prepare", no_work)
    monkeypatch.setattr(cli, "estimate_capacity", no_work)
    rc = cli.main(["--trace", str(trace), "--fleet", str(fleet), "--plot", str(tmp_path / "figs"), "--no-progress"])
    assert rc == 2
    assert "pip install 'tokenfleet[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "figs").exists()


def test_goodput_series_books_met_output_to_the_bin_it_ended_in() -> None:
    slos = {"interactive": ClassSLO(ttft_s=1.0)}

    def rec(i: int, ttft: float, end: float) -> RequestRecord:
        return RequestRecord(f"r{i}", arrival_s=end - 1, prompt_tokens=10, status="completed",
                             request_class="interactive", output_tokens=100, ttft_s=ttft, e2e_s=1.0, end_s=end)

    records = [rec(0, 0.5, 1.0), rec(1, 0.5, 9.5), rec(2, 2.0, 9.5)]  # r2 missed its TTFT target
    x, y = goodput_series(records, slos, 0.0, 10.0, bins=10)
    assert np.allclose(x, np.arange(10) + 0.5)
    assert y[1] == 100 and y[9] == 100 and y.sum() == 200  # 1 s bins: tokens/s == tokens


def test_per_class_table_labels_each_column() -> None:
    group = {"requests": 7, "slo_attainment": 0.5, "goodput_tok_s": 12.0, "ttft_ms": {"p95": 340.0}}
    row = {"policy": "p", "completed": 7, "rejected": 0, "cancelled": 0,
           "ttft_ms": {"p50": 1.0, "p95": 2.0, "p99": 3.0}, "tpot_ms": {"p50": 1.0, "p95": 2.0},
           "throughput_tok_s": 1.0, "goodput_tok_s": 1.0, "slo_attainment": 1.0, "cache_hit_rate": 0.0,
           "wall_s": 0.1, "by_class": {"interactive": group}}
    lines = format_table([row]).splitlines()
    head, values = lines[-2], lines[-1]
    assert "interactive n" in head and "SLO%" in head and "good/s" in head and "ttft95" in head
    # every value sits right under its own header (right-aligned columns end together)
    for label, value in (("interactive n", "7"), ("SLO%", "50.0"), ("good/s", "12"), ("ttft95", "340")):
        assert head.index(label) + len(label) == values.index(value, head.index(label) - 6) + len(value), label
