"""Where training stands: what a checkpoint must carry besides tensors to continue exactly."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainProgress:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
