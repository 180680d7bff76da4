#!/usr/bin/env bash
# Run the test suite (creates .venv on first use). Extra arguments go to pytest: options, or test paths
# instead of the whole of tests/ (pyproject.toml's testpaths). Three test files at a time by default
# (scripts/run_pytest.sh). The chaos run (tests/test_chaos.py, several minutes) runs only when asked
# for: `-m chaos`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
source "$ROOT/scripts/run_pytest.sh"
cd "$ROOT"
run_pytest "not chaos" "$@"
