"""`tokenfleet simulate`: replay a trace through every routing policy on a simulated fleet.

    tokenfleet simulate --trace FILE [--trace-format mooncake|azure|auto]
        [--fleet FILE] [--policy P1,P2,...] [--rate-scale X]
        [--max-requests N] [--seed S] [--json OUT.json] [--plot DIR]

This command line is a contract outside checks rely on. Extra options:
`--timeout S` (client gives up S seconds after arrival), `--describe-capacity`
(print the fleet's estimated capacity for the workload and exit),
`--admission fcfs,slomax` (gateway admission; every combination with `--policy`
runs, and each result row says its `"admission"`), `--disagg off,static,elastic,
dynamo_conditional,llm_d_decider` (prefill/decode disaggregation, `fleetsim.disagg`; each
row says its `"disagg"`), `--no-progress`, and engine
failures (`fleetsim.failures`): `--fail-rate R` (deaths per instance-hour),
`--stall-rate R` (stalls per instance-hour, each `--stall-s` long), `--restart-s S`,
`--no-continuation`, `--max-continuations N`; with a rate above 0 each result row
gains a `"failures"` block.

Each policy runs on a fresh simulator (fresh engines, fresh policy object seeded
with `--seed`) over the same prepared workload. Runnable without the gateway:
`python -m fleetsim.cli simulate ...` (or without the word `simulate`).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

from fleetcore.continuation import ContinuationLimits
from fleetcore.fleet_config import FleetConfig, FleetConfigError, load_fleet_file
from fleetcore.policies import InstanceRouter
from fleetcore.slo import ClassSLO
from fleetmind.demand import DemandModel
from fleetmind.placement_cycle import placement_cycle_for
from fleetcore.region_policy import PolicySet
from fleetmind.site_choice import FleetMind, FleetMindConfig
from slomax import ADMISSION_NAMES, make_admission
from slomax import from_fleet as slomax_config
from tokenpilot.registry import ROUTER_NAMES, make_router

from .metrics import RequestRecord, summarize, summarize_all
from .failures import DEFAULT_STALL_S, FailureModel
from .planning import DEFAULT_STARTUP_S, PlannerLoop
from .plots import PlotUnavailable, Run, require_matplotlib, write_plots
from .disagg import DISAGG_MODES, PDRuntime, make_disagg_policy, pd_controllers, pd_fleet, pd_row
from .replicas import ReplicatedRouter
from .report import (
    build_report,
    format_table,
    result_row,
    write_json,
)
from .simulator import (
    FleetSimulator,
    HashCache,
    estimate_capacity,
    fleet_instances,
    prepare,
    spec_prior,
)

DEFAULT_SIM_FLEET = Path(__file__).resolve().parent.parent / "deploy" / "sim" / "fleet32.yaml"
TRACE_FORMATS = ("mooncake", "azure", "auto", "canonical")


# --- policies -------------------------------------------------------------------------


def make_policy(name: str, seed: int, fleet: FleetConfig | None = None) -> InstanceRouter:
    """A fresh, seeded router, told the fleet's engines (`register_instance`: a no-op for a
    router that keeps no per-instance priors), as the gateway's composition root does."""
    router = make_router(name, seed=seed)
    if fleet is not None:
        for s in fleet_instances(fleet):
            router.register_instance(s.instance_id, spec_prior(s))
    return router


# --- placement ----------------------------------------------------------------------

PLACEMENTS = ("fleetmind", "home", "fleetmind+planner")


def make_placement(name: str, fleet: FleetConfig, router: InstanceRouter) -> FleetMind:
    """The site chooser for a `--placement`: `fleetmind` spills when home would miss its SLO
    (the fleet's own SLO map); `home` never leaves the home site (same residency and
    readiness filters); `fleetmind+planner` also moves replicas (`placement_controllers`)."""
    return FleetMind.from_fleet(fleet, router, config=FleetMindConfig(never_spill=name == "home"))


def placement_controllers(name: str, fleet: FleetConfig) -> list[tuple[float, Any]]:
    """FleetMind's long cycle for `fleetmind+planner`: the same placement cycle as the live
    gateway's, tuned by the fleet file's `planner:` block (its `enabled` and `mode` aside: asking
    for this placement runs it), replicas starting in their deployment's `startup_s`."""
    if name != "fleetmind+planner":
        return []
    core = placement_cycle_for(fleet, DemandModel(fleet))
    core.mode = "auto"
    loop = PlannerLoop(core, fleet)
    return [(core.settings.cycle_s, loop)]


def residency_violations(records: Sequence[RequestRecord], policies: PolicySet, fleet: FleetConfig) -> int:
    """Requests served in a site their region policy does not allow, checked independently of
    the site chooser that placed them."""
    default_model = fleet.models[0].name
    return sum(1 for r in records
               if r.site and r.site not in policies.resolve(r.tenant, r.model or default_model, fleet.sites).allowed)


def by_site(records: Sequence[RequestRecord], span_s: float,
            slos: Mapping[str, ClassSLO]) -> dict[str, dict[str, Any]]:
    out = {}
    for site in sorted({r.site for r in records if r.site}):
        part = summarize([r for r in records if r.site == site], span_s, slos)
        out[site] = {k: part[k] for k in ("requests", "completed", "ttft_ms", "throughput_tok_s",
                                          "goodput_tok_s", "slo_attainment", "cache_hit_rate")}
    return out


# --- failures -------------------------------------------------------------------------


def failure_model(args: argparse.Namespace) -> FailureModel | str:
    """The `FailureModel` the options ask for, or what is wrong with them."""
    for name in ("fail_rate", "stall_rate"):
        if not getattr(args, name) >= 0:
            return f"--{name.replace('_', '-')} must be >= 0"
    if not args.stall_s > 0:
        return "--stall-s must be positive"
    if args.restart_s is not None and not args.restart_s >= 0:
        return "--restart-s must be >= 0"
    if args.max_continuations is not None and args.max_continuations < 0:
        return "--max-continuations must be >= 0"
    base = ContinuationLimits()
    limits = ContinuationLimits(
        enabled=not args.no_continuation,
        max_continuations=base.max_continuations if args.max_continuations is None else args.max_continuations,
        max_reprefill_tokens=base.max_reprefill_tokens)
    return FailureModel(args.fail_rate, args.stall_rate, args.stall_s, args.restart_s, args.seed, limits)


def failure_desc(m: FailureModel) -> dict[str, Any]:
    """The workload block's record of the failure model a run used."""
    return {"fail_rate_per_instance_h": m.fail_rate_per_h, "stall_rate_per_instance_h": m.stall_rate_per_h,
            "stall_s": m.stall_s, "restart_s": m.restart_s, "continuation": m.limits.enabled,
            "max_continuations": m.limits.max_continuations, "max_reprefill_tokens": m.limits.max_reprefill_tokens}


def failure_line(f: Mapping[str, Any]) -> str:
    lost = f["time_lost_per_continuation_ms"]
    conts = ", ".join(f"{k} {v}" for k, v in f["continuations"].items()) or "none"
    lost_s = "-" if lost["p50"] is None else f"p50 {lost['p50']:.0f} ms, p95 {lost['p95']:.0f} ms"
    return (f"{f['deaths']} deaths, {f['stalls']} stalls; continuations: {conts} "
            f"({f['continued_requests']} requests, {f['reprefill_tokens']} tokens re-prefilled, time lost "
            f"{lost_s}); {f['retries_before_first_token']} retried before the first token; "
            f"{f['failed_requests']} failed")


# --- progress -------------------------------------------------------------------------


class Progress:
    """A one-line stderr progress bar that appears only once a run has taken `after_s`."""

    def __init__(self, label: str, stream: TextIO = sys.stderr, after_s: float = 2.0,
                 enabled: bool = True) -> None:
        self.label = label
        self.stream = stream
        self.after_s = after_s
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.shown = False
        self.finished = False
        self.tty = bool(getattr(stream, "isatty", lambda: False)())

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or self.finished:
            return
        now = time.perf_counter() - self.t0
        # A terminal gets a live bar; a log file a line every 10 s, and only on long runs.
        start, every = (self.after_s, 0.5) if self.tty else (3 * self.after_s, 10.0)
        if now < start or (now - self.last < every and done < total):
            return
        self.last = now
        self.finished = done >= total
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 30)
        line = f"  {self.label:<22} [{bar:<30}] {100 * frac:5.1f}%  {now:6.1f} s"
        if self.tty:
            self.stream.write("\r" + line + ("\n" if done >= total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self.shown = True


# --- parser ---------------------------------------------------------------------------


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, metavar="FILE",
                   help="request trace (Mooncake JSONL, canonical, Azure CSV)")
    p.add_argument("--trace-format", default="auto", choices=TRACE_FORMATS, help="trace format (default: auto)")
    p.add_argument("--fleet", metavar="FILE", help="fleet file (default: deploy/sim/fleet32.yaml)")
    p.add_argument("--policy", metavar="P1,P2,...", help="routing policies to compare (default: all registered)")
    p.add_argument("--admission", metavar="A1,A2", default="fcfs",
                   help="gateway admission: fcfs (admit everything at once) and/or slomax (class queues, "
                        "budgets, early rejection, goodput feedback; from the fleet file's admission block); "
                        "each is run with every policy and placement (default: fcfs)")
    p.add_argument("--placement", metavar="P1,P2,...", default="fleetmind",
                   help="site placement: fleetmind (home first, spill when home would miss its SLO) and/or "
                        "home (never leave the home site); each is run with every policy (default: fleetmind)")
    p.add_argument("--disagg", metavar="M1,M2", default="off",
                   help="prefill/decode disaggregation: off (every instance mixed, the fleet file's roles "
                        "ignored), static (its roles, TokenPilot decides per request), elastic (static plus "
                        "FleetMind's role controller), dynamo_conditional, llm_d_decider (published rules); "
                        "each is run with every policy, all but off with --policy tokenpilot (default: off)")
    p.add_argument("--rate-scale", type=float, default=1.0, metavar="X", help="multiply the arrival rate by X")
    p.add_argument("--max-requests", type=int, default=None, metavar="N", help="only the first N requests")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="seed for randomised policies (default 0)")
    p.add_argument("--json", metavar="OUT.json", help="write the full report as JSON")
    p.add_argument("--plot", metavar="DIR", help="draw the figures into DIR: TTFT/TPOT CDFs with SLO lines, goodput "
                   "over time, per-site and per-class bars (needs matplotlib: pip install 'tokenfleet[plot]'); "
                   "a name ending in .png is the TTFT CDF, the others beside it")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="client timeout: a request not finished S seconds after arrival is cancelled")
    p.add_argument("--describe-capacity", action="store_true",
                   help="print the fleet's estimated capacity for this workload and exit")
    p.add_argument("--gateways", type=int, default=1, metavar="N",
                   help="N gateway replicas behind a round-robin load balancer, each with its own router "
                        "(default 1)")
    p.add_argument("--sync-ms", type=float, default=0.0, metavar="M",
                   help="with --gateways: a replica hears of the others' dispatches and releases M ms late "
                        "(default 0)")
    p.add_argument("--no-spread", action="store_true",
                   help="with --gateways: replicas route over the whole pool, not their share of it "
                        "(fleetcore.replica_spread; to measure how they herd without it)")
    p.add_argument("--fail-rate", type=float, default=0.0, metavar="R",
                   help="engine deaths per instance-hour (Poisson per instance, seeded with --seed): the "
                        "instance loses its KV cache and in-flight requests and restarts (default 0)")
    p.add_argument("--stall-rate", type=float, default=0.0, metavar="R",
                   help="engine stalls per instance-hour: the instance produces nothing for --stall-s; the "
                        "gateway's idle / first-byte deadlines (fleet file `gateway:`) notice (default 0)")
    p.add_argument("--stall-s", type=float, default=DEFAULT_STALL_S, metavar="S",
                   help=f"how long a stall lasts (default {DEFAULT_STALL_S:g})")
    p.add_argument("--restart-s", type=float, default=None, metavar="S",
                   help="how long a dead instance takes to serve again (default: its deployment's startup_s, "
                        f"else {DEFAULT_STARTUP_S:g})")
    p.add_argument("--no-continuation", action="store_true",
                   help="a request whose engine fails after its first token fails (no continuation elsewhere)")
    p.add_argument("--max-continuations", type=int, default=None, metavar="N",
                   help=f"continuations per request (default {ContinuationLimits().max_continuations})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def add_simulate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `simulate` on a `tokenfleet` subparsers object; it dispatches to `run_simulate`."""
    # The one-line help is tokenfleet.cli's (it lists commands without importing them).
    p = subparsers.add_parser(
        "simulate", description="Replay a request trace through each routing policy on a simulated fleet "
                    "(discrete-event, virtual time) and compare TTFT, TPOT, goodput and SLO attainment.")
    _add_arguments(p)
    p.set_defaults(func=run_simulate)
    return p


# --- the command ----------------------------------------------------------------------


def _err(msg: str) -> int:
    print(f"tokenfleet simulate: error: {msg}", file=sys.stderr)
    return 2


def _say(msg: str) -> None:
    print(msg, flush=True)


def fleet_summary(fleet: FleetConfig, path: Path) -> dict[str, Any]:
    """The report's "fleet" block; builds one engine per shape, so a model that does not
    fit its GPUs fails here (ValueError) before any trace is read."""
    from engine_adapters.sim.engine import SimEngine

    specs = fleet_instances(fleet)
    shapes: dict[tuple, dict[str, Any]] = {}
    for s in specs:
        key = (s.site, s.model, s.gpu, s.tp)
        if key not in shapes:
            e = SimEngine(s.engine)  # cheap: the KV block table only
            shapes[key] = {"site": s.site, "model": s.model, "spec": s.engine.model.name, "gpu": s.gpu,
                           "tp": s.tp, "instances": 0, "kv_tokens": e.num_gpu_blocks * e.block_size,
                           "max_model_len": e.max_model_len}
        shapes[key]["instances"] += 1
    deps = list(shapes.values())
    return {"file": str(path), "sites": [s.name for s in fleet.sites], "instances": len(specs),
            "gpus": sum(d["instances"] * d["tp"] for d in deps), "deployments": deps}


def run_simulate(args: argparse.Namespace) -> int:
    from workloads import head, load_trace, scale_rate

    fleet_path = Path(args.fleet) if args.fleet else DEFAULT_SIM_FLEET
    try:
        fleet = load_fleet_file(fleet_path)
    except FleetConfigError as e:
        return _err(str(e))
    try:
        fsum = fleet_summary(fleet, fleet_path)
    except ValueError as e:  # unknown GPU/model spec, model does not fit
        return _err(f"{fleet_path}: {e}")
    if not fsum["instances"]:
        return _err(f"{fleet_path}: no simulated instances (static deployments cannot be simulated)")
    names = [p.strip() for p in args.policy.split(",") if p.strip()] if args.policy else list(ROUTER_NAMES)
    unknown = [p for p in names if p not in ROUTER_NAMES]
    if unknown or not names:
        return _err(f"unknown policy {', '.join(map(repr, unknown)) or '(none given)'}; "
                    f"known: {', '.join(ROUTER_NAMES)}")
    admissions = [a.strip() for a in args.admission.split(",") if a.strip()]
    bad_adm = [a for a in admissions if a not in ADMISSION_NAMES]
    if bad_adm or not admissions:
        return _err(f"unknown admission {', '.join(map(repr, bad_adm)) or '(none given)'}; "
                    f"known: {', '.join(ADMISSION_NAMES)}")
    placements = [p.strip() for p in args.placement.split(",") if p.strip()]
    bad = [p for p in placements if p not in PLACEMENTS]
    if bad or not placements:
        return _err(f"unknown placement {', '.join(map(repr, bad)) or '(none given)'}; known: {', '.join(PLACEMENTS)}")
    modes = [m.strip() for m in args.disagg.split(",") if m.strip()]
    bad_modes = [m for m in modes if m not in DISAGG_MODES]
    if bad_modes or not modes:
        return _err(f"unknown disagg mode {', '.join(map(repr, bad_modes)) or '(none given)'}; "
                    f"known: {', '.join(DISAGG_MODES)}")
    if any(m != "off" for m in modes) and (set(names) - {"tokenpilot"} or args.gateways > 1):
        return _err("--disagg other than off prices options with TokenPilot's cost model: "
                    "use it with --policy tokenpilot (and one gateway)")
    if any(m != "off" for m in modes) and (args.fail_rate > 0 or args.stall_rate > 0):
        return _err("--disagg other than off does not model engine failures yet: "
                    "use --fail-rate / --stall-rate with --disagg off")
    if not args.rate_scale > 0:
        return _err("--rate-scale must be positive")
    if args.max_requests is not None and args.max_requests < 1:
        return _err("--max-requests must be at least 1")
    if args.timeout is not None and not args.timeout > 0:
        return _err("--timeout must be positive")
    if args.gateways < 1:
        return _err("--gateways must be at least 1")
    if not args.sync_ms >= 0:
        return _err("--sync-ms must be >= 0")
    failures = failure_model(args)
    if isinstance(failures, str):
        return _err(failures)
    if not Path(args.trace).is_file():
        return _err(f"trace file not found: {args.trace}")
    if args.plot:
        try:  # now, not after a run that may take minutes
            require_matplotlib()
        except PlotUnavailable as e:
            return _err(str(e))
    try:
        wl = load_trace(args.trace, args.trace_format)
    except (ValueError, OSError) as e:
        return _err(str(e))
    if args.max_requests is not None:
        wl = head(wl, args.max_requests)
    if not len(wl):
        return _err(f"{args.trace}: no requests")
    cap = estimate_capacity(fleet, wl.requests)  # of the trace at its own rate
    if args.rate_scale != 1.0:
        wl = scale_rate(wl, args.rate_scale)

    desc = wl.describe()
    desc.update({"trace": str(args.trace), "rate_scale": args.rate_scale, "max_requests": args.max_requests,
                 "seed": args.seed, "timeout_s": args.timeout})
    if args.gateways > 1:  # one replica's report stays as it was
        desc.update({"gateways": args.gateways, "sync_ms": args.sync_ms, "spread": not args.no_spread})
    if failures.active:  # a run without failures reports as it did before they were modelled
        desc["failures"] = failure_desc(failures)
    fsum["capacity"] = cap
    deps = ", ".join(f"{d['instances']} x {d['model']} on {d['tp']}x{d['gpu']} @ {d['site']}"
                     for d in fsum["deployments"])
    _say(f"workload  {desc['name']}: {desc['requests']} requests over {desc['duration_s']:.0f} s "
         f"({desc['mean_rate_rps']:.2f} req/s, rate-scale {args.rate_scale:g}), "
         f"input mean {desc['input_mean']:.0f}, output mean {desc['output_mean']:.0f} tokens")
    _say(f"fleet     {fleet_path.name}: {fsum['instances']} instances ({deps})")
    if cap:
        x = args.rate_scale
        nc, ic = cap["no_cache"], cap["ideal_cache"]
        _say(f"capacity  ~{nc['capacity_rps']:.1f} req/s without prefix reuse, ~{ic['capacity_rps']:.1f} with an ideal "
             f"cache (engine physics); offered load {100 * nc['load_at_rate_scale_1'] * x:.0f}% / "
             f"{100 * ic['load_at_rate_scale_1'] * x:.0f}% of it")
        def levels(c: dict[str, Any]) -> str:
            return "/".join(f"{c['rate_scale_for'][k]:.2f}" for k in ("60%", "80%", "95%"))
        _say(f"          --rate-scale for 60/80/95% of capacity: {levels(nc)} (no reuse), "
             f"{levels(ic)} (ideal cache)")
    if args.describe_capacity:
        import json
        brief = {k: desc[k] for k in ("name", "requests", "duration_s", "mean_rate_rps")}
        print(json.dumps({"fleet": fsum, "workload": brief}, indent=2))
        return 0

    t0 = time.perf_counter()
    cache = HashCache()
    inputs = prepare(wl.requests, fleet, timeout_s=args.timeout, hash_cache=cache)
    _say(f"prepared  {len(inputs)} requests (block hashes) in {time.perf_counter() - t0:.1f} s")

    rows: list[dict[str, Any]] = []
    runs: list[Run] = []
    policies = PolicySet(fleet.region_policies)
    base_fleet = fleet
    slos = fleet.admission.slos()  # the fleet's SLO map: what admission, FleetMind and the report judge by
    for placement in placements:
        for name, admission, mode in ((n, a, m) for n in names for a in admissions for m in modes):
            random.seed(args.seed)  # for any policy that draws from the module RNG
            fleet = pd_fleet(base_fleet, mode)  # (`off`: the fleet file's; P/D modes: its P/D token budget)
            try:
                router = make_policy(name, args.seed, fleet)
                if args.gateways > 1:  # replica i: its own router, seeded apart
                    router = ReplicatedRouter([router] + [make_policy(name, args.seed + i, fleet)
                                                          for i in range(1, args.gateways)],
                                              sync_s=args.sync_ms / 1000.0, spread=not args.no_spread)
            except Exception as e:  # a policy that cannot be built must not sink the others
                return _err(f"policy {name!r} could not be built: {e}")
            label = name if len(placements) == 1 else f"{name}/{placement}"
            if len(admissions) > 1 or admission != "fcfs":
                label += f"+{admission}"
            if len(modes) > 1 or mode != "off":
                label += f" pd={mode}"
            prog = Progress(label, enabled=not args.no_progress)
            controllers = placement_controllers(placement, fleet)
            pd_policy = make_disagg_policy(mode, router)
            pd_ctl = pd_controllers(mode, fleet)
            sim = FleetSimulator(fleet, router, site_chooser=make_placement(placement, fleet, router),
                                 admission=make_admission(admission, slomax_config(fleet)),
                                 progress=prog, controllers=[*controllers, *pd_ctl],
                                 pd=(lambda s, p=pd_policy: PDRuntime(s, p)) if pd_policy is not None else None,
                                 failures=failures if failures.active else None)
            res = sim.run(inputs)
            for w in res.warnings[:5]:
                print(f"tokenfleet simulate: warning: {label}: {w}", file=sys.stderr)
            summary = summarize_all(res.records, slos)
            row = result_row(name, summary, res.wall_s, {
                "steps": res.steps, "preemptions": res.preemptions, "span_s": round(summary["span_s"], 3)})
            row["placement"] = placement
            row["admission"] = admission
            row["disagg"] = mode
            last_end = max((r.end_s for r in res.records if r.end_s is not None), default=res.sim_end_s)
            row.update(pd_row(sim.pd if isinstance(sim.pd, PDRuntime) else None, pd_ctl, last_end))
            row["residency_violations"] = residency_violations(res.records, policies, fleet)
            row["by_site"] = by_site(res.records, summary["span_s"], slos)
            if res.failures is not None:
                row["failures"] = res.failures
            if controllers:
                row["planner_log"] = [{"at": e.at, "kind": e.kind, "move": e.move.describe() if e.move else None,
                                       "reason": e.reason} for e in controllers[0][1].core.planner.log]
                row["planner_actions"] = [asdict(a) for a in controllers[0][1].core.actions]
            rows.append(row)
            runs.append(Run(label, row, res.records))
            slo = row["slo_attainment"]
            _say(f"ran       {label:<22} wall {res.wall_s:6.1f} s  ({res.steps} engine steps, "
                 f"{summary['span_s']:.0f} s simulated)  goodput {row['goodput_tok_s']:.0f} tok/s  "
                 f"SLO {100 * slo if slo is not None else 0:.1f}%")
            if res.failures is not None:
                _say(f"failures  {label:<22} {failure_line(res.failures)}")

    report = build_report(desc, fsum, rows)
    print()
    print(format_table(rows))
    if args.json:
        try:
            write_json(report, args.json)
        except OSError as e:
            return _err(f"cannot write {args.json}: {e.strerror}")
        _say(f"\nwrote {args.json}")
    if args.plot:
        try:
            written = write_plots(args.plot, runs, slos, title=f"{desc['name']} x{args.rate_scale:g} on {fleet_path.name}")
        except OSError as e:
            return _err(f"cannot write {args.plot}: {e.strerror}")
        _say(f"wrote {', '.join(map(str, written))}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "simulate":
        argv = argv[1:]
    p = argparse.ArgumentParser(prog="tokenfleet simulate", description=__doc__.split("\n\n")[0])
    _add_arguments(p)
    return run_simulate(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

