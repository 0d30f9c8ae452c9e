"""SGLang engines: launched per instance or attached by URL, metrics and KV events."""

from engine_adapters.sglang.adapter import SGLangAdapter, SGLangOptions

__all__ = ["SGLangAdapter", "SGLangOptions"]
