"""What a checkpoint holds of megatron-core's rerun state machine (Megatron-LM's key `rerun_state_machine`):
its state, saved only while a rerun is pending (the checkpoints written for exit 16 or 17), and on load the
rerun the saving job asked for, continued. The machine itself, and what it decides, is
resilience/rerun.py's.
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core.rerun_state_machine import RerunMode, RerunState, get_rerun_state_machine

from megatron_resil import events, parallel


def checkpoint_state() -> dict | None:
    """The machine's state under Megatron's key `rerun_state_machine`: None unless a rerun is pending (only
    the checkpoints saved for exit 16 or 17 hold one). Collective then (every rank is in that state)."""
    machine = get_rerun_state_machine()
    if machine.state == RerunState.NOT_RUNNING_YET:
        return None
    state = machine.state_dict(data_iterator=None, ckpt_format="torch_dist", force=True)
    # Megatron-LM keeps each rank's part in a ShardedObject ("sharded"), which it loads with a template it
    # builds after reading common.pt. Our loader builds one template before it knows which candidate it
    # loads, so every rank's part is also copied into common.pt, which always comes back whole.
    state["per_rank"] = parallel.all_gather_object(state["sharded"].data)
    return state


def restore_state(saved: dict | None) -> None:
    """On load: continue the rerun the saving job asked for (exit 16). Megatron's validate_state_dict: a
    checkpoint without a pending rerun holds None (or NOT_RUNNING_YET) and restores nothing."""
    if not saved or saved.get("state") in (None, RerunState.NOT_RUNNING_YET):
        return
    machine = get_rerun_state_machine()
    iteration = saved.get("current_iteration")
    if saved["state"] != RerunState.WILL_RERUN_FROM_CHECKPOINT:
        # Saved for examination after exit 17. megatron-core cannot resume in that state (it would restore
        # RNG states it no longer has and raise): the step is simply run again.
        events.decision("rerun", f"the checkpoint was saved after iteration {iteration} failed validation "
                        f"(exit code 17, machine state {saved['state'].name}); resuming it as a plain "
                        "checkpoint: that step runs afresh", iteration=iteration)
        return
    world = dist.get_world_size() if dist.is_initialized() else 1
    per_rank = saved.get("per_rank")
    if per_rank is None or len(per_rank) != world:
        why = "Megatron-LM saved it (each rank's part is only in its ShardedObject)" if per_rank is None \
            else f"it was saved by {len(per_rank)} ranks and this job has {world}"
        events.decision("rerun", f"the checkpoint asks to rerun iteration {iteration}, but {why}: the "
                        "pending rerun is dropped, that step runs afresh", iteration=iteration)
        return
    if machine.mode == RerunMode.DISABLED:
        events.decision("rerun", f"--rerun-mode disabled: the checkpoint's pending rerun of iteration "
                        f"{iteration} is dropped, that step runs afresh", iteration=iteration)
        return
    machine.load_state_dict({**saved, "sharded": per_rank[parallel.rank()]})
    events.decision("rerun", f"resuming the rerun of iteration {iteration} that the previous job asked for "
                    "(exit code 16): a rerun on another node or device settles it", iteration=iteration)
