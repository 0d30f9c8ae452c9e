#!/usr/bin/env bash
# Routing benchmark: TokenPilot against plain balancing and the published routers, on the
# Mooncake conversation and synthetic traces at ~60/80/95% of the default fleet's capacity
# (rate-scales from `tokenfleet simulate --describe-capacity`, no-reuse estimate).
# Writes one JSON per run to ${OUT:-bench_out}/ and prints the tables.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out}
TRACES=${TRACES:-../shared/traces}
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
