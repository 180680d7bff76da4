#!/usr/bin/env bash
# The Slurm script's logic (scripts/pretrain.sbatch) on one machine, without Slurm: check the
# arguments, run the job step under ft_launcher on loopback, and after it ends requeue (run it again,
# resuming from the tracker) or stop, as the run's exit record says. SIGTERM to this script acts as
# Slurm's `--signal=B:SIGTERM@<grace>` does for the batch script: it is forwarded to the job step, whose
# ranks save and exit 5 (with --exit-signal-handler), and the job is requeued.
#
# Usage: [NPROC_PER_NODE=2] [MAX_REQUEUES=3] [MAX_RESTARTS=2] [RESIL_STANDBY=1] scripts/run_local.sh <flags>
# (RESIL_STANDBY=1: one standby for the run, kept across requeues; see below)
# (--save DIR is required: the requeue decision reads DIR/events.jsonl). Exit code: the run's own
# (0 finished; see docs/exit_codes.md), or 1 when MAX_REQUEUES ran out.
set -uo pipefail
RESIL_SCRIPT=run_local.sh
RESIL_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${RESIL_PYTHON:-}" ]; then
  RESIL_PYTHON="$RESIL_ROOT/.venv/bin/python"
  [ -x "$RESIL_PYTHON" ] || RESIL_PYTHON=python3
fi
# shellcheck source=scripts/resil_launch.sh
source "$RESIL_ROOT/scripts/resil_launch.sh"

NNODES=1
NPROC_PER_NODE="${NPROC_PER_NODE:-2}"
MAX_REQUEUES="${MAX_REQUEUES:-3}"
RDZV_HOST=127.0.0.1
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}" MASTER_ADDR=127.0.0.1
FT_LAUNCHER_ARGS="--local-addr 127.0.0.1 --rdzv-id local ${FT_LAUNCHER_ARGS:-}"

RESIL_SAVE_DIR="$(resil_save_dir "$@")"
if [ -z "$RESIL_SAVE_DIR" ]; then
  echo "$RESIL_SCRIPT: pass --save DIR: the requeue decision reads the run's DIR/events.jsonl" >&2
  exit 2
fi
if [ -z "${RESIL_STANDBY_ACROSS_STEPS:-}" ]; then
  resil_check_python || exit 2
  resil_check_args "$@" >/dev/null || exit 2
fi
# RESIL_STANDBY=1 (or torch): one standby for the whole run, kept across its requeues, where each job step's
# launcher hands its ranks: on one machine a requeue runs on the same host, so a new job step's ranks are
# forked with torch and megatron-core imported already (docs/standby.md, "Across job steps"). This script
# runs again under it (exec: the same process), as the standby's parent: the standby ends after it. There
# RESIL_STANDBY is cleared, so that no job step's launcher starts a standby of its own (resil_launch.sh).
if [[ "${RESIL_STANDBY:-0}" =~ ^(1|torch)$ ]] && [ -z "${RESIL_STANDBY_ACROSS_STEPS:-}" ]; then
  standby_args=(--name run-local --ranks-per-node "$NPROC_PER_NODE")
  [ "$RESIL_STANDBY" = torch ] && standby_args+=(--torch-only)
  RESIL_STANDBY= RESIL_STANDBY_ACROSS_STEPS=1 exec "$RESIL_PYTHON" -m megatron_resil.launch.standby \
    "${standby_args[@]}" -- bash "$RESIL_ROOT/scripts/run_local.sh" "$@"
fi

for ((requeue = 0; ; requeue++)); do
  # A fresh port per attempt: the previous step's store may still hold the old one for a while. Drawn
  # below the ephemeral range, where no outgoing connection can take it first (launch/ports.py).
  RDZV_PORT="$(PYTHONPATH="$RESIL_ROOT${PYTHONPATH:+:$PYTHONPATH}" "$RESIL_PYTHON" -m megatron_resil.launch.ports)" || exit 1
  resil_launcher_cmd
  since="$(date +%s.%N)"
  resil_log "attempt $((requeue + 1)) (requeue $requeue of at most $MAX_REQUEUES): $NPROC_PER_NODE ranks, rendezvous on $RDZV_HOST:$RDZV_PORT, in-job restarts up to $MAX_RESTARTS"
  resil_run_step "${RESIL_LAUNCHER[@]}" "$RESIL_ROOT/pretrain.py" "$@"
  decision="$(resil_decide "$since" "$RESIL_STEP_CODE")"
  resil_log "job step ended (launcher exit code $RESIL_STEP_CODE): $decision"
  read -r verb code _ <<< "$decision"
  code="${code%:}"
  if [ "$verb" != requeue ]; then
    exit "$code"
  fi
  if ((requeue >= MAX_REQUEUES)); then
    resil_log "not requeueing: MAX_REQUEUES=$MAX_REQUEUES reached; stopping with exit code 1"
    exit 1
  fi
  # From the second job step on, the launcher too is forked from the run's standby, which has torch imported
  # by then (NVRx's launcher imports it: about 2 s of a step's start); the first one starts beside the
  # standby's imports, and imports for itself rather than wait for them (docs/standby.md).
  [ -n "${RESIL_STANDBY_ACROSS_STEPS:-}" ] && export MEGATRON_RESIL_LAUNCHER_FROM_STANDBY=1
done
