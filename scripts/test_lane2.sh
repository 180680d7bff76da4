#!/usr/bin/env bash
# The second lane's compat tier: Python 3.12 + megatron-core 0.19 + NVRx 0.7 (the stack our users run),
# this checkout through PYTHONPATH, the venv from scripts/setup_lane2.sh (built once per machine).
# What runs: the fast tier and the tests marked `compat` (exact resume on DP, TP, PP and EP, the tiers
# and their fallback, crash consistency, a Slurm job, a resume across the two lanes). Extra arguments go
# to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_lane2.sh"
cd "$ROOT"
set +e
PARALLEL=(-n "${RESIL_TEST_WORKERS:-2}" --dist loadfile)
SELECT=(-m "(not slow or compat) and not chaos")
for arg in "$@"; do
  case "$arg" in
    -n|-n*|--numprocesses*) PARALLEL=(--dist loadfile) ;;
    -s|--capture=no|--pdb) PARALLEL=() ;;
    -m|-m*) SELECT=() ;;
  esac
done
# -p no:cacheprovider: the first lane's pytest owns .pytest_cache in this checkout.
python -m pytest -p no:cacheprovider "${PARALLEL[@]}" "${SELECT[@]}" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then  # pytest: no tests collected
  echo "no tests were collected"
  exit 1
fi
exit "$rc"
