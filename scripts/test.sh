#!/usr/bin/env bash
# Run the whole test suite (creates .venv on first use). Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
set +e
# One test at a time by default (what CI runs). `-n 2` runs two at a time (pytest-xdist, --dist loadfile:
# each file's tests on one worker, so module fixtures are built once and a file's tests never meet); on two
# cores not yet faster than one at a time, because the longest files run back to back (tests/README.md).
# The chaos run (tests/test_chaos.py, several minutes) runs only when asked for: `-m chaos`.
PARALLEL=()
SELECT=(-m "not chaos")
for arg in "$@"; do
  case "$arg" in
    -n|-n*|--numprocesses*) PARALLEL=(--dist loadfile) ;;
    -m|-m*) SELECT=() ;;
  esac
done
python -m pytest tests "${PARALLEL[@]}" "${SELECT[@]}" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then  # pytest: no tests collected
  echo "no tests were collected"
  exit 1
fi
exit "$rc"
