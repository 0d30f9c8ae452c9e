"""`tokenfleet check`: validate a fleet file as `up` would load it, launching nothing.

Builds the adapters too, because some checks live there (a simulated model that does not
fit its GPU fails at load time, not at launch)."""

from __future__ import annotations

import argparse
from typing import Any

from engine_adapters.registry import build_adapters
from fleetcore.fleet_config import DEFAULT_FLEET_FILE, load_fleet_file


def add_check_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("check", description=__doc__.split("\n\n")[0])
    p.add_argument("--fleet", help=f"fleet file (default: {DEFAULT_FLEET_FILE})")
    p.set_defaults(func=run_check)
    return p


def run_check(args: argparse.Namespace) -> int:
    path = args.fleet or DEFAULT_FLEET_FILE
    config = load_fleet_file(path)
    build_adapters(config)
    n = sum(d.instance_count for d in config.deployments)
    print(f"{path}: ok — {len(config.sites)} site(s), {len(config.models)} model(s), {n} instance(s), "
          f"{len(config.tenants)} tenant(s)")
    return 0
