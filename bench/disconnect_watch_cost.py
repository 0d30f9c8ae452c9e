"""What `gateway.relay.DisconnectWatch.race` costs a request: this tree's against another commit's.

    .venv/bin/python bench/disconnect_watch_cost.py [--base REV] [--races N] [--rounds R]

Times N races of an awaitable that is already done (the common case: a response head or
first event that comes before the 50 ms lazy-watch timer, so no watcher task is started),
each watch in the request's own task, alternating this tree's class and REV's (loaded from
`git show REV:gateway/relay.py`), R rounds; prints the median microseconds per race of each.
A request races 2 to 4 times (admission queue, head, first event, the stream).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable from a checkout without installing

from gateway import relay as this_relay  # noqa: E402


def _relay_at(rev: str) -> Any:
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:gateway/relay.py"], check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "relay_at_rev.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("relay_at_rev", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


async def _receive() -> dict[str, str]:
    await asyncio.Event().wait()  # a client that never leaves
    return {"type": "http.disconnect"}


async def _done() -> int:
    return 1


async def _time(cls: Any, races: int) -> float:
    watch = cls(_receive)
    t0 = time.perf_counter()
    for _ in range(races):
        await watch.race(_done())
    elapsed = time.perf_counter() - t0
    await watch.aclose()
    return elapsed / races * 1e6


async def _main(base: str, races: int, rounds: int) -> None:
    old = _relay_at(base).DisconnectWatch
    new = this_relay.DisconnectWatch
    got: dict[str, list[float]] = {"base": [], "this tree": []}
    for _ in range(rounds):
        got["base"].append(await _time(old, races))
        got["this tree"].append(await _time(new, races))
    for name, us in got.items():
        print(f"{name}: median {statistics.median(us):.2f} us per race (min {min(us):.2f}, max {max(us):.2f}; "
              f"{rounds} rounds of {races})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="main")
    p.add_argument("--races", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=9)
    a = p.parse_args()
    asyncio.run(_main(a.base, a.races, a.rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
