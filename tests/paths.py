"""Where the tests find the public traces the repository carries (traces/, provenance in SOURCES.md)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# TOKENFLEET_TRACES points elsewhere. Missing traces fail the tests that need them.
TRACES = Path(os.environ.get("TOKENFLEET_TRACES", REPO / "traces"))
