"""Megatron-LM's --step-batch-size-schedule: the global batch size as a step function of the samples
consumed. "0:384 200B:768 400B:1152" trains with 384 until 200 billion tokens, then 768, then 1152; the
thresholds count tokens (suffixes K, M, B, T), turned into samples by --seq-length, as megatron-core 0.19's
StepBatchsizeNumMicroBatchesCalculator reads them. Our own code, so both lanes have it; a pure function
of the consumed samples, so a run resumed anywhere in the schedule continues exactly."""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass
from functools import cache

_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def _number(text: str) -> int:
    text = text.strip().upper()
    multiplier = _SUFFIXES.get(text[-1:], 1)
    return int(float(text[:-1] if multiplier > 1 else text) * multiplier)


@dataclass(frozen=True)
class BatchSizeSchedule:
    """(first consumed sample, global batch size) steps, thresholds ascending from 0."""

    steps: tuple[tuple[int, int], ...]

    @classmethod
    def parse(cls, text: str, seq_length: int) -> BatchSizeSchedule:
        """Raises ValueError with a clause saying what is wrong with `text`."""
        steps = []
        for entry in text.replace(",", " ").split():
            threshold, colon, batch = entry.partition(":")
            try:
                steps.append((_number(threshold) // seq_length, _number(batch)))
            except ValueError:
                raise ValueError(f"entry {entry!r} is not THRESHOLD:BATCH_SIZE (e.g. 200B:768)") from None
            if not colon:
                raise ValueError(f"entry {entry!r} is not THRESHOLD:BATCH_SIZE (e.g. 200B:768)")
        steps.sort()
        if not steps or steps[0][0] != 0:
            raise ValueError("the first entry must start at 0 (e.g. 0:384)")
        for (before, _), (after, _) in itertools.pairwise(steps):
            if after == before:
                raise ValueError(f"two entries start at sample {after} (thresholds are tokens; "
                                 f"--seq-length {seq_length} tokens make a sample)")
        if any(batch <= 0 for _, batch in steps):
            raise ValueError("batch sizes must be positive")
        return cls(tuple(steps))

    def at(self, consumed_samples: int) -> int:
        """The global batch size of the step taken when `consumed_samples` samples have been consumed."""
        return next(batch for threshold, batch in reversed(self.steps) if consumed_samples >= threshold)

    def iterations(self, train_samples: int) -> int:
        """Megatron-LM's update_train_iters: steps until `train_samples` are consumed (the last may
        overshoot)."""
        iterations = consumed = 0
        while consumed < train_samples:
            consumed += self.at(consumed)
            iterations += 1
        return iterations

    def samples(self, iterations: int) -> int:
        """The samples `iterations` steps from the start consume."""
        consumed = 0
        for _ in range(iterations):
            consumed += self.at(consumed)
        return consumed


@cache
def _parsed(text: str, seq_length: int) -> BatchSizeSchedule:
    return BatchSizeSchedule.parse(text, seq_length)


def schedule(args: argparse.Namespace) -> BatchSizeSchedule:
    """The run's schedule: --step-batch-size-schedule, or the one step of --global-batch-size."""
    if args.step_batch_size_schedule is None:
        return BatchSizeSchedule(((0, args.global_batch_size),))
    return _parsed(args.step_batch_size_schedule, args.seq_length)


def global_batch_size(args: argparse.Namespace, consumed_samples: int) -> int:
    return schedule(args).at(consumed_samples)


def num_microbatches(args: argparse.Namespace, batch_size: int) -> int:
    """Microbatches per data-parallel rank in a global batch of `batch_size` (the arguments' checks made
    sure it divides)."""
    return batch_size // (args.micro_batch_size * args.data_parallel_size)
