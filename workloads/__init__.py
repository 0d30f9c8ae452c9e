"""Workloads for the simulator and the live benchmark.

Canonical trace rows (`TraceRequest`) in time-ordered `Workload`s; loaders for the
public traces in traces/ (in the repository); seeded generators for chat, agent, long-document
and batch shapes; mixing (merge, assign, scale, window); and prompt text for live
replay, where equal leading block ids become byte-identical leading text.
"""

from workloads.generators import (
    GENERATORS,
    LengthDist,
    agent_loops,
    chat_sessions,
    document_analysis,
    offline_batch,
)
from workloads.loaders import FORMATS, detect_format, load_azure, load_trace
from workloads.mix import assign, head, merge, scale_rate, window
from workloads.prompts import chunk_text, prompt_text
from workloads.trace import DEFAULT_BLOCK_TOKENS, TraceRequest, Workload, id_namespace

__all__ = [
    "DEFAULT_BLOCK_TOKENS", "FORMATS", "GENERATORS", "LengthDist", "TraceRequest", "Workload",
    "agent_loops", "assign", "chat_sessions", "chunk_text", "detect_format", "document_analysis",
    "head", "id_namespace", "load_azure", "load_trace", "merge", "offline_batch", "prompt_text",
    "scale_rate", "window",
]
