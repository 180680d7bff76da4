#!/usr/bin/env bash
# The GPU check (issue 25) in one go. On the GPU machine, with gpu_wheels/ sent along (made on the CPU
# machine by scripts/fetch_gpu_wheels.sh):
#     bash scripts/gpu_check.sh "$OUT"              # at most 560 s; installs the wheels beside torch
# On a CPU machine (CI runs this through tests/test_gpu_check.py):
#     bash scripts/gpu_check.sh --dry-run OUT       # every step that needs no CUDA: 1-2 minutes idle
# OUT gets results.json, summary.txt and logs/. Options: python -m megatron_resil.tools.gpu_check --help
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The GPU machine's own Python (its torch); here, the project's virtual environment when there is one.
if [[ -z "${PYTHON:-}" ]]; then
    PYTHON=python3
    [[ -x "$ROOT/.venv/bin/python" ]] && PYTHON="$ROOT/.venv/bin/python"
fi
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" -m megatron_resil.tools.gpu_check "$@"
