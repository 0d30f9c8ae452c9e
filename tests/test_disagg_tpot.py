"""bench/disagg_probe.py --tpot-by-role: the step tracer books, per request, the prefill tokens
that ran beside each of its decode steps, and the report groups requests by where they decoded
(bench/DISAGG.md "TPOT by role")."""

from __future__ import annotations

from types import SimpleNamespace

from engine_adapters.sim.engine import SimRequest
from tests.bench_scripts import load_bench
from tests.test_sim_engine import hashes, make_engine


def test_a_stream_decoding_beside_a_local_prefill_is_booked_with_its_chunks() -> None:
    probe = load_bench("disagg_probe")
    engine = make_engine(block_size=16, max_num_batched_tokens=256)
    inst = SimpleNamespace(iid="i0", role="decode", engine=engine)
    sim = SimpleNamespace(instances=lambda: [inst])
    tracer = probe.StepTracer()
    tracer.wrap(sim)
    tracer.wrap(sim)  # a second wrap (the controller tick) leaves a wrapped engine alone
    engine.add_request(SimRequest("a", 16, hashes("a", 1), 6, 0.0))
    t = 0.0
    res = engine.step(t)  # a's prefill: its first token, no decode step
    d1 = res.duration
    assert tracer.req["a"]["steps"] == 0 and tracer.req["a"]["first_on"] == "i0"
    engine.add_request(SimRequest("b", 1000, hashes("b", 62), 2, 0.0))
    while engine.has_work():
        t += res.duration
        res = engine.step(t)
    a, b = tracer.req["a"], tracer.req["b"]
    # a's 5 decode tokens: 4 beside b's chunks (255, 255, 255, 235: the 256 budget less a's token),
    # the last beside b's own decode token (no chunk)
    assert (a["steps"], a["chunk_steps"], a["pf"]) == (5, 4, 1000)
    assert (b["steps"], b["chunk_steps"], b["pf"]) == (1, 0, 0)
    assert a["on"] == {"decode": 5} and a["preempted"] == 0
    records = [SimpleNamespace(request_id="a", tpot_s=0.05, arrival_s=0.0, ttft_s=0.0),
               SimpleNamespace(request_id="b", tpot_s=0.02, arrival_s=0.0, ttft_s=t)]
    rep = probe.tpot_report(records, tracer)
    assert rep["all"]["local on decode"]["n"] == 2
    assert rep["all"]["every"]["chunk_share"] == round(4 / 6, 3)
    assert rep["all"]["every"]["pf_per_step"] == round(1000 / 6)
    tail = rep["tail"]  # the p95 of (50, 20 ms) is a's alone
    assert tail["every"]["n"] == 1 and tail["every"]["pf_per_step"] == 200 and tail["every"]["chunk_share"] == 0.8
    # a, as if its first token left at 0: its first decode step started when its prefill step ended
    assert tail["every"]["first_wait_ms"] == round(1e3 * d1, 1) > 0.0
    # b's first token (its last chunk's step) and its decode step: back to back
    assert rep["all"]["every"]["first_wait_ms"] == round(1e3 * d1 / 2, 1)
    assert rep["roles"]["decode"]["decode_steps"] == 5  # the steps that carried a decode token
