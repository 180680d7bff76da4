#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv. Idempotent: it reinstalls only when
# setup.py changed since the last successful set-up. Sourced by demo.sh and test.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RESIL_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.megatron-resil-$(sha1sum "$ROOT/setup.py" | cut -c1-12)"

if [ ! -f "$STAMP" ]; then
  echo "[setup] creating $VENV (torch 2.13.0 CPU build first, then megatron-resil[test])"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
  # torch first and pinned, so no dependency can pull the multi-GB CUDA build on a CPU machine.
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$ROOT[test]"
  rm -f "$VENV"/.megatron-resil-*
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
# NVRx and megatron-core warn on import about pynvml, Apex and TE on CPU hosts: harmless noise.
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
