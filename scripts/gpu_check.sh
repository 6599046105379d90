#!/usr/bin/env bash
# One command for a CUDA machine (< 8 min, no network): kernel parity tests, attention timings,
# engine end to end with synthetic acceptance. `--cpu` runs a dry version on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
if [ "${1:-}" = "--cpu" ]; then export TRITON_INTERPRET=1; fi
exec "$PY" scripts/gpu_check.py "$@"
