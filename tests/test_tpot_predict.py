"""bench/tpot_predict.py: the fit on hand-made records, and the table on a small row."""

from __future__ import annotations

import pytest

from fleetcore.types import RequestOutcome
from tests.bench_scripts import load_bench

tp = load_bench("tpot_predict")
lr = load_bench("latency_recorder")


def _row(i: int, pred_ms: float, got_ms: float, streams: float, out: int = 100) -> object:
    o = RequestOutcome(f"r{i}", "a", "s", ok=True, output_tokens=out, mean_tpot_s=got_ms / 1e3)
    return lr.Recorded(f"r{i}", 0.0, 0.0, {"prior_tpot_s": pred_ms / 1e3}, o,
                       features=(0.0, 0.0, 0.0, streams, streams * 1e-3))


def test_calibrated_and_uninformative_predictions() -> None:
    # observed = 0.5 x predicted + 10 ms exactly, and the streams say nothing (alternating)
    rows = [_row(i, 20.0 + i, 10.0 + 0.5 * (20.0 + i), streams=float(i % 2)) for i in range(20)]
    rows.append(_row(99, 500.0, 1.0, 0.0, out=10))  # too short an answer: left out
    t = tp.table(rows, min_out=50)
    assert t["n"] == 20
    assert t["slope"] == pytest.approx(0.5) and t["r2_pred"] == pytest.approx(1.0)
    assert t["r2_streams"] < 0.05


def test_table_on_a_small_prefix(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from workloads.generators import chat_sessions

    chat_sessions(sessions=60, rate=3.0, seed=1).to_jsonl(str(tmp_path / "chat.jsonl"))
    assert tp.main([str(tmp_path), "--rows", "chat-60", "--max", "60", "--min-out", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| chat-60 |")]
    assert len(rows) == 1 and int(rows[0].split(" | ")[1]) > 10
