#!/usr/bin/env bash
# Routing benchmark: TokenPilot against plain balancing and the published routers, on the
# Mooncake conversation and synthetic traces, both Azure traces (conversation, code: no
# prefix reuse) and the chat and agent generators (heavy reuse), each at ~60/80/95% of the
# default fleet's capacity without prefix reuse (rate-scales from
# `tokenfleet simulate --describe-capacity`, no-reuse estimate, of the requests run), and at
# the issue's load point, "-rr75": the rate scale where round robin meets ~75% of SLOs on the
# first 2,000 requests (bench/rr75_search.py; those rows run 2,000 requests unless MAX says).
# Writes one JSON per run to ${OUT:-bench_out}/ and prints the tables.
#   ROWS="azure-conv-80 chat-80" bash bench/routing_tables.sh   # only these rows
#   MAX=3000 ...                                                # only the first N requests of each trace
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out}
TRACES=${TRACES:-traces}
POLICIES=${POLICIES:-round_robin,tokenpilot,sglang_cache_aware,dynamo_kv,llm_d,aibrix_prefix,least_loaded}
MAX=${MAX:-}
ROWS=${ROWS:-}
mkdir -p "$OUT"
# The generators' workloads (seeded: the same bytes every time).
.venv/bin/python - "$OUT/chat.jsonl" "$OUT/agent.jsonl" <<'PY'
import sys
from workloads.generators import agent_loops, chat_sessions
chat_sessions(sessions=1500, rate=3.0, seed=1).to_jsonl(sys.argv[1])
agent_loops(agents=300, rate=0.6, seed=2, prefixes=4).to_jsonl(sys.argv[2])
PY
run() {  # name trace rate-scale [max-requests]
  if [ -n "$ROWS" ] && [[ " $ROWS " != *" $1 "* ]]; then return; fi
  local max=${MAX:-${4:-}}
  echo "== $1 (rate-scale $3${max:+, first $max requests})"
  .venv/bin/tokenfleet simulate --trace "$2" --policy "$POLICIES" --rate-scale "$3" ${max:+--max-requests "$max"} \
    --no-progress --json "$OUT/$1.json" | sed -n '/^policy/,$p'
}
# Mooncake conversation (12,031 requests): 2.60/3.46/4.11
run conversation-60 "$TRACES/conversation_trace.jsonl.gz" 2.60
run conversation-80 "$TRACES/conversation_trace.jsonl.gz" 3.46
run conversation-95 "$TRACES/conversation_trace.jsonl.gz" 4.11
run conversation-rr75 "$TRACES/conversation_trace.jsonl.gz" 2.242 2000  # round robin 75.6%
# Mooncake synthetic (3,993 requests): 2.00/2.66/3.16
run synthetic-60 "$TRACES/synthetic_trace.jsonl" 2.00
run synthetic-80 "$TRACES/synthetic_trace.jsonl" 2.66
run synthetic-95 "$TRACES/synthetic_trace.jsonl" 3.16
run synthetic-rr75 "$TRACES/synthetic_trace.jsonl" 2.199 2000  # round robin 75.2%
# Azure 2023 conversation and code (first 6,000 requests; nothing to reuse): 19.95/26.6/31.59, 24.95/33.27/39.51
run azure-conv-60 "$TRACES/AzureLLMInferenceTrace_conv.csv" 19.95 6000
run azure-conv-80 "$TRACES/AzureLLMInferenceTrace_conv.csv" 26.6 6000
run azure-conv-95 "$TRACES/AzureLLMInferenceTrace_conv.csv" 31.59 6000
run azure-conv-rr75 "$TRACES/AzureLLMInferenceTrace_conv.csv" 35.11 2000  # round robin 75.7%
run azure-code-60 "$TRACES/AzureLLMInferenceTrace_code.csv" 24.95 6000
run azure-code-80 "$TRACES/AzureLLMInferenceTrace_code.csv" 33.27 6000
run azure-code-95 "$TRACES/AzureLLMInferenceTrace_code.csv" 39.51 6000
run azure-code-rr75 "$TRACES/AzureLLMInferenceTrace_code.csv" 6.423 2000  # round robin 76.7%
# Generators: multi-turn chat (5,875 requests) 9.27/12.36/14.68; agent loops (3,722) 2.02/2.70/3.21
run chat-60 "$OUT/chat.jsonl" 9.27
run chat-80 "$OUT/chat.jsonl" 12.36
run chat-95 "$OUT/chat.jsonl" 14.68
run chat-rr75 "$OUT/chat.jsonl" 25.688 2000  # round robin 75.1%
run agent-60 "$OUT/agent.jsonl" 2.02
run agent-80 "$OUT/agent.jsonl" 2.70
run agent-95 "$OUT/agent.jsonl" 3.21
run agent-rr75 "$OUT/agent.jsonl" 4.679 2000  # round robin 76.0%
