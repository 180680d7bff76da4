#!/usr/bin/env bash
# Create (or reuse) the second lane's virtual environment: Python 3.12, torch 2.13.0, megatron-core 0.19.2,
# NVRx 0.7.0 and emerging-optimizers 0.3.0 (megatron-core's Muon; Python 3.12 and later only): the stack
# our users run (README, "Support matrix"). Sourced by scripts/test_lane2.sh.
#
# The venv lives outside the checkout (default ~/.cache/megatron-resil/lane2, or RESIL_LANE2_VENV) so that
# fresh clones on one machine share it: its torch is the registry's CUDA build for Python 3.12 (4.7 GB,
# minutes to fetch), built once per machine and per scripts/constraints-lane2.txt. The project itself is
# not installed into it: the lane runs this checkout through PYTHONPATH, so one venv serves every clone.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LANE2_VENV="${RESIL_LANE2_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/megatron-resil/lane2}"
LANE2_CONSTRAINTS="$ROOT/scripts/constraints-lane2.txt"
LANE2_STAMP="$LANE2_VENV/.megatron-resil-$(cat "$LANE2_CONSTRAINTS" "$ROOT/scripts/setup_lane2.sh" | sha1sum | cut -c1-12)"
NVRX_VERSION=0.7.0

# Python 3.12: PYTHON312 if set, else pyenv's newest 3.12, else python3.12 on PATH.
find_python312() {
  if [ -n "${PYTHON312:-}" ]; then echo "$PYTHON312"; return; fi
  local root
  root="$(pyenv root 2>/dev/null || true)"
  if [ -n "$root" ]; then
    local candidate
    candidate="$(ls -d "$root"/versions/3.12.*/bin/python3.12 2>/dev/null | sort -V | tail -n 1 || true)"
    if [ -n "$candidate" ]; then echo "$candidate"; return; fi
  fi
  command -v python3.12 || true
}

# NVRx 0.5-0.7 publish manylinux_2_39 wheels only; pip refuses them on glibc < 2.39. Its one native module
# is the CUPTI straggler extension, which runs on GPU only, so the same wheel under a generic tag serves a
# CPU machine. Chained with && because errexit does not apply inside a function whose status is tested.
install_nvrx() {
  local dir
  dir="$(mktemp -d)" &&
    "$LANE2_VENV/bin/python" -m pip download --quiet --no-deps --only-binary :all: --python-version 3.12 \
      --platform manylinux_2_39_x86_64 -d "$dir" "nvidia-resiliency-ext==$NVRX_VERSION" &&
    local wheel &&
    wheel="$(ls "$dir"/nvidia_resiliency_ext-*.whl)" &&
    mv "$wheel" "${wheel%-manylinux_2_39_x86_64.whl}-linux_x86_64.whl" &&
    "${pip[@]}" "$dir"/nvidia_resiliency_ext-*-linux_x86_64.whl &&
    rm -rf "$dir"
}

install_lane2() {
  local py
  py="$(find_python312)"
  if [ -z "$py" ]; then
    echo "no Python 3.12 found: set PYTHON312 or install it (pyenv install 3.12)" >&2
    return 1
  fi
  pip=("$LANE2_VENV/bin/python" -m pip install --quiet --disable-pip-version-check -c "$LANE2_CONSTRAINTS")
  { [ -x "$LANE2_VENV/bin/python" ] || "$py" -m venv "$LANE2_VENV"; } &&
    "${pip[@]}" torch &&
    "${pip[@]}" wandb &&  # --wandb-project (tests/test_wandb.py)
    install_nvrx &&
    "${pip[@]}" megatron-core emerging-optimizers tensorstore isal google-crc32c numpy packaging matplotlib \
      einops pytest pytest-xdist tensorboard fusepy tokenizers sentencepiece transformers tiktoken nltk &&
    "$LANE2_VENV/bin/python" -m pip check
}

if [ ! -f "$LANE2_STAMP" ]; then
  echo "[setup lane 2] creating $LANE2_VENV (Python 3.12, torch 2.13.0, megatron-core 0.19.2, NVRx $NVRX_VERSION;" \
    "a 4.7 GB torch build, once per machine) ..."
  mkdir -p "$(dirname "$LANE2_VENV")"
  LANE2_LOG="$(mktemp -t megatron-resil-lane2.XXXXXX.log)"
  if ! install_lane2 > "$LANE2_LOG" 2>&1; then
    echo "[setup lane 2] failed; the last lines of $LANE2_LOG:" >&2
    tail -n 30 "$LANE2_LOG" >&2
    exit 1
  fi
  rm -f "$LANE2_VENV"/.megatron-resil-* "$LANE2_LOG"
  touch "$LANE2_STAMP"
  echo "[setup lane 2] done"
fi
export PATH="$LANE2_VENV/bin:$PATH"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
