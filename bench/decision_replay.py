"""Decision replay: TokenPilot's decisions at two commits, bit-for-bit, on the same requests.

    python bench/decision_replay.py                         # 74a6390^ vs 74a6390 (ROUTING.md, Decision cost)
    python bench/decision_replay.py --old main --new WORKTREE --decisions 15000

Each side is the repository's tree at that commit (`git archive`, extracted to a temporary
folder; `WORKTREE` is the checkout this script runs from) and runs in its own Python
process, so the two versions never share a module. Both replay the same deterministic
stream (seeded): Mooncake-like prompts (shared first block, 40% extending an earlier
conversation) over 64 instances, with shuffled and partial candidate pools, outcomes fed
back to `observe` for most requests (TTFT / TPOT drawn around the prediction) and
exploration on (TokenPilot's own seeded generator). Per decision they record the chosen
instance, the predicted TTFT and every candidate score as `float.hex` (exact), the cached
tokens and the reason text; the script then compares the two records line by line and
prints the first divergence. Exit status 0 when identical, 1 otherwise.

The figure in bench/ROUTING.md ("checked by replaying ~15,000 decisions ... identical
choices, predicted TTFTs and explanations") is reproduced by the default command.

`--through place` replays whole placements instead: `fleetmind.place` with FleetMind over
three sites (home-site, residency and spill policies, clients in several regions) and
TokenPilot as both its predictor and its router, with exclusions (retries), admission's
avoid hint, unready instances, KV pressure, engine KV events, other replicas' routes and
outcomes fed back. It records every try (site, site scores and their details, instance,
reason, predicted TTFT, candidate scores) and, at the end, what TokenPilot has learned per
instance. `tests/test_score_once.py` compares this record with a pinned one
(`tests/fixtures/place_replay.jsonl.gz`, re-recorded whenever a decision change is deliberate;
the test's docstring says when). The replay across score-once (identical):

    python bench/decision_replay.py --through place --old 09d9070 --new WORKTREE --decisions 3000
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Replay TokenPilot decisions at two commits and compare them bit for bit.")
    ap.add_argument("--old", default="74a6390^", help="git ref of the older router (default 74a6390^)")
    ap.add_argument("--new", default="74a6390", help="git ref of the newer router, or WORKTREE (default 74a6390)")
    ap.add_argument("--decisions", type=int, default=15000)
    ap.add_argument("--instances", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", metavar="DIR", help="keep both decision records (JSONL) in DIR")
    ap.add_argument("--through", choices=("route", "place"), default="route",
                    help="replay TokenPilot.route alone (default) or whole placements (fleetmind.place)")
    ap.add_argument("--record", metavar="OUT", help=argparse.SUPPRESS)  # internal: one side
    ap.add_argument("--tree", metavar="DIR", help=argparse.SUPPRESS)
    return ap


def next_prompt(rng: Any, convs: list[list[int]], next_id: int) -> tuple[list[int], int]:
    """Mooncake-like block ids: a shared first block, then up to 47 more; 40% extend an earlier
    conversation. Returns them and the next free id; `convs` keeps the last 2,000."""
    if convs and rng.random() < 0.4:
        blocks = rng.choice(convs) + list(range(next_id, next_id + rng.randrange(1, 6)))
    else:
        blocks = [0] + list(range(next_id, next_id + rng.randrange(2, 48)))
    convs.append(blocks)
    if len(convs) > 2000:
        convs.pop(0)
    return blocks, next_id + 64


def record(out: str, decisions: int, instances: int, seed: int) -> None:
    """One side: run in a process whose sys.path starts with that commit's tree."""
    import random

    from fleetcore.prefix import synthetic_block_hashes
    from fleetcore.types import InstanceSnapshot, RequestOutcome, RequestProfile
    from tokenpilot.priors import prior_from_physics
    from tokenpilot.router import TokenPilot

    rng = random.Random(seed)
    prior = prior_from_physics("llama-3.1-8b", "H100")
    ids = [f"i{k}" for k in range(instances)]
    tp = TokenPilot({i: prior for i in ids})
    convs: list[list[int]] = []
    next_id = 1
    pending: list[tuple[str, str, int, float | None]] = []
    with open(out, "w") as f:
        for n in range(decisions):
            blocks, next_id = next_prompt(rng, convs, next_id)
            pool = [InstanceSnapshot(i, "s", "m", "v", f"http://{i}", num_running=rng.randrange(0, 40)) for i in ids]
            rng.shuffle(pool)
            if rng.random() < 0.2:
                pool = pool[: rng.randrange(1, len(pool) + 1)]
            now = float(n) * 0.05
            prof = RequestProfile(f"r{n}", "m", 512 * len(blocks), tuple(synthetic_block_hashes(blocks, 32)))
            d = tp.route(prof, pool, now)
            f.write(json.dumps({
                "n": n, "instance": d.instance_id, "reason": d.reason, "cached": d.cached_tokens,
                "ttft": None if d.predicted_ttft_s is None else float(d.predicted_ttft_s).hex(),
                "cands": [[c.name, float(c.score).hex()] for c in d.candidates],
            }, sort_keys=True) + "\n")
            if d.instance_id is not None:
                pending.append((prof.request_id, d.instance_id, prof.prompt_tokens, d.predicted_ttft_s))
            # feed back outcomes of earlier requests, in a seeded order
            while pending and rng.random() < 0.7:
                rid, inst, ptoks, pred = pending.pop(rng.randrange(len(pending)))
                base = pred if pred is not None else 0.2
                tp.observe(RequestOutcome(rid, inst, "s", ok=rng.random() > 0.02, prompt_tokens=ptoks,
                                          output_tokens=rng.randrange(1, 600),
                                          ttft_s=base * rng.uniform(0.7, 1.5),
                                          mean_tpot_s=rng.uniform(0.01, 0.06)))


def _hex(x: float | None) -> str | None:
    return None if x is None else float(x).hex()


def record_place(out: str, decisions: int, instances: int, seed: int) -> None:
    """One side of `--through place` (see the module doc); only APIs that predate score-once."""
    import random

    from fleetcore.prefix import synthetic_block_hashes
    from fleetcore.region_policy import PolicySet, RegionPolicy
    from fleetcore.slo import DEFAULT_SLOS
    from fleetcore.types import FleetView, InstanceSnapshot, RequestOutcome, RequestProfile, SiteSnapshot
    from fleetmind.place import place
    from fleetmind.site_choice import FleetMind, FleetMindConfig
    from tokenpilot.priors import prior_from_physics
    from tokenpilot.router import TokenPilot

    rng = random.Random(seed)
    prior = prior_from_physics("llama-3.1-8b", "H100")
    sites = (("use1", "us-east", "us"), ("usw2", "us-west", "us"), ("euw1", "eu-west", "eu"))
    rtt = {"us-east": {"us-east": 1.0, "us-west": 60.0, "eu-west": 80.0},
           "us-west": {"us-east": 60.0, "us-west": 1.0, "eu-west": 140.0},
           "eu-west": {"us-east": 80.0, "us-west": 140.0, "eu-west": 1.0}}
    ids = [f"i{k:02d}" for k in range(instances)]
    site_of = {i: sites[k % len(sites)][0] for k, i in enumerate(ids)}
    tp = TokenPilot({i: prior for i in ids[:-2]})  # the last two are registered on first sight
    policies = PolicySet([RegionPolicy(tenant="home", home_site="use1", spill_sites=["usw2"]),
                          RegionPolicy(tenant="eu", allowed_jurisdictions=["eu"]),
                          RegionPolicy(tenant="pinned", home_site="usw2", spill=False)])
    fm = FleetMind(policies, tp, slos=DEFAULT_SLOS, config=FleetMindConfig(hold_s=1.0))
    tenants = ("home", "eu", "pinned", "anonymous", "anonymous")
    regions = ("us-east", "us-west", "eu-west", None)
    convs: list[list[int]] = []
    next_id = 1
    pending: list[tuple[str, str, str, int, float | None, float]] = []
    now = 0.0
    with open(out, "w") as f:
        for n in range(decisions):
            blocks, next_id = next_prompt(rng, convs, next_id)
            hashes = tuple(synthetic_block_hashes(blocks, 32))
            busy = {name for name, _, _ in sites if rng.random() < 0.25}  # a site whose queues are long
            snaps = [InstanceSnapshot(i, site_of[i], "m", "v", f"http://{i}", ready=rng.random() > 0.05,
                                      num_running=rng.randrange(0, 40),
                                      num_waiting=rng.randrange(20, 400) if site_of[i] in busy else rng.randrange(0, 6),
                                      kv_usage=rng.choice((0.1, 0.5, 0.8, 0.9, 0.99)) if rng.random() < 0.3 else 0.2)
                     for i in ids]
            view = FleetView(tuple(SiteSnapshot(name, region, jur, rtt[region],
                                                tuple(sn for sn in snaps if sn.site == name))
                                   for name, region, jur in sites))
            if rng.random() < 0.7:  # several requests at one clock reading, as in the simulator
                now += rng.choice((0.01, 0.05, 0.3))
            region = rng.choice(regions)
            prof = RequestProfile(f"r{n}", "m", 512 * len(blocks), hashes, tenant=rng.choice(tenants),
                                  client_region=region)
            exclude = (rng.choice(ids),) if rng.random() < 0.1 else ()
            avoid = tuple(rng.sample(ids, rng.randrange(1, 4))) if rng.random() < 0.15 else ()
            choice = place(prof, view, now, fm, tp, exclude=exclude, avoid=avoid)
            for t in choice.tries():
                f.write(json.dumps({
                    "n": n, "site": t.site.site, "site_reason": t.site.reason,
                    "site_cands": [[c.name, _hex(c.score), sorted((k, _hex(v)) for k, v in c.detail.items())]
                                   for c in t.site.candidates],
                    "instance": None if t.route is None else t.route.instance_id,
                    "reason": None if t.route is None else t.route.reason,
                    "ttft": None if t.route is None else _hex(t.route.predicted_ttft_s),
                    "cached": None if t.route is None else t.route.cached_tokens,
                    "cands": [] if t.route is None else [[c.name, _hex(c.score)] for c in t.route.candidates],
                    "chosen": None if t.instance is None else t.instance.instance_id,
                }, sort_keys=True) + "\n")
            inst = choice.instance
            if inst is not None and choice.route is not None:
                # (the engine's part of what the decision reports, and the round trip `place` added)
                pred, net = choice.route.predicted_ttft_s, choice.route.network_s
                pending.append((prof.request_id, inst.instance_id, inst.site, prof.prompt_tokens,
                                None if pred is None else pred - net, net))
            r = rng.random()
            if r < 0.05:  # another replica routed a request there
                tp.note_route(rng.choice(ids), hashes[: rng.randrange(1, len(hashes) + 1)], now)
            elif r < 0.08:  # an engine's KV events
                tp.observe_kv_events(rng.choice(ids), n, [{"type": "BlockStored", "block_hashes": list(hashes)}], now)
            while pending and rng.random() < 0.6:
                rid, iid, site, ptoks, pred, net = pending.pop(rng.randrange(len(pending)))
                base = pred if pred is not None else 0.2
                # the engine's time drawn around its prediction, the round trip on top, as the gateway
                # reports it (`network_s`; since i19-rtt the decision's TTFT holds it too)
                outcome = RequestOutcome(rid, iid, site, ok=rng.random() > 0.02, prompt_tokens=ptoks,
                                         output_tokens=rng.randrange(1, 600),
                                         ttft_s=base * rng.uniform(0.7, 1.5) + net,
                                         mean_tpot_s=rng.uniform(0.01, 0.06), network_s=net)
                tp.observe(outcome)
                fm.observe(outcome)
        learned = {i: {k: _hex(v) for k, v in sorted(tp.explain(i).items())} for i in ids}
        f.write(json.dumps({"learned": learned}, sort_keys=True) + "\n")


def tree_at(ref: str, tmp: str) -> Path:
    if ref == "WORKTREE":
        return ROOT
    dest = Path(tmp) / ref.replace("/", "_").replace("^", "_parent").replace("~", "_back")
    dest.mkdir(parents=True)
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", ref],
                         check=True, capture_output=True).stdout
    tf = Path(tmp) / (dest.name + ".tar")
    tf.write_bytes(tar)
    with tarfile.open(tf) as t:
        t.extractall(dest)
    return dest


def run_alternately(script: Path, child_args: list[str], baseline_ref: str, rounds: int) -> None:
    """Run `script` over `baseline_ref`'s tree and this checkout's alternately (baseline, this,
    baseline, ...), `rounds` times each, each in its own process with that tree first on its path,
    printing each child's lines prefixed with the round and the side: the `--baseline-ref` of
    bench/decision_cost.py and bench/place_cost.py."""
    with tempfile.TemporaryDirectory() as tmp:
        sides = (("baseline " + baseline_ref, tree_at(baseline_ref, tmp)), ("this checkout", ROOT))
        for (side, tree), ref in zip(sides, (baseline_ref, "HEAD")):
            rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", ref],
                                 capture_output=True, text=True, check=True).stdout.strip()
            dirty = ref == "HEAD" and subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--",
                                                      "fleetcore", "fleetmind", "tokenpilot", "gateway"],
                                                     capture_output=True, text=True).stdout.strip()
            print(f"{side}: {rev}{' + uncommitted changes' if dirty else ''}, code from {tree}", flush=True)
        for k in range(rounds):
            for side, tree in sides:
                out = subprocess.run([sys.executable, str(script), *child_args],
                                     env={**os.environ, "PYTHONPATH": str(tree)}, cwd=str(tree),
                                     capture_output=True, text=True, check=True).stdout
                for line in out.splitlines():
                    print(f"round {k + 1} {side:>18} | {line}", flush=True)


def main() -> int:
    args = build_parser().parse_args()
    if args.record:
        sys.path.insert(0, args.tree)
        (record_place if args.through == "place" else record)(args.record, args.decisions, args.instances,
                                                               args.seed)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        outs = []
        for side, ref in (("old", args.old), ("new", args.new)):
            tree = tree_at(ref, tmp)
            rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD" if ref == "WORKTREE" else ref],
                                 capture_output=True, text=True).stdout.strip()
            out = str(Path(args.keep or tmp) / f"decisions-{side}.jsonl")
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, "PYTHONPATH": str(tree)}
            subprocess.run([sys.executable, __file__, "--record", out, "--tree", str(tree),
                            "--decisions", str(args.decisions), "--instances", str(args.instances),
                            "--seed", str(args.seed), "--through", args.through], check=True, env=env, cwd=str(tree))
            digest = hashlib.sha256(Path(out).read_bytes()).hexdigest()
            print(f"{side}: {ref} ({rev}): {args.decisions} decisions, record sha256 {digest}")
            outs.append(out)
        a, b = (Path(o).read_text().splitlines() for o in outs)
        diff = [k for k, (x, y) in enumerate(zip(a, b)) if x != y]
        if len(a) != len(b):
            diff.append(min(len(a), len(b)))
        if not diff:
            print(f"identical: {len(a)} decisions (choices, predicted TTFTs, candidate scores, reasons)")
            return 0
        print(f"DIFFERENT: {len(diff)} of {len(a)} decisions; first at #{diff[0]}:")
        print("  old:", a[diff[0]] if diff[0] < len(a) else "<none>")
        print("  new:", b[diff[0]] if diff[0] < len(b) else "<none>")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
