"""Deterministic faults on chosen ranks at a chosen iteration, for tests and drills (--inject-fault).

Once per job by default: before striking, the rank records the fault under `<save>/.injected_faults/`,
so the restarted job does not strike again (--inject-fault-repeat to strike every time).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import time

import torch

from megatron_resil import events, parallel
from megatron_resil.checkpointing.atomic import atomic_write_text
from megatron_resil.optimizer import before_grad_finalize


class FaultInjector:
    def __init__(self, args: argparse.Namespace, model: list | None = None) -> None:
        self.kind = args.inject_fault
        self.iteration = args.inject_fault_iteration
        self.slow_secs = args.inject_fault_slow_secs
        self.repeat = args.inject_fault_repeat
        self.here = self.kind is not None and parallel.rank() in args.inject_fault_ranks
        self.marker_dir = os.path.join(args.save, ".injected_faults") if args.save else None
        self.model = model  # flip-weight's target: this rank's model chunks
        self.before_writing_state = None  # called before flip-weight writes (a pending async save's copy)
        self._struck = False
        self._slowing = False
        self._iteration = None  # the one running (before_iteration's)
        if self.here and self.kind == "kill-in-grad-sync" and model is not None:
            before_grad_finalize(model, self._in_grad_sync)

    def _strike(self, what: str, every_pass: bool = False) -> bool:
        """True if this rank should inject now; records it first so a restart does not repeat it.
        `every_pass`: also on a second pass in this process (a rerun of the step)."""
        if self._struck and not every_pass:
            return False
        marker = (os.path.join(self.marker_dir, f"{self.kind}-iter{self.iteration}-rank{parallel.rank()}")
                  if self.marker_dir else None)
        if not self.repeat and marker and os.path.exists(marker):
            self._struck = True
            return False
        if marker:
            os.makedirs(self.marker_dir, exist_ok=True)
            atomic_write_text(marker, f"{time.time()}\n")
        self._struck = True
        print(f"[resil] fault: injecting {self.kind} on rank {parallel.rank()} {what}", flush=True)
        events.record("fault_injected", kind=self.kind, iteration=self.iteration, rank=parallel.rank())
        return True

    def before_iteration(self, iteration: int) -> None:
        """Called before `iteration` runs."""
        if not self.here:
            return
        self._iteration = iteration
        if self.kind == "slow" and iteration >= self.iteration:
            # Slow from the first strike on; a restarted job that already struck stays fast.
            if not self._struck:
                self._slowing = self._strike(f"from iteration {iteration}: {self.slow_secs:g}s per iteration")
            if self._slowing:
                time.sleep(self.slow_secs)
            return
        if self.kind == "flip-weight" and iteration == self.iteration:
            self._flip_weight(iteration)
            return
        if iteration != self.iteration or self.kind not in ("kill", "exception", "sigterm", "hang"):
            return
        if not self._strike(f"before iteration {iteration}"):
            return
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "exception":
            raise RuntimeError(f"injected fault: exception on rank {parallel.rank()} "
                               f"at iteration {iteration}")
        elif self.kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        else:  # hang: alive, but never reaching the next collective
            while True:
                time.sleep(3600)

    def _in_grad_sync(self) -> None:
        """Called as this rank's gradient reduction begins: its peers that finished their backward pass
        wait inside the all-reduce (or reduce-scatter) for this rank, which dies there."""
        if self._iteration == self.iteration and self._strike(
                f"in iteration {self.iteration} as its gradients' reduction begins"):
            os.kill(os.getpid(), signal.SIGKILL)

    @torch.no_grad()
    def _flip_weight(self, iteration: int) -> None:
        """A silent data corruption of this replica: one bit of one weight, in place. The top mantissa bit
        of the largest element of the last weight matrix: the value moves by a quarter to a half, stays
        finite (the loss too: no NaN check notices), and outlives the optimizer's small updates where the
        optimizer steps these weights themselves (fp32 without --use-distributed-optimizer; otherwise its
        main copy overwrites them at the next step)."""
        name, param = [(f"{name} (model chunk {i})", p) for i, chunk in enumerate(self.model)
                       for name, p in chunk.named_parameters() if p.dim() >= 2][-1]
        flat = param.data.view(-1)
        index = int(flat.abs().argmax())
        bit = round(-math.log2(torch.finfo(param.dtype).eps)) - 1  # the mantissa's top bit
        flipped = flat[index:index + 1].clone()
        flipped.view({4: torch.int32, 2: torch.int16}[flipped.element_size()]).bitwise_xor_(1 << bit)
        if self._strike(f"before iteration {iteration}: bit {bit} of element {index} of {name}, "
                        f"{float(flat[index]):.6g} -> {float(flipped):.6g}"):
            if self.before_writing_state is not None:
                self.before_writing_state()
            flat[index:index + 1].copy_(flipped)

    def poison_loss(self, loss: torch.Tensor, iteration: int) -> torch.Tensor:
        # With --inject-fault-repeat a NaN strikes every pass of its iteration, its rerun in place included,
        # as a bad device or bad data would: the fault the rerun state machine reproduces.
        if self.here and self.kind == "nan-loss" and iteration == self.iteration and \
                self._strike(f"into the loss of iteration {iteration}", every_pass=self.repeat):
            return loss * float("nan")
        if self.here and self.kind == "spiky-loss" and iteration == self.iteration and \
                self._strike(f"into the loss of iteration {iteration}"):
            return loss * 1000.0
        return loss

    def on_staged(self, iteration: int) -> None:
        """Called after a save's shards are written, before it is published."""
        if self.here and self.kind == "crash-mid-save" and iteration >= self.iteration and \
                self._strike(f"in the save of iteration {iteration}, before it is published"):
            os.kill(os.getpid(), signal.SIGKILL)
