"""Megatron-format training and validation log lines, plus tokens/s and optional TensorBoard."""

from __future__ import annotations

import argparse
import math
import time
from datetime import datetime

from megatron_resil import events, parallel


def json_safe(value: float) -> float | str:
    """A float strict JSON readers accept: NaN and Inf become the strings "nan", "inf", "-inf" (not null,
    so a log still tells a NaN loss from an overflow; json.dumps would write bare NaN, which is not JSON)."""
    return value if math.isfinite(value) else str(value)


class TrainLogger:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.skipped_in_interval = 0  # steps the fp16 loss scaler skipped since the last log line
        self.interval_start = time.perf_counter()
        self.iterations_in_interval = 0
        self.writer = None
        if args.tensorboard_dir and parallel.is_rank0():
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=100)

    def restart_interval(self) -> None:
        """Time spent in eval or checkpointing is not charged to training iterations."""
        self.interval_start = time.perf_counter()
        self.iterations_in_interval = 0

    def training_step(self, iteration: int, consumed_samples: int, lr: float, report) -> None:
        """`report`: training.StepReport (loss, grad norm, MoE auxiliary losses, loss scale)."""
        loss, grad_norm = report.loss, report.grad_norm
        self.iterations_in_interval += 1
        self.skipped_in_interval += 0 if report.updated else 1
        if self.writer is not None and iteration % self.args.tensorboard_log_interval == 0:
            self.writer.add_scalar("lm loss", loss, iteration)
            self.writer.add_scalar("learning-rate", lr, iteration)
            self.writer.add_scalar("grad-norm", grad_norm, iteration)
        if iteration % self.args.log_interval:
            return
        elapsed = time.perf_counter() - self.interval_start
        per_iter_ms = 1000.0 * elapsed / max(self.iterations_in_interval, 1)
        tokens_per_s = (self.args.global_batch_size * self.args.seq_length * self.iterations_in_interval
                        / max(elapsed, 1e-9))
        line = (f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}]"
                f" iteration {iteration:8d}/{self.args.train_iters:8d} |"
                f" consumed samples: {consumed_samples:12d} |"
                f" elapsed time per iteration (ms): {per_iter_ms:.1f} |"
                f" learning rate: {lr:.6E} |"
                f" global batch size: {self.args.global_batch_size:5d} |"
                f" lm loss: {loss:.6E} |"
                + "".join(f" {name}: {value:.6E} |" for name, value in report.moe_losses.items())
                + f" loss scale: {report.loss_scale:.1f} |"
                f" grad norm: {grad_norm:.3f} |"
                f" number of skipped iterations: {self.skipped_in_interval:3d} |"
                f" tokens per second: {tokens_per_s:.1f} |")
        if parallel.is_rank0():
            print(line, flush=True)
        # The run timeline (tools/timeline.py) plots these against wall time: one short line per interval.
        events.record("progress", iteration=iteration, loss=json_safe(loss), grad_norm=json_safe(grad_norm))
        self.restart_interval()
        self.skipped_in_interval = 0

    def validation(self, iteration: int, loss: float) -> None:
        ppl = math.exp(min(20.0, loss))
        text = (f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} |"
                f" lm loss PPL: {ppl:.6E} | ")
        if self.writer is not None:
            self.writer.add_scalar("lm loss validation", loss, iteration)
        if parallel.is_rank0():
            bar = "-" * len(text)
            print(f"{bar}\n{text}\n{bar}", flush=True)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
