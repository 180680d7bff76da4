"""Where training stands: what a checkpoint must carry besides tensors to continue exactly."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainProgress:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    # Megatron-LM's counters, saved and restored as it keeps them: samples consumed without training on them
    # (in its args), and the model FLOPs of every iteration trained so far (num_floating_point_operations).
    skipped_train_samples: int = 0
    floating_point_operations_so_far: float = 0.0
