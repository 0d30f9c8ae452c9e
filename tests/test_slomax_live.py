"""Noisy neighbour, live: the real gateway with SLOMax over simulated worker processes.

One tenant floods long prompts (all at once, ~100% of the fleet's KV and seconds of its
prefill); the other tenant's interactive P95 TTFT stays within its SLO. The same run
under FCFS misses it by an order of magnitude (bench/noisy_live.py, bench/SLOMAX.md).
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.paths import REPO

pytestmark = pytest.mark.asyncio(loop_scope="function")


def _bench() -> object:
    spec = importlib.util.spec_from_file_location("noisy_live", REPO / "bench" / "noisy_live.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["noisy_live"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
async def test_flooding_tenant_does_not_push_others_interactive_p95_ttft_past_slo() -> None:
    bench = _bench()
    r = await bench.run("slomax", flood=32, chats=30)  # type: ignore[attr-defined]
    assert r["chat_ok"] == r["chat_requests"] == 30  # no chat turned away
    assert r["chat_ttft_p95_s"] <= r["slo_ttft_s"], r
    # The flood was served as far as it could be within its own SLO, the rest refused with a reason.
    # How many of it get through varies run to run: 5 in most, 4 in some, and 1 in about one run
    # in eight (seen on this commit and on 9300a1d alike, quiet machine, 16 runs: the queue's
    # valve sometimes holds the flood until its queue deadline; not yet explained). At least one
    # served is what the claim needs: the flood is throttled, not shut out.
    assert r["flood_ok"] >= 1 and r["flood_ok"] + r["flood_rejected"] == 32
