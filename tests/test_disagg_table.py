"""bench/disagg_table.py: the `off at N` row from a second report and its targets (bench/DISAGG.md)."""

from __future__ import annotations

from typing import Any

from tests.bench_scripts import REPO, load_bench


def row(mode: str, goodput: float, ttft: float, tpot: float) -> dict[str, Any]:
    return {"disagg": mode, "goodput_tok_s": goodput, "slo_attainment": 0.5,
            "ttft_ms": {"p95": ttft}, "tpot_ms": {"p95": tpot}}


def report(fleet: str, *rows: dict[str, Any]) -> dict[str, Any]:
    return {"workload": {"name": "w", "rate_scale": 5.5, "requests": 10}, "fleet": {"file": fleet},
            "results": list(rows)}


def test_an_off_report_at_the_pd_budget_adds_its_row_and_the_targets_against_it(tmp_path) -> None:
    t = load_bench("disagg_table")
    fleet = tmp_path / "off1024.yaml"
    text = (REPO / "deploy/sim/pd32.yaml").read_text()
    fleet.write_text(text.replace("max_num_batched_tokens: 8192,", "max_num_batched_tokens: 1024,"))
    main = report(str(REPO / "deploy/sim/pd32.yaml"), row("off", 100, 10, 200), row("static", 150, 20, 100),
                  row("elastic", 260, 8, 110))
    out = t.table(main, report(str(fleet), row("off", 200, 9, 120)))
    modes = [line.split(" | ")[0][2:] for line in out if line.startswith("| ") and "goodput tok/s" not in line
             and not line.startswith("| target")][:4]
    assert modes == ["off", "off at 1,024", "static", "elastic"]
    checks = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in out if "elastic /" in line}
    assert checks["goodput elastic / colocated >= 1.3x"] == ["2.60x", "yes |"]
    assert checks["goodput elastic / off at 1,024 >= 1.3x"] == ["1.30x", "yes |"]
    assert checks["TTFT p95 elastic / off at 1,024 <= 1x"] == ["0.89x", "yes |"]
    assert checks["TPOT p95 elastic / off at 1,024 <= 0.7x"] == ["0.92x", "no |"]
    assert checks["goodput elastic / best other (static) >= 1.1x"] == ["1.73x", "yes |"]
    assert not any("off at" in line for line in t.table(main))  # one report: the table as before
