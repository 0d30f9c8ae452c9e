#!/usr/bin/env bash
# Routing benchmark: TokenPilot against plain balancing and the published routers, on the
# Mooncake conversation and synthetic traces at ~60/80/95% of the default fleet's capacity
# (rate-scales from `tokenfleet simulate --describe-capacity`, no-reuse estimate).
# Writes one JSON per run to ${OUT:-bench_out}/ and prints the tables.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out}
TRACES=${TRACES:-traces}
POLICIES=${POLICIES:-round_robin,tokenpilot,sglang_cache_aware,dynamo_kv,llm_d,aibrix_prefix,least_loaded}
mkdir -p "$OUT"
run() {  # name trace rate-scale
  echo "== $1 (rate-scale $3)"
  .venv/bin/tokenfleet simulate --trace "$2" --policy "$POLICIES" --rate-scale "$3" --no-progress \
    --json "$OUT/$1.json" | sed -n '/^policy/,$p'
}
# conversation (12,031 requests): 60/80/95% of no-reuse capacity = rate-scale 2.60/3.46/4.11
run conversation-60 "$TRACES/conversation_trace.jsonl.gz" 2.60
run conversation-80 "$TRACES/conversation_trace.jsonl.gz" 3.46
run conversation-95 "$TRACES/conversation_trace.jsonl.gz" 4.11
# synthetic (3,993 requests): 60/80/95% of no-reuse capacity = rate-scale 2.00/2.66/3.16
run synthetic-60 "$TRACES/synthetic_trace.jsonl" 2.00
run synthetic-80 "$TRACES/synthetic_trace.jsonl" 2.66
run synthetic-95 "$TRACES/synthetic_trace.jsonl" 3.16
# Beyond the Mooncake traces (weights were not tuned on these): no prefix reuse (Azure
# conversation, ~80% of capacity) and heavy reuse (multi-turn chat + agent loops from the
# generators, at 8x their base rate, ~50% of the ideal-cache capacity).
.venv/bin/python - "$OUT/generators.jsonl" <<'PY'
import sys
from workloads import merge
from workloads.generators import agent_loops, chat_sessions
merge(chat_sessions(sessions=1500, rate=3.0, seed=1), agent_loops(agents=300, rate=0.6, seed=2, prefixes=4),
      name="chat+agent").to_jsonl(sys.argv[1])
PY
MAX="--max-requests 6000"
run_max() { echo "== $1 (rate-scale $3)"; .venv/bin/tokenfleet simulate --trace "$2" --policy "$POLICIES" --rate-scale "$3" \
  $MAX --no-progress --json "$OUT/$1.json" | sed -n '/^policy/,$p'; }
run_max azure-conv-80 "$TRACES/AzureLLMInferenceTrace_conv.csv" 26.6
run_max generators-x8 "$OUT/generators.jsonl" 8
