#!/usr/bin/env bash
# Run the test suite (creates .venv on first use). Extra arguments go to pytest: options, or test paths
# instead of the whole of tests/ (pyproject.toml's testpaths).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
set +e
# Two at a time by default (pytest-xdist, `--dist loadfile`: each file's tests on one worker, so module
# fixtures are built once and a file's tests never meet; tests/conftest.py hands out the longest files
# first; RESIL_TEST_WORKERS=N for N at a time). `-n 0` runs one test at a time; so does `-s` (output shown live) or `--pdb`. The chaos run
# (tests/test_chaos.py, several minutes) runs only when asked for: `-m chaos`.
PARALLEL=(-n "${RESIL_TEST_WORKERS:-2}" --dist loadfile)
SELECT=(-m "not chaos")
for arg in "$@"; do
  case "$arg" in
    -n|-n*|--numprocesses*) PARALLEL=(--dist loadfile) ;;
    -s|--capture=no|--pdb) PARALLEL=() ;;
    -m|-m*) SELECT=() ;;
  esac
done
python -m pytest "${PARALLEL[@]}" "${SELECT[@]}" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then  # pytest: no tests collected
  echo "no tests were collected"
  exit 1
fi
exit "$rc"
