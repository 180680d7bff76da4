"""What the GPU check runs with: the model, the iteration counts and the time limits, one profile for the
GPU machine (NCCL, bf16, a GPT of a few hundred MB) and one for the CPU dry run (gloo, a tiny GPT), so both
modes run the same steps with the same flags and differ only in sizes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    name: str
    model: tuple[str, ...]  # pretrain.py's model and tokenizer flags
    backend: str  # --distributed-backend
    micro_batch: int  # and global batch: one rank, one microbatch per step
    train_iters: int  # of every run whose losses are compared (the LR schedule depends on it)
    log_interval: int
    save_interval: int  # of the save variants: saves at K, 2K, 3K (at least three) inside the timed window,
    # each given time to be written in the background before the next one (a save that finds the previous
    # one still writing is counted: the trainer waits, and the stall ratio would measure that wait)
    kill_save_interval: int  # of the kill run: a save in flight as often as possible
    kill_delay_s: float  # from the start of an async save to the SIGKILL
    inprocess_fault_iteration: int
    straggler_iters: int
    straggler_slow_from: int  # an injected 'slow' fault from this iteration on
    straggler_slow_s: float
    rerun_iters: int
    rerun_nan_iteration: int
    # The step-time ratio: pretrain.py and the bare megatron-core loop alternated, `step_rounds` of each, on a
    # model large enough that a step is bound by the device, not by the host launching kernels (>= 150 ms on
    # an H100 or H200); its own flags, since every other run compares losses with the train run's.
    step_model: tuple[str, ...]
    step_micro_batch: int
    step_rounds: int
    step_warmup: int  # iterations left out of each launch's timing (allocator, autotuning)
    step_iters: int  # timed iterations per launch, in blocks of log_interval
    te_iters: int  # the Transformer Engine run: saves every te_iters // 3, killed after the second
    launch_timeout_s: float  # one pretrain.py launch at most
    budget_s: float  # the whole check at most

    def pretrain_args(self, train_iters: int | None = None, model: tuple[str, ...] | None = None,
                      micro_batch: int | None = None) -> list[str]:
        """The flags every run shares (each step adds its own)."""
        batch = str(micro_batch or self.micro_batch)
        return [*(model or self.model), "--micro-batch-size", batch, "--global-batch-size", batch,
                "--bf16", "--use-distributed-optimizer", "--distributed-backend", self.backend,
                "--train-iters", str(train_iters or self.train_iters), "--lr", "3e-4", "--min-lr", "3e-5",
                "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--mock-data", "--eval-iters", "0",
                "--log-interval", str(self.log_interval)]

    def step_args(self) -> list[str]:
        """The step-time ratio's runs: the larger model, as many iterations as the bare loop steps."""
        return self.pretrain_args(self.step_warmup + self.step_iters, self.step_model, self.step_micro_batch)


GPU = Profile(
    name="gpu",
    # 8 x 1024, 32000 tokens: 134M parameters, 268 MB of bf16 weights, a 1.9 GB checkpoint with Adam's state.
    model=("--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
           "--seq-length", "1024", "--max-position-embeddings", "1024",
           "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000"),
    # 57 ms an iteration on an H200 (2026-11-26): saves at 60, 120 and 180 are 3.4 s apart, longer than a
    # background write of 1.9 GB.
    backend="nccl", micro_batch=4, train_iters=240, log_interval=10, save_interval=60, kill_save_interval=40,
    kill_delay_s=0.5, inprocess_fault_iteration=150, straggler_iters=40, straggler_slow_from=31,
    straggler_slow_s=0.3, rerun_iters=30, rerun_nan_iteration=20,
    # 12 x 2048 (670M parameters), 8 x 1024 tokens a step: about 33 TFLOP, 150-200 ms on an H100 or H200.
    step_model=("--num-layers", "12", "--hidden-size", "2048", "--num-attention-heads", "16",
                "--seq-length", "1024", "--max-position-embeddings", "1024",
                "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000"),
    step_micro_batch=8, step_rounds=3, step_warmup=10, step_iters=30, te_iters=60,
    launch_timeout_s=120.0, budget_s=560.0)

DRY_RUN = Profile(
    name="dry-run",
    model=("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
           "--max-position-embeddings", "32", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"),
    backend="gloo", micro_batch=2, train_iters=12, log_interval=1, save_interval=3, kill_save_interval=2,
    kill_delay_s=0.0, inprocess_fault_iteration=7, straggler_iters=8, straggler_slow_from=5,
    straggler_slow_s=0.2, rerun_iters=6, rerun_nan_iteration=4,
    # One round, not three: the code is the same, and each launch costs CI a rank's start-up.
    step_model=("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                "--seq-length", "32", "--max-position-embeddings", "32",
                "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"),
    step_micro_batch=2, step_rounds=1, step_warmup=2, step_iters=4, te_iters=12,
    # About 90 s of CPU time: a minute or two on 2 idle cores; the budget only guards against a hang, since a
    # loaded CI machine can take several times as long.
    launch_timeout_s=90.0, budget_s=600.0)
