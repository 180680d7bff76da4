"""Megatron-LM's legacy checkpoint format (--ckpt-format torch): one torch.save file per model-parallel rank.

`iter_<7 digits>/mp_rank_<TP:02d>[_<PP:03d>][_<EP:03d>]/model_optim_rng.pt` (the pipeline part when PP > 1,
the expert part when EP > 1) holds what Megatron-LM's generate_state_dict puts there: args,
checkpoint_version, iteration, model (model0, model1, ... with virtual pipeline stages) as plain state dicts,
the optimizer's state_dict(), opt_param_scheduler, rng_state (a list of one rank's RNG states) and
num_floating_point_operations_so_far. Data-parallel rank 0 of each writes it. Under
--use-distributed-optimizer `distrib_optim.pt` lies beside it: megatron-core's get_parameter_state_dp_zero,
gathered to and written by data-parallel rank 0 (a list of them for a chained optimizer), whatever the
data-parallel size.

Every read is torch.load(weights_only=True) through safe_load's allow-list and untrusted's bounded,
no-link readers; megatron-core's own load_parameter_state (a torch.load of a path, the unpickler left to
torch's default) is never called: the state is read here and handed to its load_parameter_state_from_dp_zero.
A rank's files are read whole into memory, so a training run reads none larger than its model's state can be
(`max_bytes`, from state.max_rank_bytes); a larger one is passed over, not quarantined: it may be a good
checkpoint of a larger model.
"""

from __future__ import annotations

import io
import os
import pickle

import torch
from megatron.core import parallel_state

from megatron_resil import parallel
from megatron_resil.checkpointing import safe_load, untrusted
from megatron_resil.checkpointing.atomic import open_new
from megatron_resil.checkpointing.manifest import checksum_files
from megatron_resil.checkpointing.tier import CheckpointDataError

FORMAT = "torch"
MODEL_FILE = "model_optim_rng.pt"
OPTIMIZER_FILE = "distrib_optim.pt"
# The distributed optimizer's gathered parameter state in the state handed to the tier (saving) or returned
# by it (loading): never written into model_optim_rng.pt.
PARAMETER_STATE = "distrib_optim"
_PREFIX = "mp_rank_"


def rank_dir(tensor_rank: int, pipeline_rank: int | None = None, expert_rank: int | None = None) -> str:
    """Megatron-LM's get_checkpoint_name directory: `pipeline_rank` None without pipeline parallelism,
    `expert_rank` None without expert parallelism."""
    name = f"{_PREFIX}{tensor_rank:02d}"
    if pipeline_rank is not None:
        name += f"_{pipeline_rank:03d}"
    if expert_rank is not None:
        name += f"_{expert_rank:03d}"
    return name


def this_rank_dir() -> str:
    pipeline = parallel_state.get_pipeline_model_parallel_world_size() > 1
    expert = parallel_state.get_expert_model_parallel_world_size() > 1
    return rank_dir(parallel_state.get_tensor_model_parallel_rank(),
                    parallel_state.get_pipeline_model_parallel_rank() if pipeline else None,
                    parallel_state.get_expert_model_parallel_rank() if expert else None)


def is_torch_checkpoint(path: str) -> bool:
    """Megatron-LM's test (_get_checkpoint_format): an entry named mp_rank_0*."""
    try:
        return any(name.startswith(f"{_PREFIX}0") for name in os.listdir(path))
    except OSError:
        return False


def _writes_model_file() -> bool:
    """Megatron-LM: data-parallel rank 0, or expert data-parallel rank 0 (so every (TP, EP) shard has one
    writer when the dense and expert layouts differ)."""
    return parallel_state.get_data_parallel_rank() == 0 or parallel_state.get_expert_data_parallel_rank() == 0


def _reads_parameter_state() -> bool:
    """The ranks megatron-core's load_parameter_state reads the file on: rank 0 of a distributed optimizer's
    data-parallel group (with context parallelism), or of the experts' (--num-distributed-optimizer-instances
    1, which the arguments require with this format)."""
    if parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0:
        return True
    return parallel_state.get_expert_model_parallel_world_size() > 1 and \
        parallel_state.get_expert_data_parallel_rank() == 0


def _optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def parameter_state(optimizer):
    """Collective over data-parallel ranks: what megatron-core's save_parameter_state writes to
    distrib_optim.pt, on the ranks that write it (None elsewhere and without a distributed optimizer)."""
    chained = _optimizers(optimizer)
    if len(chained) == 1:
        only = chained[0]
        if not hasattr(only, "get_parameter_state_dp_zero") or getattr(only, "is_stub_optimizer", False):
            return None
        state = only.get_parameter_state_dp_zero()
        return state if only.data_parallel_group.rank() == 0 else None
    states, writes = [], False
    for part in chained:
        if hasattr(part, "get_parameter_state_dp_zero"):
            state = part.get_parameter_state_dp_zero()
            writes = writes or part.data_parallel_group.rank() == 0
            states.append(state if part.data_parallel_group.rank() == 0 else None)
    return states if writes else None


def load_parameter_state(optimizer, state) -> None:
    """Collective over data-parallel ranks: megatron-core's load_parameter_state, with the file's state read
    safely by the tier (`state`: None on the ranks that do not read it)."""
    chained = _optimizers(optimizer)
    if len(chained) == 1:
        only = chained[0]
        if not getattr(only, "is_stub_optimizer", False):
            _needs_state(only, state)
            only.load_parameter_state_from_dp_zero(state)
        return
    for index, part in enumerate(chained):
        if hasattr(part, "load_parameter_state_from_dp_zero"):
            part_state = state[index] if state else None
            _needs_state(part, part_state)
            part.load_parameter_state_from_dp_zero(part_state)


def _needs_state(optimizer, state) -> None:
    if optimizer.data_parallel_group.rank() == 0 and state is None:
        raise RuntimeError(f"no {OPTIMIZER_FILE} state read on the distributed optimizer's data-parallel "
                           "rank 0")


def save_rank_files(staging: str, state: dict) -> dict:
    """Collective: this rank's files of a save into `staging` (model_optim_rng.pt where this rank writes it,
    distrib_optim.pt where it holds the gathered state); returns their {relpath: size and checksum}.
    Where Megatron-LM's rule gives a file more than one writer (context-parallel replicas of data-parallel
    rank 0 write the same model_optim_rng.pt there, racing), the lowest rank writes it."""
    model_state = {key: value for key, value in state.items() if key != PARAMETER_STATE}
    parameters = state.get(PARAMETER_STATE)
    relative_dir = this_rank_dir()
    wanted = {f"{relative_dir}/{MODEL_FILE}": model_state if _writes_model_file() else None,
              f"{relative_dir}/{OPTIMIZER_FILE}": parameters}
    # Nothing above can fail on one rank only: every rank reaches this collective.
    claims = parallel.all_gather_object([relative for relative, content in wanted.items()
                                         if content is not None])
    writer = {}
    for rank, relatives in enumerate(claims):
        for relative in relatives:
            writer.setdefault(relative, rank)
    written = []
    for relative, content in wanted.items():
        if content is None or writer[relative] != parallel.rank():
            continue
        os.makedirs(os.path.join(staging, relative_dir), exist_ok=True)
        with open_new(os.path.join(staging, relative), "wb") as f:
            torch.save(content, f)
        written.append(relative)
    return checksum_files(staging, written)


def read_file(path: str, max_bytes: int | None = None):
    """A file of this format (at most `max_bytes` long), weights-only through the allow-list. Transformer
    Engine's extra state may come as a BytesIO (older TE): admitted only under a `._extra_state` key and
    checked inside, as safe_load does for torch_dist."""
    with untrusted.open_regular(path, max_bytes, what=os.path.basename(path)) as f:
        loaded = safe_load.load_weights_only(f, path, extra=(io.BytesIO,))
    _check_bytes_objects(loaded, path, "")
    return loaded


def _check_bytes_objects(value, path: str, key: str) -> None:
    if isinstance(value, dict):
        for name, part in value.items():
            _check_bytes_objects(part, path, str(name))
    elif isinstance(value, (list, tuple)):
        for part in value:
            _check_bytes_objects(part, path, key)
    elif key.endswith("_extra_state"):
        safe_load.check_extra_state(value, f"{path} ({key})")
    elif isinstance(value, io.BytesIO):
        raise safe_load.UnsafeCheckpointError(f"{path} holds bytes for a later unpickling under {key!r}, "
                                              "which is no layer's extra state; refused")


class RankFiles:
    """What one rank reads of a torch-format checkpoint: its model_optim_rng.pt and, where it reads it,
    distrib_optim.pt, each through `read_file`. Read at verification (which is what vets their pickles) and
    kept for the load that follows."""

    def __init__(self, path: str, max_bytes: int | None = None) -> None:
        self.path = path
        self.directory = this_rank_dir()
        self.max_bytes = max_bytes  # what this run's model can fill; None: no bound but the file's size
        self.state: dict | None = None
        self.parameters = None

    @property
    def model_file(self) -> str:
        return f"{self.directory}/{MODEL_FILE}"

    def present(self) -> bool:
        return os.path.lexists(os.path.join(self.path, self.model_file))

    def _to_read(self) -> list[str]:
        optimizer_file = f"{self.directory}/{OPTIMIZER_FILE}"
        if _reads_parameter_state() and os.path.lexists(os.path.join(self.path, optimizer_file)):
            return [self.model_file, optimizer_file]
        return [self.model_file]

    def larger_than_this_model(self) -> str | None:
        """Why a file this rank would read is larger than this run's model can fill, or None."""
        if self.max_bytes is None:
            return None
        for relative in self._to_read():
            size = os.lstat(os.path.join(self.path, relative)).st_size
            if size > self.max_bytes:
                return (f"{relative} has {size} bytes, more than this run's model and optimizer state can "
                        f"take ({self.max_bytes}); saved for a larger model, or no checkpoint: not read")
        return None

    def read(self) -> None:
        model_file, *optimizer_file = self._to_read()
        state = read_file(untrusted.inside(self.path, model_file), self.max_bytes)
        if not isinstance(state, dict):
            raise CheckpointDataError(f"{os.path.join(self.path, self.model_file)} holds a "
                                      f"{type(state).__name__}, not a checkpoint's state dict")
        if optimizer_file:
            self.parameters = read_file(untrusted.inside(self.path, optimizer_file[0]), self.max_bytes)
        self.state = state

    def has_parameter_state(self) -> bool:
        return os.path.lexists(os.path.join(self.path, self.directory, OPTIMIZER_FILE))


def rank0_model_file(path: str) -> str | None:
    """Megatron-LM's find_checkpoint_rank_0: tensor, pipeline and expert rank 0's model_optim_rng.pt (for the
    saved arguments before the process groups exist)."""
    for directory in (rank_dir(0), rank_dir(0, 0), rank_dir(0, 0, 0)):
        if os.path.lexists(os.path.join(path, directory, MODEL_FILE)):
            return f"{directory}/{MODEL_FILE}"
    return None


def check_all(path: str, every_file: bool = True) -> str | None:
    """A check without process groups: every .pt file of the checkpoint (or only rank 0's model file) read
    through the allow-list. None, or why it is refused."""
    first = rank0_model_file(path)
    if first is None:
        return f"incomplete (no {_PREFIX}00*/{MODEL_FILE})"
    for relative in untrusted.regular_files(path) if every_file else [first]:
        if relative.startswith(_PREFIX) and relative.endswith(".pt"):
            read_file(untrusted.inside(path, relative))
    return None


def reason_of(step) -> str | None:
    """Run a reading `step` (which returns None or a reason): its reason, or why what it read is refused or
    unreadable, in one line."""
    try:
        return step()
    except CheckpointDataError as err:
        return str(err)
    except (OSError, EOFError, RuntimeError, ValueError, TypeError, AttributeError, KeyError, IndexError,
            MemoryError, RecursionError, pickle.UnpicklingError) as err:
        first_line = (str(err).splitlines() or [""])[0][:200]
        return f"unreadable: {type(err).__name__}: {first_line}"


def _saved_size(saved: dict, name: str) -> int:
    return int(saved.get(name) or 1)


def layout_mismatch(saved: dict) -> str | None:
    """Why a checkpoint saved with arguments `saved` cannot load on this run's ranks: the format keeps each
    model-parallel rank's tensors whole, so only the sizes that saved it read it (data-parallel size
    aside)."""
    sizes = (("tensor_model_parallel_size", parallel_state.get_tensor_model_parallel_world_size()),
             ("pipeline_model_parallel_size", parallel_state.get_pipeline_model_parallel_world_size()),
             ("expert_model_parallel_size", parallel_state.get_expert_model_parallel_world_size()),
             ("virtual_pipeline_model_parallel_size",
              parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1))
    for name, ours in sizes:
        if _saved_size(saved, name) != ours:
            return (f"saved with --{name.replace('_', '-')} {_saved_size(saved, name)} (this run: {ours}); a "
                    "--ckpt-format torch checkpoint loads only under the parallel sizes that saved it")
    return None


def loaded_state(files: RankFiles, request: dict) -> dict:
    """The state a load returns from this rank's files, for `request` (state.build_sharded_state's torch
    template: which model keys, whether the optimizer and whether it is distributed). Raises ValueError when
    the checkpoint does not fit this run."""
    state = dict(files.state)
    record = state.get("args")
    saved = vars(record) if hasattr(record, "__dict__") else dict(record or {})
    if (why := layout_mismatch(saved)) is not None:
        raise ValueError(why)
    missing = [key for key in request["model_keys"] if key not in state]
    if missing:
        raise ValueError(f"{files.model_file} holds no {', '.join(missing)}")
    if request["optimizer"]:
        if request["distributed_optimizer"] != files.has_parameter_state():
            said = "with" if files.has_parameter_state() else "without"
            raise ValueError(f"saved {said} --use-distributed-optimizer ({OPTIMIZER_FILE} "
                             f"{'present' if said == 'with' else 'absent'}); its optimizer state loads only "
                             "into the same kind of optimizer: match the flag, or give --no-load-optim")
        if request["distributed_optimizer"]:
            state[PARAMETER_STATE] = files.parameters
    return state
