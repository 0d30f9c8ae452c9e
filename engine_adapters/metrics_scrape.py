"""Read an engine's Prometheus text into a LoadSnapshot.

vLLM and the bundled simulated worker share metric names (`vllm:*`); SGLang's
(`sglang:*`) map onto the same fields: its prompt and cached token counters are
the same token-level prefix-cache counters as vLLM's queries and hits. One parser
for all adapters.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict

from prometheus_client.parser import text_string_to_metric_families

from engine_adapters.base import LoadSnapshot

# snapshot field -> metric sample names that feed it, first found wins
_FIELDS: dict[str, tuple[str, ...]] = {
    "num_running": ("vllm:num_requests_running", "sglang:num_running_reqs"),
    "num_waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"),
    "prefix_cache_queries": ("vllm:prefix_cache_queries_total", "sglang:prompt_tokens_total"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits_total", "sglang:cached_tokens_total"),
}
# Fractions are not additive: an engine reporting per rank (vLLM data parallel, SGLang
# DP attention) is as full as its fullest rank.
_MAX_FIELDS = frozenset({"kv_usage"})


_BLOCK_SIZE_INFO = "vllm:cache_config_info"
_WANTED = tuple(sorted({n for names in _FIELDS.values() for n in names} | {_BLOCK_SIZE_INFO}))


def _wanted_lines(text: str) -> str:
    """Only the sample lines of the metrics read below. An engine's page has hundreds of lines
    (histogram buckets mostly) and the gateway polls every engine twice a second on its event
    loop: the full parse cost 5 ms for the sim worker's 146 lines. Dropping `# HELP`/`# TYPE`
    lines changes no sample name (an untyped sample keeps the name it was written with), and
    a prefix match that keeps a longer name too is harmless: samples are summed by exact name."""
    return "\n".join([line for line in text.splitlines() if line.startswith(_WANTED)]) + "\n"


# The lines read above change only when the engine's load does: an idle engine's are the same at
# every poll (twice a second, each engine). A snapshot already parsed from the same lines is
# returned again (LoadSnapshot is frozen; nothing writes its `extra`). Bounded: a few entries per
# engine polled, the least recently used dropped first.
_PARSED_MAX = 1024
_parsed: OrderedDict[str, LoadSnapshot] = OrderedDict()


def parse_metrics(text: str) -> LoadSnapshot:
    """Sum each metric over its label sets (one engine may report per model or per rank);
    usage fractions take the maximum."""
    wanted = _wanted_lines(text)
    snap = _parsed.get(wanted)
    if snap is not None:
        _parsed.move_to_end(wanted)
        return snap
    snap = _parse_wanted(wanted)
    _parsed[wanted] = snap
    if len(_parsed) > _PARSED_MAX:
        _parsed.popitem(last=False)
    return snap


def _parse_wanted(wanted: str) -> LoadSnapshot:
    sums: dict[str, float] = defaultdict(float)
    maxes: dict[str, float] = {}
    block_size: int | None = None
    for family in text_string_to_metric_families(wanted):
        for sample in family.samples:
            sums[sample.name] += sample.value
            maxes[sample.name] = max(maxes.get(sample.name, sample.value), sample.value)
            if sample.name == _BLOCK_SIZE_INFO and "block_size" in sample.labels:
                try:
                    block_size = int(sample.labels["block_size"])
                except ValueError:
                    pass
    values: dict[str, float] = {}
    for field, names in _FIELDS.items():
        for name in names:
            if name in sums:
                values[field] = maxes[name] if field in _MAX_FIELDS else sums[name]
                break
    return LoadSnapshot(
        ready=True,
        num_running=int(values.get("num_running", 0)),
        num_waiting=int(values.get("num_waiting", 0)),
        kv_usage=float(values.get("kv_usage", 0.0)),
        prefix_cache_queries=values.get("prefix_cache_queries", 0.0),
        prefix_cache_hits=values.get("prefix_cache_hits", 0.0),
        block_size=block_size,
    )
