"""bench/ranking_ab.py: an A/B of an unchanged config is a tie, run by run, at any seed; --peers
adds the best peer's goodput and TokenPilot's ratio to it."""

from __future__ import annotations

import pytest

from tests.bench_scripts import load_bench

ab = load_bench("ranking_ab")


def _rows(out: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| chat-60 |")]


@pytest.mark.parametrize("seed", ["0", "3"])
def test_unchanged_config_ties_and_peers_are_compared(tmp_path, capsys: pytest.CaptureFixture[str],
                                                      seed: str) -> None:
    from workloads.generators import chat_sessions

    chat_sessions(sessions=40, rate=3.0, seed=1).to_jsonl(str(tmp_path / "chat.jsonl"))
    # locality_weight=1.0 is the default: the second run must decide exactly as the first
    assert ab.main([str(tmp_path), "--rows", "chat-60", "--max", "40", "--seed", seed, "--peers",
                    "--set", "locality_weight=1.0"]) == 0
    default, changed = _rows(capsys.readouterr().out)
    assert default[1] == "default" and changed[1] == "locality_weight=1.0"
    assert default[2:7] == changed[2:7]  # goodput, SLO, TTFT p50 / p95, span
    assert changed[7] == "1.000x"
    peer, peer_goodput = changed[8].split()
    assert peer in ab.PEERS and float(peer_goodput) > 0
    assert default[8] == changed[8]
    # (the goodputs are printed rounded to 1 tok/s, the ratio from the unrounded ones)
    ratio, shown = float(changed[9].rstrip("x")), float(changed[2]) / float(peer_goodput)
    assert abs(ratio - shown) <= 1 / float(peer_goodput) + 1e-4
