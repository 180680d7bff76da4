"""What every step of the GPU check shares: the profile, the launcher, the deadline, the runs earlier steps
left for later ones (the uninterrupted run's losses, the save variants' timings), and each step's
result: passed, failed or skipped, with its reason and its figures."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_resil.tools.gpu_check.profiles import Profile
from megatron_resil.tools.gpu_check.runs import Launcher, Run

_END_RESERVE_S = 10.0  # kept back for the report


class Failed(Exception):
    """The step ran and something it checks did not hold."""

    def __init__(self, reason: str, **figures) -> None:
        super().__init__(reason)
        self.figures = figures


class Skipped(Exception):
    """The step cannot run here (no CUDA, no Transformer Engine, out of time)."""


@dataclass
class StepResult:
    name: str
    status: str  # "passed", "failed" or "skipped"
    reason: str  # why it failed or was skipped; what it showed when it passed
    seconds: float
    figures: dict = field(default_factory=dict)


@dataclass
class Check:
    profile: Profile
    launcher: Launcher
    workdir: Path
    deadline: float  # time.monotonic() by which the whole check ends
    cuda: bool
    transformer_engine: bool
    reference: dict[int, tuple[str, str]] = field(default_factory=dict)  # the uninterrupted run's losses
    windows: dict[str, dict] = field(default_factory=dict)  # save variant -> its loop and saves (the ratio)
    straggler_output: str = ""  # the straggler run's log, judged again for NVRx's GPU path
    reproducible: bool | None = None  # did every save variant repeat the train run's losses exactly?

    def timeout(self) -> float:
        """For the next launch: the profile's limit, or what is left of the budget."""
        left = self.deadline - time.monotonic() - _END_RESERVE_S
        if left < 15.0:
            raise Skipped(f"out of time: {max(left, 0.0):.0f} s left of the {self.profile.budget_s:.0f} s "
                          "budget")
        return min(self.profile.launch_timeout_s, left)

    def fresh_dir(self, name: str) -> Path:
        path = self.workdir / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def run(self, name: str, args: list[str], **kwargs) -> Run:
        return self.launcher.run(name, args, self.timeout(), **kwargs)


def require_exit_0(run: Run) -> None:
    if run.returncode is None:
        raise Failed(f"{run.name}: killed at its time limit after {run.seconds:.0f} s; "
                     f"log tail: {run.tail(300)}")
    if run.returncode != 0:
        raise Failed(f"{run.name}: exit code {run.returncode} (rank: {run.rank_exit_code()}); "
                     f"log tail: {run.tail(300)}")


def compare_losses(found: dict[int, tuple[str, str]], reference: dict[int, tuple[str, str]],
                   iterations: list[int]) -> tuple[list[int], list[str]]:
    """(iterations compared, differences as text) for `iterations` logged in both."""
    compared = [i for i in iterations if i in found and i in reference]
    differ = [f"iteration {i}: {found[i]} against {reference[i]}"
              for i in compared if found[i] != reference[i]]
    return compared, differ
