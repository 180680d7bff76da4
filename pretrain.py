"""Pretrain a megatron-core GPT with crash-safe checkpoints. Launch with torchrun (see README)."""

import os
import sys

from megatron_resil import phase_marks, process_exit
from megatron_resil.launch import standby

phase_marks.interpreter_started()  # first: when the interpreter reached our code
standby.set_import_time_defaults(sys.argv[1:], os.environ)  # before torch: its C++ log level, for one
if __name__ == "__main__":  # not in a spawned helper that imports this module
    standby.hand_over()  # with MEGATRON_RESIL_STANDBY: this process only mirrors a worker forked from it

from megatron_resil.arguments import parse_args  # noqa: E402 - after the log level above
from megatron_resil.checkpointing import take_from_checkpoint  # noqa: E402


def main() -> int:
    args = parse_args(saved_args=take_from_checkpoint)  # --use-checkpoint-args between parsing and checks
    if args.check_args_only:
        print("pretrain.py: arguments are valid")
        return 0
    from megatron_resil import patches

    patches.install(args)  # before megatron-core is imported; a mismatch exits 2 with one line
    from megatron_resil.training import pretrain  # heavy imports only after the arguments are good

    if args.inprocess_restart:  # NVRx's inprocess is imported only then
        from megatron_resil.resilience import inprocess_restart

        return inprocess_restart.run(pretrain, args)
    return pretrain(args)


if __name__ == "__main__":  # a spawned helper (async save's Manager) re-imports this module: keep it light
    process_exit.run(main)
