"""Data and tokenizer flags (Megatron-LM names)."""

from __future__ import annotations

import argparse
import os
import re

from megatron_resil.arguments.errors import ArgumentError

TOKENIZERS = ("NullTokenizer", "ByteTokenizer")
_SPLIT_WEIGHT = re.compile(r"\d+(\.\d*)?|\.\d+")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true",
                   help="train on megatron-core's MockGPTDataset (no files needed)")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="indexed dataset prefix(es), optionally weighted: [w1] prefix1 [w2] prefix2 ...")
    g.add_argument("--split", default="969, 30, 1")
    g.add_argument("--data-cache-path", default=None,
                   help="where dataset index caches go (default: <save>/data_cache, else none)")
    g.add_argument("--tokenizer-type", choices=TOKENIZERS, default="NullTokenizer")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="vocabulary size for NullTokenizer")


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
    # Exactly what megatron-core's parse_and_normalize_split reads (re.findall(r"[.0-9]+")).
    pieces = [p.strip() for p in args.split.replace("/", ",").split(",") if p.strip()]
    if not all(_SPLIT_WEIGHT.fullmatch(p) for p in pieces):
        raise ArgumentError(f"--split {args.split!r} must be comma-separated plain numbers, e.g. 969,30,1")
    parts = [float(p) for p in pieces]
    if not parts or len(parts) > 3 or sum(parts) <= 0:
        raise ArgumentError(f"--split {args.split!r} must be up to three non-negative weights")
    if args.tokenizer_type == "NullTokenizer":
        if args.vocab_size is None:
            raise ArgumentError("--tokenizer-type NullTokenizer needs --vocab-size")
        if args.vocab_size <= 1:
            raise ArgumentError("--vocab-size must be at least 2")
    elif args.vocab_size is not None:
        raise ArgumentError(f"--vocab-size applies to NullTokenizer only, not {args.tokenizer_type}")
