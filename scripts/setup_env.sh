#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv. Idempotent: it reinstalls only when
# setup.py changed since the last successful set-up. Sourced by demo.sh and test.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RESIL_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
CONSTRAINTS="$ROOT/scripts/constraints.txt"  # the versions CI tests; setup.py itself states ranges
STAMP="$VENV/.megatron-resil-$(cat "$ROOT/setup.py" "$CONSTRAINTS" | sha1sum | cut -c1-12)"

# Chained with && because errexit does not apply inside a function whose status is tested.
install() {
  local pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -c "$CONSTRAINTS")
  { [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"; } &&
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip &&
    # torch first (its CPU build, as constrained), so no dependency can pull the multi-GB CUDA build.
    "${pip[@]}" torch &&
    "${pip[@]}" -e "$ROOT[test]"
}

if [ ! -f "$STAMP" ]; then
  echo "[setup] creating $VENV (torch 2.13.0 CPU build first, then megatron-resil[test]) ..."
  LOG="$(mktemp -t megatron-resil-setup.XXXXXX.log)"
  if ! install > "$LOG" 2>&1; then
    echo "[setup] failed; the last lines of $LOG:" >&2
    tail -n 30 "$LOG" >&2
    exit 1
  fi
  rm -f "$VENV"/.megatron-resil-* "$LOG"
  touch "$STAMP"
  echo "[setup] done"
fi
export PATH="$VENV/bin:$PATH"
# NVRx and megatron-core warn on import about pynvml, Apex and TE on CPU hosts: harmless noise.
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
