"""vLLM engines: launched per instance or attached by URL, metrics and KV events."""

from engine_adapters.vllm.adapter import VLLMAdapter, VLLMOptions

__all__ = ["VLLMAdapter", "VLLMOptions"]
