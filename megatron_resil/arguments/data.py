"""Data and tokenizer flags (Megatron-LM names)."""

from __future__ import annotations

import argparse
import os
import re

from megatron_resil.arguments import tokenizer as tokenizer_args
from megatron_resil.arguments.errors import ArgumentError
from megatron_resil.arguments.flag_table import Flag, add_flags

# The tokenizer's rows and checks are arguments/tokenizer.py's (preprocess_data reads them too).
from megatron_resil.arguments.tokenizer import BUILT_TOKENIZERS, MEGATRON_TOKENIZERS  # noqa: F401

_SPLIT_WEIGHT = re.compile(r"\d+(\.\d*)?|\.\d+")
NO_EFFECT = "accepted; it does not change what is trained here: "

FLAGS = (
    Flag("--mock-data", help="train on megatron-core's MockGPTDataset (no files needed)"),
    Flag("--data-path", None, str, nargs="*",
         help="indexed dataset prefix(es), optionally weighted: [w1] prefix1 [w2] prefix2 ..."),
    Flag("--split", "969, 30, 1", str, "train, validation and test weights, e.g. 949,50,1"),
    Flag("--data-cache-path", None, str,
         "where dataset index caches go (default: <save>/data_cache, else none)"),
    Flag("--no-mmap-bin-files", True, help="read the .bin files instead of memory-mapping them"),
    Flag("--num-workers", 2, int, NO_EFFECT + "every rank reads its memory-mapped samples in the training "
                                  "process, no DataLoader workers"),
    Flag("--no-create-attention-mask-in-dataloader", True, dest="create_attention_mask_in_dataloader",
         help=NO_EFFECT + "the model gets no mask and attends causally (what the mask would say)"),
    Flag("--fim-data", refuse="fill-in-the-middle datasets are not supported here; drop --fim-data"),
    Flag("--fim-rate", 0.5, float, "share of samples turned into fill-in-the-middle ones (with --fim-data)"),
    Flag("--fim-spm-rate", 0.5, float, "share of those in SPM rather than PSM order (with --fim-data)"),
    *tokenizer_args.FLAGS,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "data", FLAGS)


def _prefixes(data_path: list[str]) -> list[str]:
    """Megatron accepts 'prefix' or 'weight prefix weight prefix ...'."""
    if len(data_path) % 2 == 0:
        try:
            [float(x) for x in data_path[0::2]]
            return data_path[1::2]
        except ValueError:
            pass
    return data_path


def validate(args: argparse.Namespace, world_size: int) -> None:
    if args.mock_data and args.data_path:
        raise ArgumentError("--mock-data and --data-path are mutually exclusive; pick one")
    if not args.mock_data and not args.data_path:
        raise ArgumentError("no training data: pass --data-path PREFIX or --mock-data")
    for prefix in _prefixes(args.data_path or []):
        for suffix in (".bin", ".idx"):
            if not os.path.isfile(prefix + suffix):
                raise ArgumentError(
                    f"--data-path {prefix}: {prefix + suffix} not found; build it with "
                    f"python -m megatron_resil.tools.preprocess_data")
    _validate_split(args)
    tokenizer_args.validate(args)


def _validate_split(args: argparse.Namespace) -> None:
    # Launch scripts that expand "--split '99,1,0'" unquoted pass the quotes on; megatron-core's
    # parse_and_normalize_split (re.findall(r"[.0-9]+")) reads past them, and so do we.
    args.split = args.split.strip().strip("'\"")
    pieces = [p.strip() for p in args.split.replace("/", ",").split(",") if p.strip()]
    if not all(_SPLIT_WEIGHT.fullmatch(p) for p in pieces):
        raise ArgumentError(f"--split {args.split!r} must be comma-separated plain numbers, e.g. 969,30,1")
    parts = [float(p) for p in pieces]
    if not parts or len(parts) > 3 or sum(parts) <= 0:
        raise ArgumentError(f"--split {args.split!r} must be up to three non-negative weights")

