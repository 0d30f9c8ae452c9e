"""Attach to OpenAI-compatible engines someone else runs, by URL."""

from engine_adapters.static.adapter import StaticAdapter

__all__ = ["StaticAdapter"]
