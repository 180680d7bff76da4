#!/usr/bin/env bash
# The CPU-machine half of the GPU check (issue 25). The GPU machine has Python 3.12 with its own CUDA torch,
# numpy, tensorstore and triton, and no package registry; this downloads the cp312 wheels it lacks into a
# git-ignored folder that is sent along with the run, and scripts/gpu_check.sh installs them there with
# --no-deps beside that torch. Every wheel is named and pinned below: pip resolves nothing.
#
#     bash scripts/fetch_gpu_wheels.sh [DIR]           # download into DIR (default gpu_wheels/), then measure
#     bash scripts/fetch_gpu_wheels.sh --check [DIR]   # only measure DIR
#
# What travels with a run is at most 64 MiB (GPU_CARRY_BUDGET_MIB), the working tree included: the folder and
# the tree are measured together, and a folder that does not fit is refused with one line and exit code 2.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHECK_ONLY=0
if [[ "${1:-}" == "--check" ]]; then CHECK_ONLY=1; shift; fi
if [[ "${1:-}" == -* ]]; then
    echo "fetch_gpu_wheels.sh: error: unknown option $1 (give --check, a folder, or both)" >&2
    exit 2
fi
DIR="${1:-$ROOT/gpu_wheels}"
BUDGET_MIB="${GPU_CARRY_BUDGET_MIB:-64}"

WHEELS=(
    megatron-core==0.19.2          # the newest megatron-core; 0.17 and later are cp312+ only
    nvidia-resiliency-ext==0.7.0   # NVRx: in-process restart, straggler detection (CUPTI), async checkpointing
    isal==1.9.1                    # our CRC-32 of checkpoint shards
    google-crc32c==1.9.0           # older manifests' CRC32C
    packaging==26.4                # megatron-core's and ours
    # What NVRx 0.7 imports on the paths pretrain.py takes (inprocess, fault_tolerance, its health checks);
    # its other requirements (fastapi, grpcio, pydantic, uvicorn, ...) serve its services, not training.
    pyyaml==6.0.4
    psutil==7.2.2
    defusedxml==0.7.1
    nvidia-ml-py==13.615.71
    httpx==0.28.1
    idna==3.20
)
# The GPU machine's glibc is 2.39 (Ubuntu 24.04's Python 3.12.3); pip takes no "or older" for --platform.
PLATFORMS=()
for tag in manylinux_2_39 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 \
           manylinux_2_12 manylinux2010 manylinux_2_5 manylinux1; do
    PLATFORMS+=(--platform "${tag}_x86_64")
done

if [[ "$CHECK_ONLY" == 0 ]]; then
    PY="${PYTHON:-python3}"
    [[ -z "${PYTHON:-}" && -x "$ROOT/.venv/bin/python" ]] && PY="$ROOT/.venv/bin/python"
    mkdir -p "$DIR"
    "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary :all: \
        --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none "${PLATFORMS[@]}" \
        --dest "$DIR" "${WHEELS[@]}"
fi
if [[ ! -d "$DIR" ]]; then echo "fetch_gpu_wheels.sh: error: $DIR: no such folder" >&2; exit 2; fi

mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
wheels_bytes=$(find "$DIR" -type f -printf '%s\n' | awk '{ s += $1 } END { print s + 0 }')
tree_bytes=0
if git -C "$ROOT" rev-parse --git-dir > /dev/null 2>&1; then  # what the device tool sends: tracked + unignored
    # (du's complaint about a tracked file deleted in the work tree is not ours to stop on)
    tree_bytes=$( (cd "$ROOT" && git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2> /dev/null) \
                  | tail -n 1 | cut -f 1 || true)
fi
ls -l "$DIR" | awk 'NR > 1 { printf "  %9d  %s\n", $5, $9 }'
total=$((wheels_bytes + tree_bytes))
echo "$DIR: $(mib "$wheels_bytes") MiB in $(find "$DIR" -name '*.whl' | wc -l) wheels; with the working tree" \
     "($(mib "$tree_bytes") MiB) $(mib "$total") MiB of the $BUDGET_MIB MiB that travel with a run"
if (( total > BUDGET_MIB * 1048576 )); then
    echo "fetch_gpu_wheels.sh: error: $DIR and the working tree come to $(mib "$total") MiB, over the" \
         "$BUDGET_MIB MiB that travel with a run (GPU_CARRY_BUDGET_MIB): remove wheels that are not needed" >&2
    exit 2
fi
