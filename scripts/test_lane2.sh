#!/usr/bin/env bash
# The second lane's compat tier: Python 3.12 + megatron-core 0.19 + NVRx 0.7 (the stack our users run),
# this checkout through PYTHONPATH, the venv from scripts/setup_lane2.sh (built once per machine).
# What runs: the fast tier and the tests marked `compat` (exact resume on DP, TP, PP and EP, the tiers
# and their fallback, crash consistency, a Slurm job, a resume across the two lanes). Extra arguments go
# to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_lane2.sh"
source "$ROOT/scripts/run_pytest.sh"
cd "$ROOT"
# -p no:cacheprovider: the first lane's pytest owns .pytest_cache in this checkout.
run_pytest "(not slow or compat) and not chaos" -p no:cacheprovider "$@"
