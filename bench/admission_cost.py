"""What admission and a request's bookkeeping cost per request, in microseconds (timeit, one process).

    .venv/bin/python bench/admission_cost.py [--base REF] [--n 20000] [--rounds 7]

Times, with no event loop, server or engine, the per-request work of the code this checkout's
`gateway/admission.py`, `slomax/`, `gateway/relay.py`'s `Dispatch.finish`, `gateway/metrics.py` and
`gateway/telemetry.py` do for one relayed streaming request (FCFS, as `bench/peers.py --parts
overhead` runs it, and SLOMax, the fleet file's default):

- `gate fcfs` / `gate slomax`: `AdmissionGate.enter` (its coroutine driven by hand: an admitted
  request never waits), `routed`, `first_token`, `attempt_ended`, `release` (the policy's
  `observe`, `judge` for a release listener, the `poll` of its pump) over a fleet view that is
  rebuilt at every call, as a gateway's is when the in-flight count changed in between;
- `finish`: `Dispatch.finish` of a streamed attempt, the relay's `observe` a no-op (the router's
  learning is not counted), metrics and the in-flight gauge real;
- `telemetry`: a `RequestRecord` from `begin` to `end` (no tracing, access log off as served).

`--base REF` runs the same measurement on the tree of git commit REF (`git archive`, this
checkout's venv) in alternation with this checkout, `--rounds` times each, and prints both with
the ratio of the medians. Timings are the best of 3 runs of `--n` requests each per round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = ("gate fcfs", "gate slomax", "finish", "telemetry")


def measure(n: int) -> dict[str, float]:
    """Microseconds per request of each case, on whatever code `sys.path` finds first."""
    import time
    from types import SimpleNamespace

    from fleetcore.sse import StreamStats
    from fleetcore.types import InstanceSnapshot, RequestOutcome, RequestProfile, SiteSnapshot, FleetView
    from gateway.admission import AdmissionGate
    from gateway.metrics import GatewayMetrics
    from gateway.relay import Dispatch, Target
    from gateway.requests import ParsedRequest
    from gateway.telemetry import Telemetry
    from slomax import FCFS, SLOMax

    clock_t = [1000.0]

    def clock() -> float:
        clock_t[0] += 1e-4
        return clock_t[0]

    inflight = [0]

    class State:
        """A fleet view rebuilt at every call (the in-flight count moved in between)."""

        def view(self) -> FleetView:
            inst = InstanceSnapshot("e0", "use1", "m1", "v1", "http://e0", inflight=inflight[0])
            return FleetView((SiteSnapshot("use1", "us-east", "us", {}, (inst,)),))

    def cycle_gate(gate: AdmissionGate, i: int) -> None:
        now = clock()
        p = RequestProfile(f"r{i}", "m1", 64, max_tokens=4, stream=True, arrival=now)
        parsed = ParsedRequest("chat", {}, p, None, False)  # type: ignore[arg-type]
        co = gate.enter(parsed, None)  # type: ignore[arg-type]
        try:
            co.send(None)
        except StopIteration as s:
            parsed = s.value[0]
        rid = parsed.profile.request_id
        inflight[0] += 1
        gate.routed(rid, "e0")
        gate.first_token(rid)
        o = RequestOutcome(rid, "e0", "use1", True, 64, 0, 4, 0.002, 0.0005, 0.004)
        gate.attempt_ended(o)
        inflight[0] -= 1
        gate.release(rid)

    out: dict[str, float] = {}

    def timed(name: str, run, k: int = n) -> None:  # type: ignore[no-untyped-def]
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for i in range(k):
                run(i)
            best = min(best, time.perf_counter() - t0)
        out[name] = 1e6 * best / k

    for name, policy in (("gate fcfs", FCFS()), ("gate slomax", SLOMax())):
        gate = AdmissionGate(policy, State(), clock)  # type: ignore[arg-type]
        gate.on_released.append(lambda profile, outcome, met: None)  # the dashboard listens
        timed(name, lambda i, g=gate: cycle_gate(g, i))

    metrics = GatewayMetrics()

    class Shut:
        def untrack(self, w: object) -> None:
            pass

    class Watch:
        def close(self) -> None:
            pass

    relay = SimpleNamespace(state=SimpleNamespace(end=lambda iid: 0, network_rtt_s=lambda site: 0.0),
                            metrics=metrics, shutdown=Shut(),
                            clock=clock, observe=lambda outcome, request_outcome=None: None)
    inst = SimpleNamespace(instance_id="e0")
    target = Target("use1", inst)  # type: ignore[arg-type]

    def finish(i: int) -> None:
        p = RequestProfile(f"r{i}", "m1", 64, max_tokens=4, stream=True, arrival=clock())
        parsed = ParsedRequest("chat", {}, p, None, False)  # type: ignore[arg-type]
        st = StreamStats()
        st.first_token_at, st.last_token_at, st.token_events = clock(), clock(), 4
        st.usage = {"prompt_tokens": 64, "completion_tokens": 4, "total_tokens": 68}
        st.finish_reason = "length"
        d = Dispatch(relay, parsed, target, Watch(), 0.0, 0.0, stats=st)  # type: ignore[arg-type]
        d.finish(ok=True, status="200")

    timed("finish", finish)

    tel = Telemetry(GatewayMetrics().registry, clock=clock, slo_of=FCFS().config.slo)
    headers: dict[str, str] = {}
    route = SimpleNamespace(predicted_ttft_s=0.01, cached_tokens=0)
    tinst = SimpleNamespace(instance_id="e0", model="m1", adapter="static")

    def telemetry(i: int) -> None:
        rec = tel.begin(headers, "chat", f"r{i}")
        p = RequestProfile(f"r{i}", "m1", 64, max_tokens=4, stream=True, arrival=rec.started)
        rec.parsed(p)
        rec.admitted("admitted", 1e-5, p, None)
        rec.attempt("use1", "home", tinst, route)  # type: ignore[arg-type]
        o = RequestOutcome(f"r{i}", "e0", "use1", True, 64, 0, 4, 0.002, 0.0005, 0.004)
        rec.attempt_ended(o, "200", ("length",))
        rec.end(200)

    timed("telemetry", telemetry)
    return out


def child(root: str, n: int) -> None:
    sys.path.insert(0, root)
    print(json.dumps(measure(n)))


def run_tree(root: Path, n: int) -> dict[str, float]:
    r = subprocess.run([sys.executable, __file__, "--child", str(root), "--n", str(n)], cwd=root,
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", metavar="REF", help="also the tree of this git commit, alternated")
    p.add_argument("--n", type=int, default=20000, help="requests per timing (default %(default)s)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--child", metavar="ROOT", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.n)
        return 0
    trees = {"this checkout": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        if args.base:
            base = Path(tmp) / "base"
            base.mkdir()
            arch = subprocess.run(["git", "-C", str(ROOT), "archive", args.base], capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", str(base)], input=arch.stdout, check=True)
            trees = {f"@{args.base}": base, **trees}
        res: dict[str, list[dict[str, float]]] = {k: [] for k in trees}
        for _ in range(args.rounds):
            for name, root in trees.items():
                res[name].append(run_tree(root, args.n))
    print(f"us per request, median of {args.rounds} rounds (each the best of 3 x {args.n}):")
    print(f"  {'case':<12}" + "".join(f"{k:>16}" for k in res) + ("   ratio" if args.base else ""))
    for case in CASES:
        meds = [statistics.median(r[case] for r in rounds) for rounds in res.values()]
        ratio = f"   {meds[-1] / meds[0]:.2f}x" if args.base else ""
        print(f"  {case:<12}" + "".join(f"{m:16.2f}" for m in meds) + ratio)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
