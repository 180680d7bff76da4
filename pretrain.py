"""Pretrain a megatron-core GPT with crash-safe checkpoints. Launch with torchrun (see README)."""

import sys

from megatron_resil.arguments import parse_args


def main() -> int:
    args = parse_args()
    from megatron_resil.training import pretrain  # heavy imports only after the arguments are good

    return pretrain(args)


if __name__ == "__main__":  # dist_checkpointing's multiprocessing Manager re-imports this module
    sys.exit(main())
