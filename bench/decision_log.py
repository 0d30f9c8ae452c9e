"""Log TokenPilot's every placement in one `tokenfleet simulate` run, and find the first one two
runs disagree on: where a change that moves a closed-loop simulation's figures starts to move it.

    python bench/decision_log.py run --out OUT.jsonl [--tree DIR] -- SIMULATE-ARGS...
    python bench/decision_log.py diff A.jsonl B.jsonl [--top 6]

`run` runs `tokenfleet simulate SIMULATE-ARGS` (one policy, one `--disagg` mode: the file holds
the last run) with the code of checkout `--tree` (default: this one; a `git archive` of another
commit works), and writes one JSON line per placement: the request, the decision time, the
instance it went to (and the prefill instance, under P/D), and the `--top` candidates of the
router's cost with its terms (cost, the physics' TTFT, queue, prefill, interference, KV pressure,
own decode, locality; seconds), cached tokens, streams, and the learned speed factors (prefill,
decode) of each. Under P/D (`--disagg`) the placement is `TokenPilot.book`'s, and the candidates
are ranked by the router's cost as `price` gave it (the P/D decision adds the promised-KV
pressure and compares splits). The decisions are the command's own: the wrapper only reads them.

`diff` prints the first placement the two logs disagree on with both runs' top candidates, the
first decision at which any learned factor differed, and the share of requests placed alike.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]
_TERMS = ("cost", "ttft", "queue", "prefill", "interference", "kv", "decode", "locality")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run tokenfleet simulate and log every placement")
    r.add_argument("--out", type=Path, required=True, help="the log (JSON lines)")
    r.add_argument("--tree", type=Path, default=HERE, help="checkout whose code runs (default: this one)")
    r.add_argument("--top", type=int, default=6, help="candidates logged per decision (default 6)")
    r.add_argument("simulate", nargs=argparse.REMAINDER, help="-- then tokenfleet simulate's arguments")
    d = sub.add_parser("diff", help="the first placement two logs disagree on")
    d.add_argument("a", type=Path)
    d.add_argument("b", type=Path)
    d.add_argument("--top", type=int, default=6, help="candidates shown (default 6)")
    return p


def _run(a: argparse.Namespace) -> int:
    sys.path.insert(0, str(a.tree.resolve()))
    import numpy as np

    import tokenpilot.router as tr
    from tokenpilot import score_kernel as sk

    rows = (sk.O_COST, sk.O_TTFT, sk.O_QUEUE, sk.O_PREFILL, sk.O_INTERFERENCE, sk.O_KV, sk.O_DECODE, sk.O_LOCALITY)
    out = a.out.open("w")
    top = a.top

    def log(router: Any, rid: str, now: float, ids: Any, o: Any, chosen: str, prefill_on: str | None) -> None:
        m, cands = router._s.m, []
        for j in np.argsort(o[sk.O_COST], kind="stable")[:top]:
            k = router._s.slot(ids[j])
            cands.append({"i": ids[j], **{t: float(o[r, j]) for t, r in zip(_TERMS, rows)},
                          "cached": float(o[sk.O_CACHED, j]), "streams": float(o[sk.O_FEATURES + 3, j]),
                          "pf": float(m[sk.PREFILL_FACTOR, k]), "df": float(m[sk.DECODE_FACTOR, k])})
        k = router._s.slot(chosen)
        out.write(json.dumps({"id": rid, "t": now, "i": chosen, "p": prefill_on,
                              "pf": float(m[sk.PREFILL_FACTOR, k]), "df": float(m[sk.DECODE_FACTOR, k]),
                              "top": cands}) + "\n")

    route, book = tr.TokenPilot.route, tr.TokenPilot.book

    def routed(self: Any, profile: Any, candidates: Any, now: float) -> Any:
        # Scored first, as `route` scores it: `route` then finds these very terms in the router's
        # memo (the site chooser's `predict` put them there already), so nothing is scored twice.
        pool = self._eligible(candidates)
        scored = self._terms(profile, pool, now) if pool else None
        d = route(self, profile, candidates, now)
        if d.instance_id is not None and scored is not None:
            log(self, profile.request_id, now, scored[0], scored[2][-1], d.instance_id, None)
        return d

    def booked(self: Any, profile: Any, priced: Any, prefill_on: str, decode_on: str, now: float,
               predicted_ttft_s: float) -> None:
        book(self, profile, priced, prefill_on, decode_on, now, predicted_ttft_s)
        log(self, profile.request_id, now, priced.ids, priced.terms[-1], decode_on,
            None if prefill_on == decode_on else prefill_on)

    tr.TokenPilot.route, tr.TokenPilot.book = routed, booked  # type: ignore[method-assign]
    from tokenfleet.cli import main as tokenfleet_main

    args = a.simulate[1:] if a.simulate[:1] == ["--"] else a.simulate
    try:
        return tokenfleet_main(["simulate", *args])
    finally:
        out.close()


def _short(iid: str) -> str:
    return iid.rsplit("/", 1)[-1]


def _table(rec: dict[str, Any], top: int) -> str:
    head = f"    {'inst':>5} " + " ".join(f"{t:>12}" for t in _TERMS) + f" {'cached':>7} {'streams':>7} {'pf':>7} {'df':>7}"
    lines = [head]
    for c in rec["top"][:top]:
        mark = "  <- chosen" if c["i"] == rec["i"] else ""
        lines.append(f"    {_short(c['i']):>5} " + " ".join(f"{c[t]:12.4f}" for t in _TERMS)
                     + f" {c['cached']:7.0f} {c['streams']:7.0f} {c['pf']:7.4f} {c['df']:7.4f}{mark}")
    return "\n".join(lines)


def _diff(a: argparse.Namespace) -> int:
    xs = [json.loads(line) for line in a.a.open()]
    ys = [json.loads(line) for line in a.b.open()]
    factors = next((n for n, (x, y) in enumerate(zip(xs, ys))
                    if x["id"] != y["id"] or x["pf"] != y["pf"] or x["df"] != y["df"]), None)
    first = next((n for n, (x, y) in enumerate(zip(xs, ys))
                  if x["id"] != y["id"] or x["i"] != y["i"] or x["p"] != y["p"]), None)
    where_a, where_b = {x["id"]: (x["i"], x["p"]) for x in xs}, {y["id"]: (y["i"], y["p"]) for y in ys}
    alike = sum(1 for rid, w in where_a.items() if where_b.get(rid) == w)
    print(f"{len(xs)} / {len(ys)} placements; the same instance(s) for {alike} requests "
          f"({alike / max(len(where_a), 1):.1%} of A's)")
    if factors is not None:
        x, y = xs[factors], ys[factors]
        print(f"first learned factor that differs: placement {factors} ({x['id']} at {x['t']:.3f} s): "
              f"chosen instance's prefill {x['pf']:.6f} / {y['pf']:.6f}, decode {x['df']:.6f} / {y['df']:.6f}")
    if first is None:
        print("no placement differs")
        return 0
    x, y = xs[first], ys[first]
    print(f"first placement that differs: {first} ({x['id']} at {x['t']:.3f} s / {y['id']} at {y['t']:.3f} s)")
    for name, rec in (("A", x), ("B", y)):
        pre = f", prefill on {_short(rec['p'])}" if rec["p"] else ""
        print(f"  {name}: {rec['id']} -> {_short(rec['i'])}{pre}")
        print(_table(rec, a.top))
    return 0


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    return _run(a) if a.cmd == "run" else _diff(a)


if __name__ == "__main__":
    raise SystemExit(main())
