"""Process exit codes of pretrain.py, the one table launch scripts act on (docs/exit_codes.md)."""

FINISHED = 0  # training reached --train-iters, or a requested stop (--exit-interval, duration) saved
BAD_ARGUMENTS = 2  # the command line (or the installed megatron-core, torch, NVRx) is wrong; do not requeue
NO_CHECKPOINT = 3  # --exit-on-missing-checkpoint and nothing loadable under --load; do not requeue
SAVE_FAILED = 4  # a checkpoint could not be written (I/O error); the previous one is intact
SIGNAL_SAVED = 5  # --exit-signal arrived; a checkpoint was saved; requeue to continue
SIGNAL_DEADLINE = 6  # --exit-signal arrived but the save missed --exit-signal-grace-secs; previous one intact
UNRECOVERABLE = 8  # a fault reproduced after bounded retries and fallbacks; do not requeue
LAUNCHER_GONE = 9  # the rank's launcher died (SIGKILL, OOM); the rank stopped without saving; requeue
# --inprocess-restart lost a rank's process with no warm reserve left to take its place: nothing is wrong
# with the state, only too few processes are left; the launcher's in-job restart (or a requeue) goes on
RESERVES_USED_UP = 10
RERUN_RESUME = 16  # megatron-core's rerun state machine: resume from the checkpoint to disambiguate
RERUN_FAILED_VALIDATION = 17  # megatron-core's rerun state machine: the result failed validation

# The same command would fail the same way: launch scripts stop instead of requeueing, and under ft_launcher
# the ranks ask it not to restart them (NVRx's ShutdownWorkload). Most 2s are caught before any rank
# starts; a schedule that differs from the loaded checkpoint's is found at load, on every rank alike.
DO_NOT_RETRY = frozenset({BAD_ARGUMENTS, NO_CHECKPOINT, UNRECOVERABLE, RERUN_FAILED_VALIDATION})
