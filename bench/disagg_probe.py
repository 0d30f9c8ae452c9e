"""Where P/D loses (issue 17): sample a `--disagg` run's per-role state over time.

Runs one `tokenfleet simulate` configuration with a sampler on the simulator's controller
tick (virtual time: the samples do not disturb the run) and prints, every `--every` seconds,
per role: instances, queued (engine waiting) requests, running requests, mean KV usage,
requests holding KV for a transfer; and for the split requests: how many are prefilling,
waiting for decode KV room, in transfer; and the busy links. Then the run's summary and,
for `elastic`, the role flips. `--tail Q`: which requests make the TTFT tail (those at or
above the Q quantile: split or local, on which role, and where their time went).
`--tpot-by-role`: where each request decoded (split or local; the role of the instance its
decode steps ran on), how many prefill tokens ran beside it per decode step, its batch, and
which of those requests make the TPOT p95 (`StepTracer`, `tpot_report`).

    .venv/bin/python bench/disagg_probe.py --trace traces/conversation_trace.jsonl.gz \
        --fleet deploy/sim/pd32.yaml --disagg static --max-requests 2000 --rate-scale 5.5
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import numpy as np

from fleetcore.fleet_config import load_fleet_file
from fleetsim.cli import make_placement, make_policy
from fleetsim.disagg import PDRuntime, make_disagg_policy, pd_controllers, pd_fleet, pd_row
from fleetmind.pd_roles import PDRolesConfig
from tokenpilot.disagg import DisaggConfig
from fleetsim.metrics import summarize_all
from fleetsim.simulator import FleetSimulator, HashCache, prepare
from slomax import make_admission
from slomax import from_fleet as slomax_config
from workloads import head, load_trace, scale_rate


class Sampler:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def __call__(self, sim: FleetSimulator, now: float) -> None:
        pd = sim.pd
        row: dict[str, Any] = {"t": round(now, 1)}
        for role in ("prefill", "decode", "mixed"):
            insts = [i for i in sim.instances() if i.role == role]
            if not insts:
                continue
            row[role] = {
                "n": len(insts),
                "draining": sum(i.draining for i in insts),
                "wait": sum(i.engine.num_waiting for i in insts),
                "run": sum(i.engine.num_running for i in insts),
                "kv": round(sum(i.engine.kv.usage() for i in insts) / len(insts), 3),
                "held": sum(i.engine.num_held for i in insts),
            }
        if isinstance(pd, PDRuntime):
            stages: dict[str, int] = {}
            for leg in pd.legs.values():
                stages[leg.stage] = stages.get(leg.stage, 0) + 1
            row["legs"] = stages
            row["links_busy"] = sum(q.wait_s(now) > 0 for q in pd.links._queues.values())
        row["active"] = len(sim._active)
        self.rows.append(row)


class TailTracer(PDRuntime):
    """A `PDRuntime` that notes, per request, where its P/D decision sent it and when each stage
    of a split request ended (prefill done, decode room reserved, KV arrived), to say which
    requests make the TTFT tail and where their time went (`--tail`)."""

    def __init__(self, sim: FleetSimulator, policy: Any) -> None:
        super().__init__(sim, policy)
        self.notes: dict[str, dict[str, Any]] = {}
        decide = policy.decide

        def traced(profile: Any, pool: Any, transfers: Any, now: float) -> Any:
            d = decide(profile, pool, transfers, now)
            n = self.notes.setdefault(profile.request_id, {})
            n["predicted_ttft"] = d.predicted_ttft_s
            n["reason"] = d.reason
            return d

        # (the rest of the policy as it is: the withdrawn-leg booking, the split demand)
        self.policy = type("Traced", (), {"decide": staticmethod(traced), "name": policy.name,
                                          "prefill_withdrawn": staticmethod(policy.prefill_withdrawn),
                                          "take_demand": staticmethod(policy.take_demand)})()

    def dispatch(self, r: Any, now: float, view: Any, avoid: Any) -> None:
        n = self.notes.setdefault(r.inp.request_id, {})
        n.setdefault("dispatch", now)
        splits = self.stats.splits
        super().dispatch(r, now, view, avoid)
        leg = self.legs.get(r.inp.request_id)
        n["split"] = self.stats.splits > splits
        n["role"] = (leg.pre.role + ">" + leg.dec.role) if n["split"] and leg is not None else \
            (r.inst.role if r.inst is not None else None)
        if r.inst is not None:  # the decode-side state it met: KV in use, requests queued
            n["dec_kv"] = r.inst.engine.kv.usage()
            n["dec_waiting"] = r.inst.engine.num_waiting

    def _start_transfer(self, leg: Any, now: float) -> None:
        self.notes[leg.r.inp.request_id]["prefilled"] = now
        super()._start_transfer(leg, now)

    def _try_send(self, leg: Any, now: float) -> bool:
        ok = super()._try_send(leg, now)
        if ok:
            self.notes[leg.r.inp.request_id]["sent"] = now
        return ok

    def _kv_arrived(self, leg: Any, now: float) -> None:
        self.notes[leg.r.inp.request_id]["arrived"] = now
        super()._kv_arrived(leg, now)


# A step "carries a chunk" when at least this many of its tokens are prefill (a step's few
# arrived-KV admissions count one token each: not a chunk).
CHUNK_TOKENS = 32


class StepTracer:
    """Per request, what its decode steps were: wraps every engine's `step` (a controller tick
    wraps engines added later) and books, for each token a step made past a request's first,
    the step's duration, its prefill tokens (its tokens less its decode tokens), its batch
    (sequences), the engine's KV use and the instance's role at that moment. Virtual time: the
    wrapper changes no decision."""

    def __init__(self) -> None:
        self.req: dict[str, dict[str, Any]] = {}
        self.roles: dict[str, dict[str, float]] = {}  # per role: decode steps, with chunk, durations
        self._wrapped: set[int] = set()

    def wrap(self, sim: FleetSimulator, now: float = 0.0) -> None:
        for inst in sim.instances():
            e = inst.engine
            if id(e) in self._wrapped:
                continue
            self._wrapped.add(id(e))
            e.step = self._traced(inst, e.step)  # type: ignore[method-assign]

    __call__ = wrap  # as a controller: wrap what joined since

    def _traced(self, inst: Any, step: Any) -> Any:
        req, roles = self.req, self.roles

        def traced(now: float) -> Any:
            res = step(now)
            if not res.events:
                return res
            dec = [ev.request_id for ev in res.events if ev.new_tokens and not ev.first_token]
            for ev in res.events:
                if ev.first_token:
                    req.setdefault(ev.request_id, _blank())["first_on"] = inst.iid
                elif ev.preempted:  # its KV dropped: it recomputes prompt and output here
                    req.setdefault(ev.request_id, _blank())["preempted"] += 1
            if not dec:
                return res
            pf = res.num_tokens - len(dec)
            chunk = pf >= CHUNK_TOKENS
            kv = inst.engine.kv.usage()
            role = inst.role
            st = roles.setdefault(role, {"steps": 0, "chunk_steps": 0, "s": 0.0, "chunk_s": 0.0, "batch": 0,
                                         "kv": 0.0, "pf": 0})
            st["steps"] += 1
            st["s"] += res.duration
            st["batch"] += res.num_seqs
            st["kv"] += kv
            st["pf"] += pf
            if chunk:
                st["chunk_steps"] += 1
                st["chunk_s"] += res.duration
            for rid in dec:
                n = req.setdefault(rid, _blank())
                n["steps"] += 1
                n["s"] += res.duration
                n["pf"] += pf
                n["batch"] += res.num_seqs
                n["kv"] += kv
                n["on"][role] = n["on"].get(role, 0) + 1
                n["dec_on"] = inst.iid
                if n["first_dec"] is None:
                    n["first_dec"] = res.start
                if chunk:
                    n["chunk_steps"] += 1
                    n["chunk_s"] += res.duration
            return res

        return traced


def _blank() -> dict[str, Any]:
    return {"steps": 0, "s": 0.0, "pf": 0, "batch": 0, "kv": 0.0, "chunk_steps": 0, "chunk_s": 0.0, "on": {},
            "preempted": 0, "first_dec": None}


def tpot_report(records: list[Any], tracer: StepTracer, q: float = 0.95) -> dict[str, Any]:
    """TPOT by where requests decoded: per group (split or local; the role most of its decode
    steps ran on) over all requests with a TPOT and over those at or above the TPOT `q`
    quantile: requests, TPOT p50/p95 and mean, mean step, prefill tokens beside it per decode
    step, share of its decode steps that carried a chunk, its steps with and without a chunk,
    batch and KV use, the mean TPOT less the mean step (time outside its steps), the share of
    requests preempted at least once, and the mean wait from its first token (a split request's:
    its KV arrived) to the start of its first decode step. Plus, per role, the decode-carrying steps themselves."""
    done = [r for r in records if r.tpot_s is not None and r.request_id in tracer.req
            and tracer.req[r.request_id]["steps"]]
    if not done:
        return {}
    tp = np.array([r.tpot_s for r in done])
    cut = float(np.quantile(tp, q))

    def group(r: Any) -> str:
        n = tracer.req[r.request_id]
        role = max(n["on"].items(), key=lambda kv: kv[1])[0]
        split = n.get("first_on") is not None and n.get("first_on") != n.get("dec_on")
        return ("split" if split else "local") + " on " + role

    def stats(rows: list[Any]) -> dict[str, Any]:
        t = np.array([r.tpot_s for r in rows]) * 1e3
        ns = [tracer.req[r.request_id] for r in rows]
        steps = sum(n["steps"] for n in ns)
        ch = sum(n["chunk_steps"] for n in ns)
        return {"n": len(rows), "tpot_p50": round(float(np.quantile(t, 0.5)), 1),
                "tpot_p95": round(float(np.quantile(t, 0.95)), 1), "tpot_mean": round(float(t.mean()), 1),
                "step_ms": round(1e3 * sum(n["s"] for n in ns) / steps, 1),
                "pf_per_step": round(sum(n["pf"] for n in ns) / steps),
                "chunk_share": round(ch / steps, 3),
                "chunk_step_ms": round(1e3 * sum(n["chunk_s"] for n in ns) / ch, 1) if ch else None,
                "plain_step_ms": round(1e3 * sum(n["s"] - n["chunk_s"] for n in ns) / (steps - ch), 1)
                if steps > ch else None,
                "batch": round(sum(n["batch"] for n in ns) / steps, 1),
                # mean TPOT less the mean step: time between its tokens outside its decode steps
                # (a preemption's recompute, a wait to be scheduled after its KV arrived)
                "off_step_ms": round(float(t.mean()) - 1e3 * sum(n["s"] for n in ns) / steps, 1),
                "preempted": round(sum(n["preempted"] > 0 for n in ns) / len(ns), 3),
                # from its first token (a split request's: its KV arrived) to its first decode step
                "first_wait_ms": round(1e3 * sum(max(0.0, n["first_dec"] - r.arrival_s - r.ttft_s)
                                                 for r, n in zip(rows, ns)) / len(rows), 1),
                "kv": round(sum(n["kv"] for n in ns) / steps, 3)}

    out: dict[str, Any] = {"tpot_p95_ms": round(cut * 1e3, 1), "all": {}, "tail": {}, "roles": {}}
    for key, rows in (("all", done), ("tail", [r for r in done if r.tpot_s >= cut])):
        groups: dict[str, list[Any]] = {}
        for r in rows:
            groups.setdefault(group(r), []).append(r)
        out[key] = {"every": stats(rows), **{g: stats(v) for g, v in sorted(groups.items())}}
    for role, st in sorted(tracer.roles.items()):
        n = st["steps"]
        out["roles"][role] = {"decode_steps": n, "chunk_share": round(st["chunk_steps"] / n, 3),
                              "step_ms": round(1e3 * st["s"] / n, 1), "batch": round(st["batch"] / n, 1),
                              "kv": round(st["kv"] / n, 3), "pf_per_step": round(st["pf"] / n)}
    return out


def load_inputs(trace: str, fleet: Any, max_requests: int | None, rate_scale: float) -> tuple[Any, Any]:
    """The trace's first `max_requests` at `rate_scale`, and the simulator's inputs for `fleet`."""
    wl = load_trace(trace, "auto")
    if max_requests is not None:
        wl = head(wl, max_requests)
    if rate_scale != 1.0:
        wl = scale_rate(wl, rate_scale)
    return wl, prepare(wl.requests, fleet, hash_cache=HashCache())


def tail_report(records: list[Any], notes: dict[str, dict[str, Any]], q: float) -> dict[str, Any]:
    """The requests at or above the TTFT `q` quantile: how many split / ran locally on which
    role, their prompt sizes, and the mean seconds of each stage (admission wait; engine queue;
    for split ones prefill run, wait for decode room, transfer, first decode step)."""
    done = sorted((r for r in records if r.ttft_s is not None), key=lambda r: r.ttft_s)
    if not done:
        return {}
    cut = done[min(len(done) - 1, int(q * len(done)))].ttft_s
    groups: dict[str, list[dict[str, float]]] = {}
    for r in done:
        if r.ttft_s < cut:
            continue
        n = notes.get(r.request_id, {})
        adm = n.get("dispatch", r.arrival_s) - r.arrival_s
        stage = {"ttft": r.ttft_s, "prompt": r.prompt_tokens, "admission": adm,
                 "engine_queue": (r.queue_s or 0.0) - adm, "predicted_ttft": n.get("predicted_ttft") or 0.0,
                 "dec_kv": n.get("dec_kv", 0.0), "dec_waiting": n.get("dec_waiting", 0)}
        if n.get("split") and "arrived" in n:
            stage["prefill_run"] = n["prefilled"] - r.arrival_s - adm - stage["engine_queue"]
            stage["room"] = n["sent"] - n["prefilled"]
            stage["transfer"] = n["arrived"] - n["sent"]
            stage["first_decode"] = r.ttft_s - (n["arrived"] - r.arrival_s)
        groups.setdefault(("split " if n.get("split") else "local ") + str(n.get("role")), []).append(stage)
    out: dict[str, Any] = {"ttft_cut_s": round(cut, 3)}
    for g, rows in sorted(groups.items()):
        out[g] = {"n": len(rows), **{k: round(sum(x[k] for x in rows) / len(rows), 2) for k in rows[0]}}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True)
    p.add_argument("--fleet", default="deploy/sim/pd32.yaml")
    p.add_argument("--disagg", default="static")
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--rate-scale", type=float, default=1.0)
    p.add_argument("--every", type=float, default=15.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the samples and the row here")
    p.add_argument("--tail", type=float, default=None,
                   help="also break down the requests at or above this TTFT quantile (e.g. 0.95)")
    p.add_argument("--ttft-miss-weight", type=float, default=0.0,
                   help="DisaggConfig.ttft_miss_weight (0: the default decision)")
    p.add_argument("--decode-kv-high", type=float, default=PDRolesConfig().decode_kv_high,
                   help="PDRolesConfig.decode_kv_high of the elastic controller")
    p.add_argument("--pd-cycle-s", type=float, default=PDRolesConfig().cycle_s,
                   help="PDRolesConfig.cycle_s, the elastic controller's period (0: the fleet's planner.cycle_s)")
    p.add_argument("--start-from-file", action="store_true",
                   help="PDRolesConfig.start_colocated=False: elastic starts from the fleet file's roles")
    p.add_argument("--split-demand", action="store_true",
                   help="PDRolesConfig.split_demand=True: elastic grows its prefill pool from split demand")
    p.add_argument("--demand-grow", type=float, default=PDRolesConfig().demand_grow,
                   help="PDRolesConfig.demand_grow: unserved split demand (prefill instances' worth) that grows the pool")
    p.add_argument("--kv-rate-s", type=float, default=PDRolesConfig().kv_rate_s,
                   help="PDRolesConfig.kv_rate_s: the decode-KV projection's rate over readings this old (0: since the last cycle)")
    p.add_argument("--regrow-holdoff-s", type=float, default=getattr(PDRolesConfig(), "regrow_holdoff_s", 0.0),
                   help="PDRolesConfig.regrow_holdoff_s: no prefill growth this long after an urgent take-back, "
                        "doubled per take-back (0: no back-off)")
    p.add_argument("--no-grow-kv-guard", action="store_true",
                   help="PDRolesConfig.grow_kv_guard=False: prefill growth without the projected decode-KV check")
    p.add_argument("--router-tpot-slo-s", type=float, default=None,
                   help="TokenPilotConfig.tpot_slo_s, the TPOT budget the router prices streams' stalls against "
                        "(default 0.05 s, whatever the fleet file's SLOs say)")
    p.add_argument("--local-decode-as-split", action="store_true",
                   help="DisaggConfig.local_decode_as_split: the local option's own decode priced without its own prefill's duty")
    p.add_argument("--decision", default=None, choices=("static", "dynamo_conditional", "llm_d_decider"),
                   help="the per-request P/D decision of that mode under this --disagg mode's controllers "
                        "(e.g. --disagg elastic --decision dynamo_conditional: the elastic pools, Dynamo's rule)")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="every engine's EngineConfig.long_prefill_token_threshold (vLLM's flag: at most this many "
                        "prompt tokens of one request per step; 0: off)")
    p.add_argument("--tpot-by-role", action="store_true",
                   help="also break TPOT down by where requests decoded and what ran beside them (StepTracer)")
    a = p.parse_args()
    fleet = pd_fleet(load_fleet_file(Path(a.fleet)), a.disagg)  # (`off`: as it is; else its P/D token budget)
    wl, inputs = load_inputs(a.trace, fleet, a.max_requests, a.rate_scale)
    random.seed(a.seed)
    router = make_policy("tokenpilot", a.seed, fleet)
    if a.router_tpot_slo_s is not None:
        router.config = dataclasses.replace(router.config, tpot_slo_s=a.router_tpot_slo_s)
    policy = make_disagg_policy(a.decision or a.disagg, router, DisaggConfig(ttft_miss_weight=a.ttft_miss_weight,
                                                               slos=dict(fleet.admission.slos()),
                                                               local_decode_as_split=a.local_decode_as_split))
    knobs = dict(decode_kv_high=a.decode_kv_high, cycle_s=a.pd_cycle_s or None, start_colocated=not a.start_from_file,
                 split_demand=a.split_demand, demand_grow=a.demand_grow, kv_rate_s=a.kv_rate_s,
                 regrow_holdoff_s=a.regrow_holdoff_s, grow_kv_guard=not a.no_grow_kv_guard)
    # (only the knobs this code's controller has: `disagg_loads.py --before` runs older code with this script)
    have = {f.name for f in dataclasses.fields(PDRolesConfig)}
    ctl = pd_controllers(a.disagg, fleet, PDRolesConfig(**{k: v for k, v in knobs.items() if k in have}))
    sampler = Sampler()
    tracer = StepTracer() if a.tpot_by_role else None
    sim = FleetSimulator(fleet, router, site_chooser=make_placement("fleetmind", fleet, router),
                         admission=make_admission("fcfs", slomax_config(fleet)), progress=None,
                         controllers=[*ctl, (a.every, sampler), *([(1.0, tracer)] if tracer else [])],
                         pd=(lambda s: (TailTracer if a.tail is not None else PDRuntime)(s, policy))
                         if policy is not None else None)
    if a.long_prefill_token_threshold:
        for inst in sim.instances():  # (their EngineConfig, shared per deployment)
            inst.engine.config.long_prefill_token_threshold = a.long_prefill_token_threshold
    if tracer is not None:
        tracer.wrap(sim)
    res = sim.run(inputs)
    summary = summarize_all(res.records, fleet.admission.slos())
    last_end = max((r.end_s for r in res.records if r.end_s is not None), default=res.sim_end_s)
    row = {k: summary[k] for k in ("goodput_tok_s", "slo_attainment", "ttft_ms", "tpot_ms", "span_s")}
    row["preemptions"] = res.preemptions
    row.update(pd_row(sim.pd if isinstance(sim.pd, PDRuntime) else None, ctl, last_end))
    for s in sampler.rows:
        print(json.dumps(s))
    flips = row.pop("role_flips", [])
    print(json.dumps(row, default=str))
    for f in flips:
        print("flip", json.dumps(f))
    if a.tail is not None:
        notes = sim.pd.notes if isinstance(sim.pd, TailTracer) else {}
        print("tail", json.dumps(tail_report(res.records, notes, a.tail)))
    if tracer is not None:
        row["tpot_by_role"] = tpot_report(res.records, tracer)
        print("tpot_by_role", json.dumps(row["tpot_by_role"]))
    if a.json:
        Path(a.json).write_text(json.dumps({"samples": sampler.rows, "row": row, "flips": flips}, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
