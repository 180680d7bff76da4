"""--use-checkpoint-args: the model arguments a checkpoint saved, read before the command line is checked.
arguments/__init__.parse_args calls `take_from_checkpoint` between parsing and validation (pretrain.py
hands it over), as Megatron-LM's initialize_megatron calls load_args_from_checkpoint between its
parse_args and validate_args; which arguments are copied, and how, is arguments/checkpoint_args.py's.

The checkpoint is the one the loader would take (its tracker's, else the newest that passes verification),
read through safe_load. torch.distributed has not started yet, so every rank reads it itself;
`check_ranks_agree` confirms, once it has, that they all took the same. The saved arguments are untrusted
data: besides the checks of each value (arguments/checkpoint_args.py), the model they describe must fit in
what the checkpoint records of its tensors (recorded_size.py), checked before anything is allocated.
"""

from __future__ import annotations

import argparse
import os

from megatron_resil import events
from megatron_resil.arguments import checkpoint_args, sizes
from megatron_resil.arguments.errors import ArgumentError


def take_from_checkpoint(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """With --use-checkpoint-args, the saved model arguments into `args`, each said in Megatron-LM's line.
    Reads the checkpoint (megatron-core is imported, the patches installed first); raises ArgumentError."""
    if not checkpoint_args.wanted(args):
        return
    from megatron_resil import patches

    patches.install(args)  # before megatron-core is imported; a second install() adds nothing
    found = _saved_args(args)
    if found is None:
        events.print_rank_0("Checkpoint not found to provide arguments, using provided arguments.")
        checkpoint_args.say_missing_sizes(args, f"no checkpoint under --load {args.load}")
        return
    path, where, saved = found
    if not saved:
        events.print_rank_0("Checkpoint provided does not have arguments saved, using provided arguments.")
        checkpoint_args.say_missing_sizes(args, f"{where} has no saved arguments")
        return
    changed = checkpoint_args.merge(args, saved, parser, where)
    _check_recorded_size(args, path, where)
    events.print_rank_0(f"[resil] checkpoint args: model arguments from {where} (--use-checkpoint-args); "
                        + (f"replaced: {', '.join(changed)}" if changed else "none differs from the command "
                           "line's"))


def _saved_args(args: argparse.Namespace) -> tuple[str, str, dict] | None:
    """(its path, where, the saved arguments as a dict) of the candidate the loader would take first: newest
    first across --load and a global non-persistent directory, each passing the loader's verification
    (sizes, not checksums: every rank reads this itself), or None when none does."""
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_resil.checkpointing.global_tier import GlobalTier
    from megatron_resil.checkpointing.loader import newest_first

    tiers = [GlobalTier(args.load, verify_checksums=False, verify_integrity=args.verify_integrity)]
    non_persistent = args.non_persistent_global_ckpt_dir or \
        (args.save and os.path.join(args.save, "non_persistent"))
    if args.non_persistent_ckpt_type == "global" and non_persistent:
        tiers.append(GlobalTier(non_persistent, name="non-persistent", verify_checksums=False,
                                verify_integrity=args.verify_integrity))
    for tier, candidate in newest_first(tiers):
        where = f"{candidate.path} (iteration {candidate.iteration})"
        try:
            reason = tier.verify(candidate)
            saved = None if reason else tier.saved_args(candidate)
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP's is a BaseException
            reason = f"unreadable ({type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]})"
        if reason is not None:
            events.print_rank_0(f"[resil] checkpoint args: passed over {where}: {reason}")
            continue
        if isinstance(saved, argparse.Namespace):
            saved = vars(saved)
        if not isinstance(saved, dict) and saved is not None:  # Megatron-LM saves a Namespace
            raise ArgumentError(f"{where} holds saved arguments that are {checkpoint_args.shown(saved)}, not "
                                "the Namespace Megatron-LM saves; drop --use-checkpoint-args")
        return candidate.path, where, dict(saved or {})
    return None


def _check_recorded_size(args: argparse.Namespace, path: str, where: str) -> None:
    """Refuses, before anything is allocated, arguments describing a model larger than the checkpoint's own
    record of its tensors: a checkpoint cannot hold it, whatever its saved arguments say."""
    from megatron_resil.checkpointing import recorded_size
    from megatron_resil.checkpointing.tier import CheckpointDataError

    parts = sizes.least_parameters(args)
    least = sum(count for count, _ in parts)
    if not least:
        return
    try:
        recorded, what = recorded_size.recorded_elements(path)
    except (OSError, CheckpointDataError) as err:
        raise ArgumentError(f"{where}: its record of its tensors is unreadable ({type(err).__name__}: "
                            f"{(str(err).splitlines() or [''])[0][:200]}), so its model arguments cannot be "
                            "checked; drop --use-checkpoint-args") from None
    if least > recorded:
        count, part = max(parts)
        raise ArgumentError(f"{where}: the model arguments taken from it (with the command line's) describe "
                            f"at least {least:,} parameters ({part}: {count:,}), but {what}; refused before "
                            "building the model: drop --use-checkpoint-args")


def check_ranks_agree(args: argparse.Namespace) -> None:
    """Collective, once torch.distributed is up: every rank read the checkpoint's arguments itself, so a
    checkpoint replaced between their reads would build different models. Raises SystemExit(1) (a requeue
    reads it again) after one line."""
    from megatron_resil import parallel

    mine = checkpoint_args.copied_values(args)
    everyone = parallel.all_gather_object(mine)
    differ = sorted({name for theirs in everyone for name in mine if theirs[name] != mine[name]})
    if differ:
        events.decision("exit", f"--use-checkpoint-args: the ranks read different model arguments under "
                        f"--load {args.load} ({', '.join(differ)}): it changed while they started; exiting "
                        "with code 1", exit_code=1)
        raise SystemExit(1)
