"""`tokenfleet` command line: a thin dispatcher that imports only the package its subcommand needs.

    tokenfleet up        launch the fleet's engines and the gateway      (gateway.cli)
    tokenfleet check     validate a fleet file                          (tokenfleet.check)
    tokenfleet simulate  replay a trace on a simulated fleet            (fleetsim.cli)
    tokenfleet bench     benchmark a running endpoint (`bench live`)    (fleetsim.live)

Why thin: the gateway serving production must not carry the simulator and the load
generator (their imports, their memory, their failure modes), and `simulate` must not need
the gateway's web stack. Each command's module registers its own parser and sets
`args.func`; this module knows only names, one-line help and which module to import.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from fleetcore.fleet_config import FleetConfigError


@dataclass(frozen=True, slots=True)
class Command:
    module: str  # imported only when this command runs
    register: str  # its function(subparsers) that adds the command's parser and sets `func`
    help: str  # for `tokenfleet --help`, shown without importing `module`


COMMANDS: dict[str, Command] = {
    "up": Command("gateway.cli", "add_up_parser", "launch the fleet's engines and the gateway in front of them"),
    "check": Command("tokenfleet.check", "add_check_parser", "validate a fleet file"),
    "simulate": Command("fleetsim.cli", "add_simulate_parser",
                        "replay a trace through routing policies on a simulated fleet"),
    "bench": Command("fleetsim.live", "add_bench_parser", "benchmark a running endpoint"),
}


def build_parser(command: str | None) -> argparse.ArgumentParser:
    """The parser with `command`'s real subparser (its module imported) and stubs for the
    others: enough for `tokenfleet --help` to list them all, nothing of theirs loaded."""
    p = argparse.ArgumentParser(prog="tokenfleet", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, cmd in COMMANDS.items():
        if name == command:
            getattr(importlib.import_module(cmd.module), cmd.register)(sub)
        else:
            sub.add_parser(name, help=cmd.help, add_help=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The command is the first word or nothing (the top level has no options but --help).
    command = argv[0] if argv and argv[0] in COMMANDS else None
    args = build_parser(command).parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.func(args))
    except FleetConfigError as e:
        print(e, file=sys.stderr)
        return 2
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 130


if __name__ == "__main__":
    sys.exit(main())
