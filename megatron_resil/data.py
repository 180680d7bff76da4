"""Training data: megatron-core GPT datasets (real indexed files or mock) and the sampler.

`get_microbatch` is a pure function of the number of consumed samples, so resuming from a
checkpoint replays exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy
import torch
import torch.distributed as dist
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import Split, get_blend_from_list

from megatron_resil import batch_schedule, fim, parallel
from megatron_resil.tokenizer import Tokenizer

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


@dataclass
class FIMGPTDatasetConfig(GPTDatasetConfig):
    """GPTDatasetConfig with the FIM settings (--fim-data)."""

    fim: fim.FIMSettings | None = None


class FIMGPTDataset(GPTDataset):
    """megatron-core's GPTDataset whose samples are turned into fill-in-the-middle ones (fim.py)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._fim = fim.FIMTransform(self.config.fim, self.config.tokenizer)

    def _query_document_sample_shuffle_indices(self, idx: int) -> tuple:
        # megatron-core 0.16 returns (ids, document ids); 0.19 adds each document's length.
        text, *rest = super()._query_document_sample_shuffle_indices(idx)
        # A short last sample is padded with _pad_token_id, -1 for our tokenizers (none has a pad token);
        # FIM acts on the ids before it.
        real = int(numpy.count_nonzero(text != self._pad_token_id))
        rng = fim.sample_rng(self.config.random_seed, self.index_split.value, idx)
        text = numpy.concatenate([self._fim(text[:real], rng), text[real:]])
        if len(rest) == 2:
            rest[1] = [real]  # one document now, as Megatron-LM's FIM dataset counts it
        return (text, *rest)


def _data_cache_path(args: argparse.Namespace) -> str | None:
    """Where dataset index caches go: --data-cache-path, else <save>/data_cache; None for mock data.

    megatron-core keys its cache on paths, split and seed but not on file contents, so the caches of
    real data live under a digest of the data files' sizes and modification times: re-preprocessing
    into the same prefix gets a fresh cache instead of stale indices.
    """
    if args.mock_data:
        return None  # mock data is generated in memory; caching it would write ~50 MB per run
    root = args.data_cache_path or (os.path.join(args.save, "data_cache") if getattr(args, "save", None)
                                    else None)
    if root is None:
        return None
    identity = hashlib.sha1()
    for prefix in args.data_path:
        for suffix in (".bin", ".idx"):
            if os.path.isfile(prefix + suffix):
                st = os.stat(prefix + suffix)
                identity.update(f"{os.path.abspath(prefix + suffix)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return os.path.join(root, identity.hexdigest()[:16])


def _num_samples(args: argparse.Namespace) -> tuple[int, int]:
    # As Megatron-LM: --train-samples as given (the last, incomplete batch's samples included); with
    # --train-iters, what those iterations consume (--step-batch-size-schedule's sizes, where given).
    train = args.train_samples if args.train_samples is not None \
        else batch_schedule.schedule(args).samples(args.train_iters)
    # Megatron-LM's count: one evaluation every eval_interval iterations plus one at the end.
    evaluations = 1 + (args.train_iters // args.eval_interval if args.eval_interval else 0)
    valid = evaluations * args.eval_iters * args.eval_global_batch_size
    return train, valid


def _check_splits_have_tokens(config: GPTDatasetConfig, split_flag: str) -> None:
    """megatron-core loops forever drawing samples from a split with no tokens; fail instead."""
    if config.split_matrix[Split.train.value] is None:
        raise ValueError(f"split {split_flag!r} leaves nothing for training")
    for prefix in config.blend[0]:
        # Keep the dataset referenced: its __del__ unmaps the memory sequence_lengths views.
        indexed = IndexedDataset(prefix)
        lengths = indexed.sequence_lengths
        for split in (Split.train, Split.valid):
            bounds = config.split_matrix[split.value]
            if bounds is None:
                continue
            # The same document ranges megatron-core's builder carves out of each prefix.
            beg, end = (int(round(bound * len(lengths))) for bound in bounds)
            if int(lengths[beg:end].sum()) == 0:
                raise ValueError(
                    f"split {split_flag!r} gives the {split.name} split no tokens of {prefix} "
                    f"({len(lengths)} documents); use more data, a larger {split.name} share"
                    + (", or eval_iters 0" if split is Split.valid else ""))


@contextlib.contextmanager
def _process_group() -> Iterator[None]:
    """Run in the caller's process group, or without one in a throwaway group of this process alone.

    megatron-core's BlendedDataset calls torch.distributed.get_rank() unguarded when it writes its
    index cache, so a weighted blend would otherwise fail in a single process without init.
    """
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build_datasets(
    args: argparse.Namespace, tokenizer: Tokenizer, group: bool = True
) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset | None]:
    """Build (train, valid) GPT datasets; valid is None when eval_iters is 0 or the split gives it nothing.

    Collective when torch.distributed is initialised: every rank must call it, rank 0 builds the
    index caches first and the others then read them. Without it, a throwaway group of this process alone
    (see _process_group), unless `group` is False (mock data, which needs none).
    """
    if not args.mock_data and not args.data_path:
        # megatron-core would silently fall back to mock data without a blend.
        raise ValueError("no training data: set data_path or mock_data")
    config_cls, extra = GPTDatasetConfig, {}
    if getattr(args, "fim_data", False):
        config_cls, extra = FIMGPTDatasetConfig, {"fim": fim.settings_from_args(args, tokenizer)[0]}
    config = config_cls(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None if args.mock_data else get_blend_from_list(args.data_path),
        split=args.split,
        path_to_cache=_data_cache_path(args),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        mmap_bin_files=getattr(args, "mmap_bin_files", True),  # Megatron-LM's --no-mmap-bin-files
        **extra,
    )
    train_samples, valid_samples = _num_samples(args)
    # Nothing here evaluates on the test split, and an unused split can still fail to build
    # (e.g. a tiny corpus whose 1/1000 test share holds no document), so it is never built.
    config.split_matrix[Split.test.value] = None
    if valid_samples == 0:
        config.split_matrix[Split.valid.value] = None
    if not args.mock_data:
        _check_splits_have_tokens(config, args.split)
    dataset_cls = MockGPTDataset if args.mock_data else FIMGPTDataset if extra else GPTDataset
    # Every rank samples its own microbatches, so every rank needs the datasets.
    with _process_group() if group else contextlib.nullcontext():
        train_ds, valid_ds, _ = BlendedMegatronDatasetBuilder(
            dataset_cls, [train_samples, valid_samples, 0], lambda: True, config
        ).build()
    return train_ds, valid_ds


# What build_datasets reads, directly or through the tokenizer, the FIM settings and the batch schedule.
_DATASET_ARGS = ("mock_data", "data_path", "split", "seed", "seq_length", "data_cache_path", "save",
                 "mmap_bin_files", "train_samples", "train_iters", "eval_interval", "eval_iters",
                 "eval_global_batch_size", "global_batch_size", "micro_batch_size", "data_parallel_size",
                 "step_batch_size_schedule", "rampup_batch_size", "vocab_size", "vocab_file", "merge_file",
                 "trust_remote_code")
_DATASET_ARG_PREFIXES = ("fim_", "tokenizer_", "tiktoken_")
# The tokenizers built from the command line alone, reading no file and starting no thread: with these, a
# standby builds mock data's datasets before it forks the ranks (standby_warmup.py).
TOKENIZERS_FROM_ARGUMENTS = ("NullTokenizer", "ByteTokenizer")
_kept: tuple[tuple, tuple] | None = None  # (what they were built from, (train, valid)): this process's


def _built_from(args: argparse.Namespace) -> tuple:
    return tuple(sorted((name, repr(value)) for name, value in vars(args).items()
                        if name in _DATASET_ARGS or name.startswith(_DATASET_ARG_PREFIXES)))


def build_ahead(args: argparse.Namespace, tokenizer: Tokenizer) -> None:
    """Before the first in-process attempt, in every process, reserves included, and in a launcher's standby
    before it forks the ranks (standby_warmup.py), without a process group: mock data's datasets, kept for
    every attempt (datasets_for_attempt); none built where this process already holds them. Mock data only:
    it is built in memory (its shuffle index, about 0.2 s of CPU here), while real data's index caches are
    written by one rank for all, which a build without the job's process group would race."""
    global _kept
    if args.mock_data and not kept_for(args):  # a standby's fork may have them already (standby_warmup.py)
        # Without even a throwaway process group: torch.distributed's first group of the process, made and
        # destroyed here, left gloo collectives of the attempts that followed without their timeout
        # (a peer stopped with SIGSTOP then blocked a survivor until NVRx's hard timeout).
        _kept = (_built_from(args), build_datasets(args, tokenizer, group=False))


def kept_for(args: argparse.Namespace) -> bool:
    """Whether this process holds datasets built for these arguments."""
    return _kept is not None and _kept[0] == _built_from(args)


def datasets_for_attempt(args: argparse.Namespace, tokenizer: Tokenizer) -> tuple[tuple, bool]:
    """Collective: ((train, valid), whether they were kept). Kept: the datasets this process built in an
    earlier attempt (or ahead of the first), when every rank has them for the same arguments, so a restart
    in the same processes does not build them again. Otherwise every rank builds them, together
    (megatron-core's build has barriers of its own)."""
    global _kept
    if parallel.all_ranks_agree(kept_for(args)):
        return _kept[1], True
    built = build_datasets(args, tokenizer)
    _kept = (_built_from(args), built)
    return built, False


def get_microbatch(
    dataset: torch.utils.data.Dataset,
    consumed_samples: int,
    microbatch: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
) -> dict[str, torch.Tensor]:
    """Microbatch `microbatch` of data-parallel rank `dp_rank` in the global batch at `consumed_samples`.

    Sample order matches Megatron's MegatronPretrainingSampler; indices wrap modulo len(dataset)
    so repeated evaluation can cycle through a validation set.
    """
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
    if len(dataset) == 0:
        raise ValueError("cannot sample from an empty dataset")
    start = consumed_samples + (microbatch * dp_size + dp_rank) * micro_batch_size
    samples = [dataset[(start + i) % len(dataset)] for i in range(micro_batch_size)]
    return {key: torch.stack([sample[key] for sample in samples]) for key in BATCH_KEYS}
