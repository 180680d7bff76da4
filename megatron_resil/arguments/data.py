"""Data and tokenizer flags (Megatron-LM names)."""

from __future__ import annotations

import argparse
import os
import re

from megatron_resil.arguments.errors import ArgumentError
from megatron_resil.arguments.flag_table import Flag, add_flags
from megatron_resil.tokenizer_files import (
    SENTENCEPIECE_TYPES,
    GPT2BPETokenizer,
    TokenizerFileError,
    check_sentencepiece_model,
)

BUILT_TOKENIZERS = ("NullTokenizer", "ByteTokenizer", "GPT2BPETokenizer", *SENTENCEPIECE_TYPES)
# Megatron-LM's tokenizer types; those not in BUILT_TOKENIZERS are refused at start-up for now.
MEGATRON_TOKENIZERS = ("BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer",
                       "SentencePieceTokenizer",
                       "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer",
                       "MultimodalTokenizer", "NullTokenizer", "NullMultimodalTokenizer", "SFTTokenizer")
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
    # Tokenizer (ByteTokenizer is ours: raw bytes, no files)
    Flag("--tokenizer-type", None, str, choices=("ByteTokenizer", *MEGATRON_TOKENIZERS),
         help="default: GPT2BPETokenizer with --vocab-file and --merge-file (Megatron-LM's pretrain_gpt.py), "
              "else NullTokenizer. Built here so far: " + ", ".join(BUILT_TOKENIZERS)),
    Flag("--vocab-size", None, int, "vocabulary size before EOD and padding (NullTokenizer)"),
    Flag("--vocab-file", None, str, "the tokenizer's vocabulary file (GPT2BPETokenizer: GPT-2's vocab.json)"),
    Flag("--merge-file", None, str, "the BPE merges file (GPT2BPETokenizer: GPT-2's merges.txt)"),
    Flag("--tokenizer-model", None, str, "the tokenizer model (SentencePiece: the .model file)"),
    Flag("--tiktoken-pattern", None, str, choices=("v1", "v2"), help="TikTokenizer's pattern"),
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
    _validate_tokenizer(args)


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


def _validate_tokenizer(args: argparse.Namespace) -> None:
    for flag in ("--vocab-file", "--merge-file", "--tokenizer-model"):
        path = getattr(args, flag[2:].replace("-", "_"))
        if path is not None and not os.path.isfile(path):
            raise ArgumentError(f"{flag} {path}: no such file")
    chosen = f"--tokenizer-type {args.tokenizer_type}"
    if args.tokenizer_type is None:
        args.tokenizer_type = "GPT2BPETokenizer" if args.vocab_file and args.merge_file else "NullTokenizer"
        chosen = ("--vocab-file with --merge-file (GPT2BPETokenizer, pretrain_gpt.py's default "
                  "--tokenizer-type)")
    if args.tokenizer_type not in BUILT_TOKENIZERS:
        raise ArgumentError(f"{chosen}: {args.tokenizer_type} is not built yet here (built: "
                            f"{', '.join(BUILT_TOKENIZERS)}); train with --tokenizer-type NullTokenizer "
                            "--vocab-size N on pre-tokenized data for now")
    if args.tokenizer_type == "NullTokenizer":
        if args.vocab_size is None:
            raise ArgumentError("--tokenizer-type NullTokenizer needs --vocab-size")
        if args.vocab_size <= 1:
            raise ArgumentError("--vocab-size must be at least 2")
    elif args.tokenizer_type == "GPT2BPETokenizer":
        if not (args.vocab_file and args.merge_file):
            raise ArgumentError("--tokenizer-type GPT2BPETokenizer needs --vocab-file (vocab.json) and "
                                "--merge-file (merges.txt)")
        try:  # the files are read once here, so a wrong one stops start-up with one line
            GPT2BPETokenizer(args.vocab_file, args.merge_file)
        except TokenizerFileError as err:
            raise ArgumentError(str(err)) from None
    elif args.tokenizer_type in SENTENCEPIECE_TYPES:
        if not args.tokenizer_model:
            raise ArgumentError(f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model (the "
                                "SentencePiece .model file)")
        try:
            check_sentencepiece_model(args.tokenizer_model)
        except TokenizerFileError as err:
            raise ArgumentError(str(err)) from None
    if args.vocab_size is not None and args.tokenizer_type != "NullTokenizer":
        raise ArgumentError(f"--vocab-size: {args.tokenizer_type} has a fixed vocabulary; drop --vocab-size")
