"""Layers point down (DESIGN.md, "The house"), and `tokenfleet up` carries only what it serves with.

Two checks: every import statement in the packages, function-level ones included, against
the table of what each layer may use; and, at run time in a fresh interpreter, the modules
that `tokenfleet up`'s path actually loads.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO

POLICIES = {"slomax", "fleetmind", "tokenpilot"}
# What each package may import of ours (besides itself). Policies share only fleetcore; the
# live gateway never imports the simulator or the load generator; fleetcore imports nothing.
ALLOWED: dict[str, set[str]] = {
    "fleetcore": set(),
    **{p: {"fleetcore"} for p in POLICIES},
    "workloads": {"fleetcore"},
    "engine_adapters": {"fleetcore"},
    "gateway": {"fleetcore", "engine_adapters"} | POLICIES,
    "fleetsim": {"fleetcore", "engine_adapters", "workloads"} | POLICIES,
    # the dispatcher names its commands' modules as strings; statically it needs only these
    "tokenfleet": {"fleetcore", "engine_adapters"},
    # bench scripts drive everything, but tests (which run bench scripts) are not theirs
    "bench": {"fleetcore", "engine_adapters", "workloads", "gateway", "fleetsim", "tokenfleet"} | POLICIES,
}
OURS = set(ALLOWED) | {"tests"}


def imports_of(path: Path) -> set[str]:
    """Top-level names of our packages that a file imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {n.split(".")[0] for n in names} & OURS
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_layers_point_down(package: str) -> None:
    files = sorted((REPO / package).rglob("*.py"))
    assert files, f"no package {package!r}: update ALLOWED"
    wrong = {str(f.relative_to(REPO)): sorted(imports_of(f) - ALLOWED[package] - {package}) for f in files}
    assert not {f: w for f, w in wrong.items() if w}


def test_the_import_scan_sees_function_level_imports(tmp_path: Path) -> None:
    # the roofline used to reach the policies this way: lazily, inside a function
    f = tmp_path / "m.py"
    f.write_text("def prior():\n    from engine_adapters.sim import hardware\n    import fleetsim.live as x\n")
    assert imports_of(f) == {"engine_adapters", "fleetsim"}


def loaded_by(argv: list[str], also_import: tuple[str, ...] = ()) -> set[str]:
    """Top-level packages in sys.modules after `tokenfleet ARGV` ran in a fresh interpreter."""
    code = (
        "import json, sys\n"
        "from tokenfleet.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        + "".join(f"import {m}\n" for m in also_import)
        + "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return set(json.loads(r.stdout.strip().splitlines()[-1]))


def test_up_path_loads_neither_simulator_nor_load_generator() -> None:
    """`tokenfleet up` as far as it gets without engines: parsed, fleet loaded, adapters built,
    the app module imported, then the bind fails (TEST-NET address) and it returns. The policy
    store module is imported by `up` only with --redis-url, after launch: imported here too."""
    fleet = REPO / "tests" / "fleet_test.yaml"
    mods = loaded_by(["up", "--fleet", str(fleet), "--host", "203.0.113.1", "--port", "0"],
                     also_import=("gateway.app", "gateway.policy_store"))
    assert {"gateway", "engine_adapters", "fleetcore"} <= mods  # it did get that far
    assert not mods & {"fleetsim", "workloads", "bench", "tests"}


@pytest.mark.parametrize("command, needs", [("simulate", "fleetsim"), ("bench", "workloads")])
def test_other_commands_load_their_own_package_and_not_the_gateway(command: str, needs: str) -> None:
    mods = loaded_by([command, "--help"])
    assert needs in mods  # the check above can fail: this is what a loaded package looks like
    assert "gateway" not in mods and "uvicorn" not in mods


def test_top_level_help_lists_every_command_without_importing_them() -> None:
    mods = loaded_by(["--help"])
    assert not mods & {"gateway", "fleetsim", "workloads", "engine_adapters"}
