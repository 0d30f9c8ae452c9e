"""bench/goodput_span.py: the stall count beside the last request, and the table on a small row."""

from __future__ import annotations

import pytest

from fleetsim.metrics import RequestRecord
from tests.bench_scripts import load_bench

gs = load_bench("goodput_span")


def _rec(rid: str, arrival: float, instance: str, prompt: int = 100, cached: int = 0,
         ttft: float = 0.1, end: float = 1.0) -> RequestRecord:
    return RequestRecord(rid, arrival, prompt, "ok", cached_tokens=cached, ttft_s=ttft, end_s=end,
                         instance=instance, output_tokens=10)


def test_stalls_count_only_prefills_beside_it_while_it_decodes() -> None:
    last = _rec("last", 1.0, "a", ttft=0.5, end=10.0)  # decodes from 1.5 s to 10 s
    records = [
        last,
        _rec("before", 1.2, "a", prompt=500, cached=100),  # arrived during its prefill: not counted
        _rec("during", 2.0, "a", prompt=800, cached=300),  # 500 uncached, counted
        _rec("during2", 9.9, "a", prompt=64, cached=0),  # 64, counted
        _rec("elsewhere", 3.0, "b", prompt=900),  # another instance
        _rec("after", 10.5, "a", prompt=900),  # after it ended
    ]
    assert gs.stalls_during(records, last) == 564


def test_table_row_on_a_small_prefix(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from workloads.generators import chat_sessions

    chat_sessions(sessions=40, rate=3.0, seed=1).to_jsonl(str(tmp_path / "chat.jsonl"))
    assert gs.main([str(tmp_path), "--rows", "chat-60", "--max", "40", "--seeds", "0,1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| chat-60 |")]
    assert [r.split(" | ")[1] for r in rows] == ["0", "1"]
    for r in rows:
        cells = r.split(" | ")
        assert cells[3] in gs.PEERS
        assert float(cells[5].rstrip("x")) > 0 and float(cells[6].rstrip("x")) > 0


def test_decode_load_weights_co_runners_by_overlap() -> None:
    # r decodes from 1.0 to 3.0 on "a"; q from 2.0 to 5.0 (half of r's decode), w on "b".
    r = _rec("r", 0.5, "a", ttft=0.5, end=3.0)
    q = _rec("q", 1.5, "a", prompt=1000, cached=200, ttft=0.5, end=5.0)  # output 10: context 1005
    w = _rec("w", 1.5, "b", prompt=4000, ttft=0.5, end=5.0)
    load = gs.decode_load([r, q, w])
    assert load["r"]["streams"] == pytest.approx(0.5)
    assert load["r"]["context"] == pytest.approx(0.5 * 1005)
    assert load["r"]["prefill_tok_s"] == pytest.approx(800 / 2.0)  # q's first token at 2.0, inside r's decode
    assert load["q"]["streams"] == pytest.approx(1.0 / 3.0)
    assert load["q"]["prefill_tok_s"] == 0.0  # r's first token came before q's decode
    assert load["w"]["streams"] == 0.0
