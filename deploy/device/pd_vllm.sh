#!/usr/bin/env bash
# Real vLLM prefill/decode disaggregation (NixlConnector) behind the TokenFleet gateway, on one
# GPU machine (an H200 when one is lent; issue 17). NOT RUN YET: no GPU machine has been lent to
# this work, and NixlConnector needs GPUs and the NIXL library (vLLM's CPU backend cannot run it).
#
#   deploy/device/pd_vllm.sh MODEL_DIR [OUT_DIR]
#
# MODEL_DIR: a local model (nothing is downloaded; the device machine reaches no network).
# Needs: python with vllm (CUDA build) and nixl importable (VLLM_PYTHON, default python3), and
# this repository's venv (.venv) for the gateway. It starts a prefill engine (kv_producer) and a
# decode engine (kv_consumer) on GPU 0, 40% of its memory each, attaches the gateway to them with
# a P/D fleet file (adapter vllm, roles {prefill: 1, decode: 1}), sends a long prompt and a short
# one, and writes the gateway's decision log, metrics and both answers to OUT_DIR.
set -euo pipefail
MODEL_DIR=${1:?usage: pd_vllm.sh MODEL_DIR [OUT_DIR]}
OUT=${2:-${OUT:-/tmp/pd_vllm_out}}
VLLM_PYTHON=${VLLM_PYTHON:-python3}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$OUT"
P_PORT=8301 D_PORT=8302 GW_PORT=8300
"$VLLM_PYTHON" -c "import vllm, nixl" || { echo "vllm and nixl must be importable by $VLLM_PYTHON" >&2; exit 2; }

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait || true; }
trap cleanup EXIT

engine() {  # PORT KV_ROLE SIDE_CHANNEL_PORT
  CUDA_VISIBLE_DEVICES=0 VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_PORT=$3 \
    "$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" --served-model-name pd-model \
    --host 127.0.0.1 --port "$1" --gpu-memory-utilization 0.4 --enable-prefix-caching \
    --enable-prompt-tokens-details --max-model-len 16384 --block-size 16 \
    --kv-transfer-config "{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"$2\"}" \
    > "$OUT/engine-$1.log" 2>&1 &
  pids+=($!)
}
engine $P_PORT kv_producer 5600
engine $D_PORT kv_consumer 5601
for port in $P_PORT $D_PORT; do
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
  curl -sf "http://127.0.0.1:$port/health" >/dev/null || { echo "engine on $port not healthy" >&2; exit 1; }
done

cat > "$OUT/fleet.yaml" <<YAML
regions: [local]
default_region: local
sites:
  - {name: gpu, region: local, jurisdiction: lab, rtt_ms: {local: 0}, interconnect: {bandwidth_gb_s: 50, latency_ms: 0.01}}
models:
  - name: pd-model
    engine: {spec: llama-3.1-8b, max_model_len: 16384, block_size: 16}
deployments:
  - {site: gpu, model: pd-model, adapter: vllm, gpu: H200, roles: {prefill: 1, decode: 1},
     options: {urls: ["http://127.0.0.1:$P_PORT", "http://127.0.0.1:$D_PORT"]}}
tenants:
  - {name: lab, api_keys: [sk-pd-device], region: local}
YAML
"$REPO/.venv/bin/tokenfleet" up --fleet "$OUT/fleet.yaml" --port $GW_PORT > "$OUT/gateway.log" 2>&1 &
pids+=($!)
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$GW_PORT/health" >/dev/null && break; sleep 1; done

LONG=$(python3 -c "print(' '.join(f'device{i}' for i in range(6000)))")
ask() {  # NAME PROMPT MAX_TOKENS
  curl -s -m 120 "http://127.0.0.1:$GW_PORT/v1/completions" -H 'Authorization: Bearer sk-pd-device' \
    -H 'Content-Type: application/json' -H "X-Request-Id: $1" -D "$OUT/$1.headers" \
    -d "{\"model\":\"pd-model\",\"prompt\":\"$2\",\"max_tokens\":$3}" > "$OUT/$1.json"
}
ask pd-long "$LONG" 64
ask pd-short "Hello, fleet!" 16
curl -s "http://127.0.0.1:$GW_PORT/debug/decisions" -H 'Authorization: Bearer sk-pd-device' > "$OUT/decisions.json"
curl -s "http://127.0.0.1:$GW_PORT/metrics" > "$OUT/metrics.txt"
grep tokenfleet_pd_legs_total "$OUT/metrics.txt" || true
echo "results in $OUT"
