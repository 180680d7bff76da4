"""Data and tokenizer flags (Megatron-LM names)."""

from __future__ import annotations

import argparse
import os
import re

from megatron_resil.arguments import tokenizer as tokenizer_args
from megatron_resil.arguments.errors import ArgumentError
from megatron_resil.arguments.flag_table import Flag, add_flags, warn

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
    Flag("--fim-data", help="turn samples into fill-in-the-middle ones, as Megatron-LM's FIM dataset "
                            "(docs/running.md)"),
    Flag("--fim-rate", 0.5, float, "probability that a sample's piece is turned into a FIM one"),
    Flag("--fim-spm-rate", 0.5, float, "probability that a FIM piece is in SPM rather than PSM order"),
    Flag("--fim-split-sample", None, str, "a token to split pieces at into fragments, FIM'd one by one"),
    Flag("--fim-fragment-rate", None, float, "probability of FIM of each fragment (--fim-split-sample)"),
    Flag("--fim-no-prefix", None, str, "leave a piece whose text starts with this string as it is"),
    Flag("--fim-prefix-token", "<fim_prefix>", str, "the FIM prefix sentinel"),
    Flag("--fim-middle-token", "<fim_middle>", str, "the FIM middle sentinel"),
    Flag("--fim-suffix-token", "<fim_suffix>", str, "the FIM suffix sentinel"),
    Flag("--fim-pad-token", "<fim_pad>", str, "the token a FIM sample is padded with to its length"),
    Flag("--fim-eod-token", "<|endoftext|>", str, "the end-of-document token FIM splits samples at"),
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
    if args.fim_data:
        _validate_fim(args)


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



# Megatron-LM's FIM dataset reads text back with the tokenizer's ids_to_text(ids, remove_special_tokens=True),
# which megatron-core's SentencePiece wrapper does not take; NullTokenizer and ByteTokenizer name no tokens.
_FIM_TOKENIZERS = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "TikTokenizer")


def _validate_fim(args: argparse.Namespace) -> None:
    if args.mock_data:
        raise ArgumentError("--fim-data with --mock-data: Megatron-LM has no mock FIM dataset; train on "
                            "--data-path")
    for flag in ("--fim-rate", "--fim-spm-rate", "--fim-fragment-rate"):
        rate = getattr(args, flag[2:].replace("-", "_"))
        if rate is not None and not 0 <= rate <= 1:
            raise ArgumentError(f"{flag} {rate}: a probability, between 0 and 1")
    if args.fim_split_sample is not None and args.fim_fragment_rate is None:
        raise ArgumentError(f"--fim-split-sample {args.fim_split_sample} needs --fim-fragment-rate, the "
                            "probability of FIM for each fragment")
    if args.fim_fragment_rate is not None and args.fim_split_sample is None:
        warn(f"--fim-fragment-rate {args.fim_fragment_rate}: read only with --fim-split-sample; ignored, as "
             "in Megatron-LM")
    if args.tokenizer_type not in _FIM_TOKENIZERS:
        raise ArgumentError(f"--fim-data: --tokenizer-type {args.tokenizer_type} cannot make FIM samples "
                            f"(Megatron-LM's FIM dataset runs with {', '.join(_FIM_TOKENIZERS)})")
    # Imported here: building a tokenizer may import megatron-core's tokenizers (transformers, tiktoken).
    from megatron_resil import fim
    from megatron_resil.tokenizer import build_tokenizer
    from megatron_resil.tokenizer_files import TokenizerFileError

    try:
        tokenizer = build_tokenizer(args)
        _, unknown = fim.settings_from_args(args, tokenizer)
    except (fim.FIMTokenError, TokenizerFileError) as err:
        raise ArgumentError(str(err)) from None
    if unknown:
        warn(f"{', '.join(unknown)}: not in the {args.tokenizer_type} vocabulary, so, as in Megatron-LM, the "
             f"unknown token's id ({tokenizer.unk_id}) stands for each; add them with "
             "--tokenizer-special-tokens for sentinels of their own")
