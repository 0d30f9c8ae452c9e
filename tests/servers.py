"""Run an ASGI app on a real loopback socket inside the test's event loop.

The server itself lives in `gateway.embedded` (bench scripts use it too, and bench must not
import tests); tests keep importing it from here."""

from __future__ import annotations

from gateway.embedded import serve_app

__all__ = ["serve_app"]
