"""Tokenization off the loop (issue 14): a burst of 16 prompts of 32k tokens each does not stall
the gateway's event loop for more than 20 ms.

The gateway runs in this process (over a launched sim worker); the burst comes from a client
in a separate process, so the only work on this event loop is the gateway's. A loop monitor
of our own, started just before the burst, measures it: its busy lag (`LoopMonitor`: the lag
less the time the whole process was off a CPU) is what the gateway's own work held the loop,
tokenizer threads holding the GIL included; the machine starving us does not count.
"""

from __future__ import annotations

from fleetcore.fleet_config import parse_fleet
from fleetcore.tokens import count_tokens
from gateway.embedded import serve_fleet

from tests.bench_scripts import load_bench

STALL_BOUND_S = 0.020




async def test_a_burst_of_16_prompts_of_32k_tokens_stalls_the_loop_under_20_ms() -> None:
    """Three bursts (other prompts each time, so no cache helps); two of them must stay under the
    bound. Why not all three: "busy" counts the loop's lag whenever any thread of this process ran
    meanwhile, so on a crowded machine the OS descheduling the loop thread while another thread
    of ours runs reads as a stall of ours; a stall the gateway causes shows in every burst (the
    code before issue 14 held the loop 50-56 ms in each; with the tokenizer on the pool's thread,
    holding the GIL, 9-30 ms; with its helper process, 2-9 ms: bench/README.md, "Tokenization off
    the loop, again")."""
    b = load_bench("tokenize_stall")  # the bursts of bench/tokenize_stall.py: its fleet, prompts and client process
    prompts = [b.prompt(k) for k in range(3 * b.BURST)]
    assert count_tokens(prompts[0]) >= b.PROMPT_TOKENS
    async with serve_fleet(parse_fleet(b.FLEET), poll_interval_s=0.2) as f:
        lags = []
        for k in range(3):
            m = await b.burst(f.url, prompts[k * b.BURST:(k + 1) * b.BURST])
            lags.append((m.max_busy_lag_s, m.max_lag_s))
    assert sorted(busy for busy, _ in lags)[1] < STALL_BOUND_S, lags
