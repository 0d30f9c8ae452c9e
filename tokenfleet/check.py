"""`tokenfleet check`: validate a fleet file as `up` would load it, launching nothing.

Every problem is reported at once, each as `FILE:LINE: path: message`, with "did you mean"
for near-miss names (`fleetcore.fleet_check`). Builds the adapters too, because some checks
live there (a simulated model that does not fit its GPU fails at load time, not at launch)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from engine_adapters.base import AdapterError
from engine_adapters.registry import adapter_prefixes, build_adapter
from fleetcore.fleet_check import Problem, check_fleet_text, line_map
from fleetcore.fleet_config import DEFAULT_FLEET_FILE, FleetConfig, FleetConfigError


def add_check_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("check", description=__doc__.split("\n\n")[0])
    p.add_argument("--fleet", help=f"fleet file (default: {DEFAULT_FLEET_FILE})")
    p.set_defaults(func=run_check)
    return p


def run_check(args: argparse.Namespace) -> int:
    path = Path(args.fleet or DEFAULT_FLEET_FILE)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise FleetConfigError(f"{path}: cannot read fleet file: {e.strerror}") from None
    config, problems = check_fleet_text(text)
    if config is None:
        print(f"{path}: invalid fleet file ({len(problems)} problem(s))", file=sys.stderr)
        for p in problems:
            print("  " + p.format(str(path)), file=sys.stderr)
        return 2
    problems = adapter_problems(config, line_map(text))
    if problems:  # checks that live in the adapters (sim options, a model that does not fit its GPU)
        print(f"{path}: invalid fleet file ({len(problems)} problem(s))", file=sys.stderr)
        for p in problems:
            print("  " + p.format(str(path)), file=sys.stderr)
        return 2
    n = sum(d.instance_count for d in config.deployments)
    print(f"{path}: ok — {len(config.sites)} site(s), {len(config.models)} model(s), {n} instance(s), "
          f"{len(config.tenants)} tenant(s)")
    return 0


def adapter_problems(config: FleetConfig, lines: dict[tuple[str | int, ...], int]) -> list[Problem]:
    """Each deployment's adapter built on its own, so every deployment's problem is reported."""
    out = []
    for i, (d, prefix) in enumerate(zip(config.deployments, adapter_prefixes(config))):
        try:
            build_adapter(config, d, prefix)
        except (AdapterError, FleetConfigError) as e:
            where = ("deployments", i, "options") if d.options else ("deployments", i)
            line = next((lines[where[:n]] for n in range(len(where), 0, -1) if where[:n] in lines), None)
            out.append(Problem(line, ".".join(map(str, where)), str(e)))
    return out

