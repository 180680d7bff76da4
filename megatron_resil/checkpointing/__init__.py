"""Checkpoints that never lie.

A tier (`tier.CheckpointTier`) owns one place checkpoints live and one format; `loader` picks among
the candidates of all tiers, verifying before it trusts and agreeing across ranks; `manager` is the
handful of calls the training loop makes. `atomic`, `layout`, `tracker` and `manifest` are the
crash-safety primitives every tier shares.

This is the package's face: what the trainer and the tools use, by name, each from the module that owns
it. A name is imported on first use, so importing the package (or one of its light modules, such as
`atomic`) imports nothing else: pretrain.py reads --use-checkpoint-args' checkpoint through it before the
patches that must precede megatron-core are installed, and the async-save worker imports only its own
module.
"""

from __future__ import annotations

import importlib

# name -> (its module in this package, its name there)
_FACE = {
    # the trainer
    "CheckpointConfig": ("manager", "CheckpointConfig"),
    "CheckpointManager": ("manager", "CheckpointManager"),
    "CheckpointSaveError": ("tier", "CheckpointSaveError"),
    "lock_run_directories": ("dir_lock", "lock_run_directories"),
    "record_takeovers": ("dir_lock", "record_takeovers"),
    "take_from_checkpoint": ("saved_args", "take_from_checkpoint"),
    "check_ranks_agree": ("saved_args", "check_ranks_agree"),
    # the tools: the tiers and their candidates, and what a checkpoint directory holds
    "GlobalTier": ("global_tier", "GlobalTier"),
    "TierCandidate": ("tier", "TierCandidate"),
    "CheckpointDataError": ("tier", "CheckpointDataError"),
    "newest_first": ("loader", "newest_first"),
    "read_tracker": ("tracker", "read_tracker"),
    "published_iterations": ("layout", "published_iterations"),
    "iteration_dir": ("layout", "iteration_dir"),
    "quarantined": ("layout", "quarantined"),
    "leftovers": ("layout", "leftovers"),
    "read_manifest": ("manifest", "read_manifest"),
    "has_manifest": ("manifest", "has_manifest"),
    "has_integrity_manifest": ("megatron_integrity", "has_integrity_manifest"),
    "is_torch_checkpoint": ("torch_format", "is_torch_checkpoint"),
    "tree_size": ("untrusted", "tree_size"),
    "read_untrusted_text": ("untrusted", "read_text"),
    "inspect_local_copies": ("local_tier", "inspect_copies"),
    "local_iteration_path": ("local_tier", "describe"),
    "LOCAL_QUARANTINE_DIR": ("local_tier", "QUARANTINE_DIR"),
}

__all__ = sorted(_FACE)


def __getattr__(name: str):
    if name not in _FACE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _FACE[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), attribute)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_FACE))
