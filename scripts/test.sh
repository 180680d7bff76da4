#!/usr/bin/env bash
# Run the whole test suite (creates .venv on first use). Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
set +e
python -m pytest tests "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then  # pytest: no tests collected
  echo "no tests were collected"
  exit 1
fi
exit "$rc"
