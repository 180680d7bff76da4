#!/usr/bin/env bash
# Run the whole test suite (creates .venv on first use). Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
set +e
# Two tests at a time (pytest-xdist; tests/conftest.py keeps each file's tests on one worker): most of
# a multi-process test is waiting (start-up, rendezvous, timeouts), so two fit on two cores. `-n 0` (or
# `-p no:xdist`) among the arguments runs them one at a time.
PARALLEL=(-n 2 --dist loadgroup)
for arg in "$@"; do
  case "$arg" in -n|-n*|--numprocesses*|-p) PARALLEL=() ;; esac
done
python -m pytest tests "${PARALLEL[@]}" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then  # pytest: no tests collected
  echo "no tests were collected"
  exit 1
fi
exit "$rc"
