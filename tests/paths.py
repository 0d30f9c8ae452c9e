"""Where the tests find the project's shared data (the public traces beside the repo)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The traces live in ../shared/traces beside the checkout (CI lays a copy there too);
# TOKENFLEET_TRACES points elsewhere. Missing traces fail the tests that need them.
TRACES = Path(os.environ.get("TOKENFLEET_TRACES", REPO.parent / "shared" / "traces"))
