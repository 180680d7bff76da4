"""NVRx (nvidia-resiliency-ext): the private methods of its local checkpoint manager and replication group
that the local tier's subclasses override (checkpointing/local_tier.py, checkpointing/replication.py).
Nothing of NVRx is replaced; a renamed method would leave our override uncalled, silently, so each is
checked, with the call in NVRx that reaches it."""

from __future__ import annotations

import argparse

from megatron_resil.patches import Has, Patch, Says, Takes

PACKAGE = "nvidia-resiliency-ext"
WRITTEN_FOR = ">=0.4.1,<0.8"
_LOCAL = "nvidia_resiliency_ext.checkpointing.local"
_BASE = f"{_LOCAL}.ckpt_managers.base_manager:BaseCheckpointManager"
_MANAGER = f"{_LOCAL}.ckpt_managers.local_manager:LocalCheckpointManager"
_GROUP = f"{_LOCAL}.replication.group_utils:GroupWrapper"
_STATE = f"{_LOCAL}.base_state_dict:TensorAwareStateDict"


def _uses_local_tier(args: argparse.Namespace | None) -> bool:
    return args is None or getattr(args, "non_persistent_ckpt_type", None) == "local"


def _uses_replication(args: argparse.Namespace | None) -> bool:
    return _uses_local_tier(args) and (args is None or bool(getattr(args, "replication", False)))


PATCHES = (
    Patch(
        name="NVRx local checkpointing modules",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=_MANAGER,
        why="the local tier's modules import NVRx's local checkpoint manager, replication strategy and group "
            "wrapper from these paths; every run imports them",
        checks=(
            Has(_MANAGER), Has(f"{_LOCAL}.ckpt_managers.base_manager:CheckpointingException"), Has(_GROUP),
            Has(f"{_LOCAL}.replication.group_utils:parse_group_sequence"),
            Has(f"{_LOCAL}.replication.strategies:CliqueReplicationStrategy"), Has(_STATE),
        ),
    ),
    Patch(
        name="local tier's LocalCheckpointManager subclass",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=_MANAGER,
        why="_VerifiableLocalManager overrides the private _save, _save_fn, _my_ckpt_ids, _cleanup and "
            "_cleanup_failed_save and calls _ensure_dir and _local_ckpt_path_from_id: sealed shards with "
            "manifests, write failures reported collectively, manifests cleaned with their shards",
        checks=(
            Takes(f"{_MANAGER}.__init__", ("self", "root_local_ckpt_dir", "session_id", "repl_strategy")),
            Takes(f"{_MANAGER}._save", ("self", "state_dict", "ckpt_id")),
            Takes(f"{_MANAGER}._save_fn", ("self", "id_to_state_dict")),
            Takes(f"{_MANAGER}._my_ckpt_ids", ("self",)),
            Takes(f"{_MANAGER}._cleanup", ("self", "iteration")),
            Takes(f"{_MANAGER}._cleanup_failed_save", ("self", "iteration")),
            Takes(f"{_MANAGER}._ensure_dir", ("self",)),
            Takes(f"{_MANAGER}._local_ckpt_path_from_id", ("self", "ckpt_id", "is_dirty")),
            Has(f"{_MANAGER}.local_ckpt_dir"),
            Takes(f"{_BASE}.save", ("self", "state_dict", "iteration", "is_async")),
            Says(f"{_BASE}.save", "self._save_fn"),
            Says(f"{_BASE}.save", "self._cleanup(iteration)"),
            Says(f"{_BASE}.save", "self._cleanup_failed_save"),
            Says(f"{_BASE}._save_fn", "self._save(state_dict, ckpt_id)"),
            Says(f"{_BASE}.find_latest", "self._my_ckpt_ids()"),
            Says(f"{_BASE}.__init__", "self.latest_iteration = -1"),
        ),
        when=_uses_local_tier,
    ),
    Patch(
        name="replication group wrapper on gloo",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=f"{_GROUP}.isend_state_dict",
        why="NVRx 0.4.1 sends and receives replicas through .cuda() tensors; _PointToPointGroup overrides "
            "isend_state_dict and irecv_state_dict to send on the process group's device",
        checks=(
            Takes(f"{_GROUP}.isend_state_dict", ("self", "state_dict", "dst")),
            Takes(f"{_GROUP}.irecv_state_dict", ("self", "src")),
            Takes(f"{_GROUP}.send_object", ("self", "obj", "dst")),
            Takes(f"{_GROUP}.recv_object", ("self", "src")),
            Says(_GROUP, "self.isend_state_dict("),
            Says(_GROUP, "self.irecv_state_dict("),
            *(Has(f"{_STATE}.{name}") for name in ("pop_tensors", "insert_tensors", "init_tensors",
                                                   "copy_tensors_to_cpu", "tensors")),
        ),
        when=_uses_replication,
    ),
)
