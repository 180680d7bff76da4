"""Batch sizes, iterations, optimizer, learning-rate schedule and loop housekeeping flags (Megatron-LM
names and defaults)."""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import itertools
import os
import sys

from megatron_resil import batch_schedule
from megatron_resil.arguments.errors import ArgumentError
from megatron_resil.arguments.flag_table import Flag, add_flags, config_fields, warn

OC = "OptimizerConfig"

FLAGS = (
    Flag("--micro-batch-size", None, int),
    Flag("--global-batch-size", None, int, "default: micro batch size x data-parallel size"),
    Flag("--train-iters", None, int, "iterations to train (or give --train-samples)"),
    Flag("--train-samples", None, int, "samples to train, instead of --train-iters: the run takes "
         "train-samples // global-batch-size iterations and counts its schedule in samples"),
    Flag("--step-batch-size-schedule", None, str,
         'the global batch size by tokens consumed, instead of --global-batch-size: "0:384 200B:768" trains '
         "with 384 until 200 billion tokens (suffixes K, M, B, T), then with 768"),
    Flag("--rampup-batch-size", None, int, nargs="+", refuse="deprecated in Megatron-LM, which now ignores "
         "it (a fixed batch); give the ramp as --step-batch-size-schedule"),
    Flag("--eval-interval", 1000, int),
    Flag("--eval-iters", 100, int),
    Flag("--eval-global-batch-size", None, int, "evaluation's global batch size (default: "
         "--global-batch-size, which is micro batch x data-parallel size with --step-batch-size-schedule)"),
    Flag("--exit-interval", None, int, "save and exit when the iteration number is a multiple of this"),
    Flag("--exit-duration-in-mins", None, float, "save and exit after this many minutes of training"),
    Flag("--seed", 1234, int),
    Flag("--optimizer", "adam", str, choices=("adam", "sgd", "muon", "dist_muon", "lion", "soap",
                                              "adaptive_muon"),
         help="adam, sgd or muon (megatron-core's Muon: needs the emerging_optimizers package; "
              "dist_muon is Megatron-LM's deprecated name of muon with --use-distributed-optimizer)"),
    Flag("--lr", None, float, to=OC),
    Flag("--min-lr", 0.0, float, to=OC),
    Flag("--decoupled-lr", None, float, "learning rate of the input and output layers (default: --lr)",
         to=OC),
    Flag("--decoupled-min-lr", None, float, "minimum learning rate of the input and output layers", to=OC),
    Flag("--lr-decay-style", "linear", str, choices=("constant", "linear", "cosine", "inverse-square-root",
                                                     "WSD")),
    Flag("--lr-decay-iters", None, int, "default: --train-iters"),
    Flag("--lr-decay-samples", None, int, "with --train-samples; default: --train-samples"),
    Flag("--lr-warmup-iters", 0, int),
    Flag("--lr-warmup-fraction", None, float, "warm up over this fraction of the decay (--lr-decay-iters or "
                                              "--lr-decay-samples)"),
    Flag("--lr-warmup-samples", 0, int, "with --train-samples"),
    Flag("--lr-warmup-init", 0.0, float),
    Flag("--lr-wsd-decay-iters", None, int),
    Flag("--lr-wsd-decay-samples", None, int, "with --train-samples: the WSD annealing phase, in samples"),
    Flag("--lr-wsd-decay-style", "exponential", str, choices=("exponential", "linear", "cosine")),
    Flag("--use-checkpoint-opt_param-scheduler", dest="use_checkpoint_opt_param_scheduler",
         help="on resume, take the schedule (learning rates, warmup, decay) from the checkpoint"),
    Flag("--override-opt_param-scheduler", dest="override_opt_param_scheduler",
         help="on resume, take the schedule from the command line, not from the checkpoint"),
    Flag("--weight-decay", 0.01, float, to=OC),
    Flag("--apply-wd-to-qk-layernorm", to=OC, help="apply weight decay to the query and key norms too"),
    Flag("--clip-grad", 1.0, float, to=OC),
    Flag("--adam-beta1", 0.9, float, to=OC),
    Flag("--adam-beta2", 0.999, float, to=OC),
    Flag("--adam-eps", 1e-8, float, to=OC),
    Flag("--sgd-momentum", 0.9, float, "momentum of --optimizer sgd", to=OC),
    # Muon (megatron-core's TensorParallelMuon on the 2-D weights, --muon-scalar-optimizer on the rest)
    Flag("--muon-momentum", 0.9, float, "momentum of --optimizer muon", to=OC),
    Flag("--muon-no-split-qkv", True, dest="muon_split_qkv", to=OC,
         help="orthogonalize the fused query-key-value weight whole, not as its three parts"),
    Flag("--muon-nesterov", to=OC, help="Nesterov momentum in Muon's internal SGD"),
    Flag("--muon-scale-mode", "spectral", str, choices=("spectral", "unit_rms_norm", "shape_scaling"),
         to=OC),
    Flag("--muon-fp32-matmul-prec", "medium", str, choices=("low", "medium", "high"),
         help="fp32 matmul precision of the Newton-Schulz iteration", to=OC),
    Flag("--muon-coefficient-type", "quintic", str, "Newton-Schulz coefficients (the installed "
         "emerging_optimizers' types, e.g. simple, quintic, polar_express, aol)", to=OC),
    Flag("--muon-num-ns-steps", 5, int, "Newton-Schulz steps", to=OC),
    Flag("--muon-tp-mode", "duplicated", str, choices=("blockwise", "duplicated", "distributed"),
         help="how tensor-parallel weights are orthogonalized: blockwise (each shard), duplicated or "
              "distributed (the whole matrix)", to=OC),
    Flag("--muon-use-syrk", to=OC, gpu="only selects a Triton kernel for the Gram matrix"),
    Flag("--muon-extra-scale-factor", 1.0, float, "extra scale of the Muon update", to=OC),
    Flag("--muon-scalar-optimizer", "adam", str, choices=("adam", "lion"),
         help="optimizer of the parameters Muon leaves out (embeddings, biases, norms)", to=OC),
    Flag("--lion-beta1", 0.95, float, "with --muon-scalar-optimizer lion", to=OC),
    Flag("--lion-beta2", 0.98, float, "with --muon-scalar-optimizer lion", to=OC),
    Flag("--no-use-layer-wise-param-layout", True,
         help="muon with --use-distributed-optimizer: Megatron-LM's legacy layout (every parameter in "
              "the layer-wise optimizer, gathered by all-gather) instead of the shard-aligned one"),
    # Loop housekeeping
    Flag("--manual-gc", help="turn off Python's automatic garbage collection; collect every "
                             "--manual-gc-interval iterations, and around evaluation and checkpoints"),
    Flag("--manual-gc-interval", 0, int, "with --manual-gc: collect every N iterations (0: only around "
                                         "evaluation and checkpoints)"),
    Flag("--no-manual-gc-eval", True, dest="manual_gc_eval",
         help="with --manual-gc: do not collect before and after evaluation"),
    Flag("--check-weight-hash-across-dp-replicas-interval", None, int,
         "before training and every N iterations, compare a hash of the weights across data-parallel "
         "replicas; a mismatch is one decision line, then by --rerun-mode: validate_results stops without "
         "saving (exit 17), report_stats reports and trains on, disabled raises as Megatron-LM does"),
    Flag("--test-mode", to="TransformerConfig", help="Megatron-LM's real-time tests alongside training"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "training", FLAGS)


def validate(args: argparse.Namespace, world_size: int) -> None:
    _validate_schedule(args)
    if args.micro_batch_size is None:
        raise ArgumentError("--micro-batch-size is required")
    if args.micro_batch_size <= 0:
        raise ArgumentError("--micro-batch-size must be positive")
    _validate_optimizer(args)
    if args.lr is None:
        raise ArgumentError("--lr is required")
    if args.min_lr > args.lr:
        raise ArgumentError(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        raise ArgumentError("--decoupled-min-lr needs --decoupled-lr")
    if args.use_checkpoint_opt_param_scheduler and args.override_opt_param_scheduler:
        raise ArgumentError("--use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler "
                            "contradict each other; pick one")
    if args.eval_interval is not None and args.eval_interval <= 0:
        raise ArgumentError("--eval-interval must be positive")
    if args.eval_iters < 0:
        raise ArgumentError("--eval-iters must not be negative")
    if args.exit_interval is not None and args.exit_interval <= 0:
        raise ArgumentError("--exit-interval must be positive")
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins <= 0:
        raise ArgumentError("--exit-duration-in-mins must be positive")
    if args.clip_grad < 0:
        raise ArgumentError("--clip-grad must not be negative (0 disables clipping)")
    if args.manual_gc_interval < 0:
        raise ArgumentError("--manual-gc-interval must not be negative")
    interval = args.check_weight_hash_across_dp_replicas_interval
    if interval is not None and interval <= 0:
        raise ArgumentError("--check-weight-hash-across-dp-replicas-interval must be positive")


def _validate_optimizer(args: argparse.Namespace) -> None:
    """Megatron-LM's emerging-optimizer rules (validate_args): Muon with --use-distributed-optimizer (or
    by its deprecated name dist_muon) is megatron-core's layer-wise distributed optimizer, and the plain
    distributed optimizer is off; Muon saves with torch_dist."""
    args.use_layer_wise_distributed_optimizer = False
    if args.optimizer in ("adam", "sgd"):
        return
    if args.optimizer not in ("muon", "dist_muon"):
        raise ArgumentError(f"--optimizer {args.optimizer}: not supported here yet (of Megatron-LM's "
                            "emerging optimizers, muon is); use adam, sgd or muon")
    if missing := muon_support_missing():
        raise ArgumentError(f"--optimizer {args.optimizer} needs megatron-core 0.19 or later and the "
                            f"emerging_optimizers package, which needs Python 3.12 or later ({missing}): "
                            "pip install emerging-optimizers==0.3.0 on Python 3.12, or use adam or sgd")
    if args.optimizer == "dist_muon":
        warn("--optimizer dist_muon is deprecated (as in Megatron-LM): use --optimizer muon "
             "--use-distributed-optimizer instead")
        args.optimizer = "muon"
        args.use_layer_wise_distributed_optimizer = True
    if args.use_distributed_optimizer:
        args.use_layer_wise_distributed_optimizer = True
        args.use_distributed_optimizer = False
    if args.fp16:
        raise ArgumentError("--optimizer muon does not support --fp16 (megatron-core's emerging "
                            "optimizers); use --bf16")
    if args.ckpt_format != "torch_dist":
        raise ArgumentError(f"--optimizer muon with --ckpt-format {args.ckpt_format}: Muon's optimizer "
                            "state saves with --ckpt-format torch_dist only (Megatron-LM: torch or "
                            "torch_dist); use --ckpt-format torch_dist")
    if args.muon_num_ns_steps < 1:
        raise ArgumentError(f"--muon-num-ns-steps {args.muon_num_ns_steps} must be at least 1")
    types = muon_coefficient_types()
    if types and args.muon_coefficient_type not in types:
        raise ArgumentError(f"--muon-coefficient-type {args.muon_coefficient_type}: the installed "
                            f"emerging_optimizers has {', '.join(types)}")
    if (args.muon_scalar_optimizer == "lion" and args.use_layer_wise_distributed_optimizer
            and args.use_layer_wise_param_layout):
        raise ArgumentError("--muon-scalar-optimizer lion with --use-distributed-optimizer: Lion's "
                            "parameters would live in megatron-core's distributed optimizer, whose "
                            "checkpoint reads Adam's per-parameter step, which Lion does not keep "
                            "(megatron-core 0.19); use --muon-scalar-optimizer adam, or add "
                            "--no-use-layer-wise-param-layout")
    if args.use_layer_wise_distributed_optimizer and args.num_distributed_optimizer_instances > 1:
        raise ArgumentError("--num-distributed-optimizer-instances > 1 is not supported with --optimizer "
                            "muon --use-distributed-optimizer (megatron-core's layer-wise optimizer shards "
                            "over the whole data-parallel group)")


def muon_support_missing() -> str:
    """What this installation lacks for megatron-core's Muon, as a clause ("" when nothing): a megatron-core
    whose optimizer factory builds emerging optimizers (0.19: its OptimizerConfig has
    use_layer_wise_distributed_optimizer) and emerging_optimizers 0.2 or later, both looked up without
    importing them."""
    missing = []
    if "use_layer_wise_distributed_optimizer" not in config_fields(OC):
        missing.append(f"installed: megatron-core {_version('megatron-core')}")
    version = _version("emerging-optimizers")
    if version is None:
        missing.append("emerging_optimizers is not installed")
    elif tuple(int(part) for part in version.split(".")[:2] if part.isdigit()) < (0, 2):
        missing.append(f"installed: emerging-optimizers {version}, need 0.2 or later")
    if missing:
        missing.append(f"Python {sys.version_info.major}.{sys.version_info.minor}")
    return "; ".join(missing)


def muon_coefficient_types() -> tuple[str, ...]:
    """The Newton-Schulz coefficient types of the installed emerging_optimizers (its NSCoeffT, read from
    its source as megatron-core reads them at run time), except "custom", whose coefficient sets
    megatron-core does not pass; () where the source does not say."""
    spec = importlib.util.find_spec("emerging_optimizers")
    if spec is None or not spec.submodule_search_locations:
        return ()
    path = os.path.join(next(iter(spec.submodule_search_locations)), "orthogonalized_optimizers",
                        "muon_utils.py")
    try:
        with open(path) as source:
            tree = ast.parse(source.read())
    except OSError:
        return ()
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "NSCoeffT" for t in node.targets)
                and isinstance(node.value, ast.Subscript)):
            names = node.value.slice.elts if isinstance(node.value.slice, ast.Tuple) else [node.value.slice]
            return tuple(n.value for n in names if isinstance(n, ast.Constant) and n.value != "custom")
    return ()


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


# The schedule's flags, in iterations and in samples; a run uses the unit its length is given in.
SCHEDULE_FLAGS = ("--lr-decay-{}", "--lr-warmup-{}", "--lr-wsd-decay-{}")


def _value(args: argparse.Namespace, flag: str):
    return getattr(args, flag[2:].replace("-", "_"))


def _validate_schedule(args: argparse.Namespace) -> None:
    """Megatron-LM's rules (validate_args): the run's length in iterations or in samples, and its
    learning-rate schedule in the same unit. The default decay is the whole run."""
    if args.train_iters is not None and args.train_samples is not None:
        raise ArgumentError("give --train-iters or --train-samples, not both (as in Megatron-LM)")
    if args.train_iters is None and args.train_samples is None:
        raise ArgumentError("--train-iters or --train-samples is required")
    unit, other = ("samples", "iters") if args.train_samples is not None else ("iters", "samples")
    total, decay, warmup, wsd = f"--train-{unit}", *(flag.format(unit) for flag in SCHEDULE_FLAGS)
    for flag in SCHEDULE_FLAGS:
        if _value(args, flag.format(other)) not in (None, 0):
            raise ArgumentError(f"{flag.format(other)} with {total}: give {flag.format(unit)} instead (as in "
                                f"Megatron-LM, the schedule counts in the unit of the run's length)")
    if _value(args, total) <= 0:
        raise ArgumentError(f"{total} must be positive")
    if _value(args, decay) is None:
        setattr(args, decay[2:].replace("-", "_"), _value(args, total))
    if _value(args, decay) <= 0:
        raise ArgumentError(f"{decay} must be positive")
    if _value(args, warmup) < 0:
        raise ArgumentError(f"{warmup} must not be negative")
    if args.lr_warmup_fraction is not None:
        if _value(args, warmup):
            raise ArgumentError(f"give --lr-warmup-fraction or {warmup}, not both (as in Megatron-LM)")
        if not 0.0 <= args.lr_warmup_fraction < 1.0:
            raise ArgumentError(f"--lr-warmup-fraction {args.lr_warmup_fraction} must be in [0, 1)")
    if _value(args, warmup) >= _value(args, decay):  # megatron-core's scheduler requires this
        raise ArgumentError(f"{warmup} {_value(args, warmup)} must be smaller than {decay} "
                            f"{_value(args, decay)} (default: {total})")
    if args.lr_decay_style == "WSD" and _value(args, wsd) is None:
        raise ArgumentError(f"--lr-decay-style WSD needs {wsd}")
    if _value(args, wsd) is not None and _value(args, wsd) <= 0:
        raise ArgumentError(f"{wsd} must be positive")


def validate_batch_sizes(args: argparse.Namespace, data_parallel_size: int) -> None:
    """Called by distributed.validate once the data-parallel size is known. As Megatron-LM: with
    --step-batch-size-schedule, --global-batch-size keeps its default (micro batch size x data-parallel size,
    which the iteration-counted schedule flags and evaluation use); the steps take the schedule's sizes."""
    per_step = args.micro_batch_size * data_parallel_size
    stepped = args.step_batch_size_schedule is not None
    if stepped and args.global_batch_size is not None:
        raise ArgumentError("give --step-batch-size-schedule or --global-batch-size, not both (as in "
                            "Megatron-LM)")
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    if args.global_batch_size <= 0 or args.global_batch_size % per_step:
        raise ArgumentError(
            f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {data_parallel_size}")
    if stepped:
        _validate_step_schedule(args, per_step, data_parallel_size)
    args.num_microbatches = batch_schedule.global_batch_size(args, 0) // per_step
    if args.eval_global_batch_size is None:
        args.eval_global_batch_size = args.global_batch_size
    if args.eval_global_batch_size <= 0 or args.eval_global_batch_size % per_step:
        raise ArgumentError(
            f"--eval-global-batch-size {args.eval_global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {data_parallel_size}")
    if args.train_samples is not None:  # Megatron-LM's update_train_iters
        args.train_iters = batch_schedule.schedule(args).iterations(args.train_samples) if stepped \
            else args.train_samples // args.global_batch_size
        if args.train_iters == 0:
            raise ArgumentError(f"--train-samples {args.train_samples} is less than one global batch "
                                f"(--global-batch-size {args.global_batch_size}): nothing to train")


def _validate_step_schedule(args: argparse.Namespace, per_step: int, data_parallel_size: int) -> None:
    """The schedule's format (megatron-core's rules), and what Megatron-LM asserts only when a step reaches
    the entry: every size divides into microbatches, and the number of microbatches never decreases."""
    shown = f"--step-batch-size-schedule {args.step_batch_size_schedule!r}"
    try:
        steps = batch_schedule.schedule(args).steps
    except ValueError as err:
        raise ArgumentError(f"{shown}: {err}") from None
    for (_, before), (_, after) in itertools.pairwise(steps):
        if after < before:
            raise ArgumentError(f"{shown}: the batch size goes down from {before} to {after}; Megatron-LM "
                                "stops there (the number of microbatches must not decrease)")
    for _, batch in steps:
        if batch % per_step:
            raise ArgumentError(f"{shown}: batch size {batch} is not divisible by --micro-batch-size "
                                f"{args.micro_batch_size} x data-parallel size {data_parallel_size}")
