#!/usr/bin/env bash
# Sourced by scripts/test.sh and scripts/test_lane2.sh: run_pytest SELECTION [pytest arguments...] runs
# pytest with the tests marked SELECTION, test files N at a time, and exits with its code (1, not pytest's
# 5, when no test was collected).
#
# N files at a time (pytest-xdist, `--dist loadfile`: each file's tests on one worker, so module fixtures
# are built once and a file's tests never meet; tests/conftest.py hands out the longest files first):
# RESIL_TEST_WORKERS, 3 by default (on 2 cores: the Slurm, signal and timeout tests wait on clocks, and a
# third file fills that idle CPU: 845 s against about 930 s two at a time, 2026-11-26). `-n 0` runs one
# test at a time; so do `-s` (output shown live) and `--pdb`. A `-m` given replaces SELECTION.
run_pytest() {
  local selection="$1"
  shift
  local parallel=(-n "${RESIL_TEST_WORKERS:-3}" --dist loadfile)
  local select=(-m "$selection")
  local arg
  for arg in "$@"; do
    case "$arg" in
      -n|-n*|--numprocesses*) parallel=(--dist loadfile) ;;
      -s|--capture=no|--pdb) parallel=() ;;
      -m|-m*) select=() ;;
    esac
  done
  set +e
  python -m pytest "${parallel[@]}" "${select[@]}" "$@"
  local rc=$?
  set -e
  if [ "$rc" -eq 5 ]; then  # pytest: no tests collected
    echo "no tests were collected"
    exit 1
  fi
  exit "$rc"
}
