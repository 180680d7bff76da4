# shellcheck shell=bash
# The launch logic shared by the Slurm script (pretrain.sbatch) and the local launcher (run_local.sh):
# check the arguments, run one job step under ft_launcher with the preemption signal forwarded, and
# decide from the run's event log whether to requeue or stop. Sourced, not run.
#
# Inputs (environment): RESIL_PYTHON (python with megatron-resil), RESIL_ROOT (this checkout),
# NNODES, NPROC_PER_NODE, RDZV_HOST, RDZV_PORT, NODE_RANK_ARGS (extra launcher flags per node),
# MAX_RESTARTS (in-job restarts by ft_launcher, default 2), FT_LAUNCHER_ARGS (extra ft_launcher flags;
# e.g. "--rdzv-conf keep_alive_interval=2,keep_alive_max_attempt=3": docs/drills.md, "The rendezvous
# keep-alive").

: "${MAX_RESTARTS:=2}"

resil_log() { echo "[resil-launch] $(date '+%Y-%m-%d %H:%M:%S') $*"; }

# The value of --save in the pretrain.py arguments (the event log lives there), or empty.
resil_save_dir() {
  local prev=""
  for arg in "$@"; do
    if [ "$prev" = "--save" ]; then echo "$arg"; return; fi
    case "$arg" in --save=*) echo "${arg#--save=}"; return ;; esac
    prev="$arg"
  done
}

# One clear line, exit 2, when RESIL_PYTHON cannot run the project (no venv, wrong interpreter), instead
# of an ImportError that the argument check below would report as bad arguments.
resil_check_python() {
  local find='import importlib.util as u, sys
sys.exit(any(u.find_spec(m) is None for m in ("torch", "megatron.core", "nvidia_resiliency_ext", "megatron_resil")))'
  if ! (cd "$RESIL_ROOT" && "$RESIL_PYTHON" -c "$find") 2>/dev/null; then
    echo "$RESIL_SCRIPT: RESIL_PYTHON=$RESIL_PYTHON cannot import torch, megatron-core, nvidia-resiliency-ext" \
      "and megatron_resil: run 'bash scripts/setup_env.sh' in $RESIL_ROOT, or export RESIL_PYTHON=<that python>" >&2
    return 2
  fi
}

# Bad arguments end here with exit code 2, before any allocation time or restart is spent on them.
# (ft_launcher provides what --enable-ft-package needs; --check-args-only takes that as given.)
resil_check_args() {
  WORLD_SIZE=$((NNODES * NPROC_PER_NODE)) "$RESIL_PYTHON" "$RESIL_ROOT/pretrain.py" --check-args-only "$@"
}

# The ft_launcher command of one node (without the pretrain.py arguments). RESIL_STANDBY=1: each node's
# launcher starts with a standby that has torch, and megatron-core with the run's patches, imported, and
# its ranks, first and restarted, are forked from it (docs/standby.md); RESIL_STANDBY=torch: torch only.
# megatron_resil.launch.ft_launcher is NVRx's launcher, run unchanged, that also reads torch's keep-alive keys
# from --rdzv-conf (NVRx 0.4.1 hard-codes 5 s x 3); without them, NVRx's defaults.
# They are left to FT_LAUNCHER_ARGS: on a real cluster a shorter keep-alive also drops live nodes whose
# launcher is late with a heartbeat (a loaded host, a busy store), and each heartbeat rewrites the
# rendezvous state in the store, so the default stays NVRx's.
resil_launcher_cmd() {
  RESIL_LAUNCHER=()
  [ "${RESIL_STANDBY:-0}" = 1 ] && RESIL_LAUNCHER=("$RESIL_PYTHON" -m megatron_resil.launch.standby --)
  [ "${RESIL_STANDBY:-0}" = torch ] && RESIL_LAUNCHER=("$RESIL_PYTHON" -m megatron_resil.launch.standby --torch-only --)
  RESIL_LAUNCHER+=("$RESIL_PYTHON" -m megatron_resil.launch.ft_launcher
    --rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:$RDZV_PORT"
    --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" --max-restarts "$MAX_RESTARTS"
    --ft-enable-nic-monitor false ${FT_LAUNCHER_ARGS:-})
}

# How a SIGTERM to the script reaches the job step's launchers (pid of the step in $1). Locally: a kill.
# The Slurm script replaces this: srun answers a SIGTERM by killing its tasks.
resil_forward_term() {
  resil_log "SIGTERM: forwarding to the job step (pid $1)"
  kill -TERM "$1" 2>/dev/null
}

# Run one job step in the background ("$@": the full command) and wait for it, forwarding SIGTERM
# (Slurm's --signal=B:SIGTERM@grace, or the local launcher's preemption) to it; its pretrain.py
# ranks then save and exit 5. Sets RESIL_STEP_CODE.
resil_run_step() {
  "$@" &
  local child=$!
  trap 'resil_forward_term '"$child" TERM
  # One that came between the script's early trap and this one is passed on now.
  [ -n "${RESIL_EARLY_TERM:-}" ] && resil_forward_term "$child"
  # `wait` returns early when a trapped signal arrives: wait again until the step has really ended.
  while true; do
    wait "$child"
    RESIL_STEP_CODE=$?
    kill -0 "$child" 2>/dev/null || break
  done
  trap - TERM
}

# "requeue: ..." or "stop: ..." for the step that started at unix time $1 and ended with code $2.
resil_decide() {
  "$RESIL_PYTHON" -m megatron_resil.tools.requeue "$RESIL_SAVE_DIR" --since "$1" --launcher-exit-code "$2"
}
