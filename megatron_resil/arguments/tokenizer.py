"""Tokenizer flags (Megatron-LM's names and defaults) and the start-up check of what they name: the rows
are shared by pretrain.py (through arguments/data.py) and tools/preprocess_data.py, so both read a
tokenizer from the same command line and tokenize alike."""

from __future__ import annotations

import argparse
import os

from megatron_resil.arguments.errors import ArgumentError
from megatron_resil.arguments.flag_table import Flag, warn
from megatron_resil.tokenizer_files import (
    SENTENCEPIECE_TYPES,
    TIKTOKEN_DEFAULT_VOCAB_SIZE,
    GPT2BPETokenizer,
    TokenizerFileError,
    check_huggingface_tokenizer,
    check_sentencepiece_model,
    check_tiktoken_vocab,
)

BUILT_TOKENIZERS = ("NullTokenizer", "ByteTokenizer", "GPT2BPETokenizer", *SENTENCEPIECE_TYPES,
                    "HuggingFaceTokenizer", "TikTokenizer")
# Megatron-LM's tokenizer types; those not in BUILT_TOKENIZERS are refused at start-up.
MEGATRON_TOKENIZERS = ("BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer",
                       "SentencePieceTokenizer",
                       "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer",
                       "MultimodalTokenizer", "NullTokenizer", "NullMultimodalTokenizer", "SFTTokenizer")
# Types that read --tokenizer-special-tokens (Megatron-LM's: NullTokenizer and ByteTokenizer have no text to
# split at them).
_SPECIAL_TOKEN_TYPES = ("GPT2BPETokenizer", *SENTENCEPIECE_TYPES, "HuggingFaceTokenizer", "TikTokenizer")

TYPE_FLAG = Flag(
    "--tokenizer-type", None, str, choices=("ByteTokenizer", *MEGATRON_TOKENIZERS),
    help="default: GPT2BPETokenizer with --vocab-file and --merge-file (Megatron-LM's pretrain_gpt.py), "
         "else NullTokenizer. Built here: " + ", ".join(BUILT_TOKENIZERS))
FLAGS = (
    TYPE_FLAG,
    Flag("--vocab-size", None, int,
         "NullTokenizer: vocabulary size before EOD and padding; TikTokenizer: the vocabulary with its "
         f"special tokens (default {TIKTOKEN_DEFAULT_VOCAB_SIZE})"),
    Flag("--vocab-file", None, str, "the tokenizer's vocabulary file (GPT2BPETokenizer: GPT-2's vocab.json)"),
    Flag("--merge-file", None, str, "the BPE merges file (GPT2BPETokenizer: GPT-2's merges.txt)"),
    Flag("--tokenizer-model", None, str,
         "SentencePiece: the .model file; HuggingFaceTokenizer: the tokenizer's directory "
         "(save_pretrained's), or a hub name already in the local Hugging Face cache (nothing is "
         "downloaded); TikTokenizer: Megatron's tiktoken vocabulary (.json)"),
    Flag("--tokenizer-special-tokens", None, str, nargs="+",
         help="TikTokenizer: its special tokens (must include <unk> <s> </s> <mask> <pad> <cls> <sep>); "
              "GPT2BPETokenizer, HuggingFaceTokenizer: additional special tokens (those not in the "
              "vocabulary take the next ids, in order); SentencePiece types: the same, with "
              "--tokenizer-sentencepiece-legacy"),
    Flag("--tokenizer-sentencepiece-legacy",
         help="SentencePiece types: megatron-core's legacy wrapper, the one that takes "
              "--tokenizer-special-tokens (without them it tokenizes as the default one)"),
    Flag("--tiktoken-pattern", None, str, choices=("v1", "v2"),
         help="TikTokenizer's pre-tokenizing pattern (default v2, megatron-core's)"),
    Flag("--tiktoken-num-special-tokens", 1000, int,
         "TikTokenizer: ids reserved for special tokens before the vocabulary's own"),
    Flag("--tiktoken-special-tokens", None, str, nargs="+",
         help="deprecated in Megatron-LM for --tokenizer-special-tokens, and read the same way"),
    # Megatron-LM 0.16 spelt the HF switches as opt-ins; since 0.17 they are opt-outs of the same behaviour.
    Flag("--tokenizer-hf-use-fast", help="HuggingFaceTokenizer: the fast tokenizer (the default)"),
    Flag("--tokenizer-hf-no-use-fast", help="HuggingFaceTokenizer: ask for the slow tokenizer"),
    Flag("--tokenizer-hf-include-special-tokens",
         help="HuggingFaceTokenizer: text to ids adds the tokenizer's own special tokens, such as a BOS "
              "(the default)"),
    Flag("--tokenizer-hf-no-include-special-tokens",
         help="HuggingFaceTokenizer: text to ids without them (Megatron-LM 0.16's default)"),
    Flag("--trust-remote-code", help="HuggingFaceTokenizer: run code the tokenizer directory ships"),
)


def validate(args: argparse.Namespace) -> None:
    """Settle the tokenizer type and check what it reads, so a wrong file stops start-up with one line."""
    for flag in ("--vocab-file", "--merge-file"):
        path = getattr(args, flag[2:].replace("-", "_"))
        if path is not None and not os.path.isfile(path):
            raise ArgumentError(f"{flag} {path}: no such file")
    chosen = f"--tokenizer-type {args.tokenizer_type}"
    if args.tokenizer_type is None:
        args.tokenizer_type = "GPT2BPETokenizer" if args.vocab_file and args.merge_file else "NullTokenizer"
        chosen = ("--vocab-file with --merge-file (GPT2BPETokenizer, pretrain_gpt.py's default "
                  "--tokenizer-type)")
    if args.tokenizer_type not in BUILT_TOKENIZERS:
        raise ArgumentError(f"{chosen}: {args.tokenizer_type} is not built here (built: "
                            f"{', '.join(BUILT_TOKENIZERS)})")
    if args.tiktoken_special_tokens and not args.tokenizer_special_tokens:
        warn("--tiktoken-special-tokens is deprecated in Megatron-LM; use --tokenizer-special-tokens")
        args.tokenizer_special_tokens = args.tiktoken_special_tokens
    if args.tokenizer_special_tokens and args.tokenizer_type not in _SPECIAL_TOKEN_TYPES:
        raise ArgumentError(f"--tokenizer-special-tokens: {args.tokenizer_type} takes no special tokens "
                            f"(read by {', '.join(_SPECIAL_TOKEN_TYPES)}); drop it")
    if args.tokenizer_sentencepiece_legacy and args.tokenizer_type not in SENTENCEPIECE_TYPES:
        warn(f"--tokenizer-sentencepiece-legacy: read by SentencePiece types only; {args.tokenizer_type} "
             "ignores it, as in Megatron-LM")
    if (args.tokenizer_special_tokens and args.tokenizer_type in SENTENCEPIECE_TYPES
            and not args.tokenizer_sentencepiece_legacy):
        # megatron-core's SentencePiece wrapper refuses special tokens unless legacy (Megatron-LM alike).
        raise ArgumentError(f"--tokenizer-special-tokens with {args.tokenizer_type} needs "
                            "--tokenizer-sentencepiece-legacy (megatron-core adds special tokens to a "
                            "SentencePiece model only in its legacy wrapper)")
    if args.vocab_size is not None and args.tokenizer_type not in ("NullTokenizer", "TikTokenizer"):
        raise ArgumentError(f"--vocab-size: {args.tokenizer_type} has a fixed vocabulary; drop --vocab-size")
    if args.tokenizer_type == "HuggingFaceTokenizer" and (args.vocab_file or args.merge_file):
        # Megatron-LM hands them to AutoTokenizer as overrides; megatron-core 0.16 misspells the merges one.
        raise ArgumentError("--vocab-file/--merge-file: HuggingFaceTokenizer reads the files of its "
                            "--tokenizer-model directory here; drop them")
    model = args.tokenizer_model
    if args.tokenizer_type in (*SENTENCEPIECE_TYPES, "TikTokenizer", "HuggingFaceTokenizer") and not model:
        raise ArgumentError(f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model")
    try:
        _check_files(args)
    except TokenizerFileError as err:
        raise ArgumentError(str(err)) from None


def _check_files(args: argparse.Namespace) -> None:
    kind, model = args.tokenizer_type, args.tokenizer_model
    if kind == "NullTokenizer":
        if args.vocab_size is None:
            raise ArgumentError("--tokenizer-type NullTokenizer needs --vocab-size")
        if args.vocab_size <= 1:
            raise ArgumentError("--vocab-size must be at least 2")
    elif kind == "GPT2BPETokenizer":
        if not (args.vocab_file and args.merge_file):
            raise ArgumentError("--tokenizer-type GPT2BPETokenizer needs --vocab-file (vocab.json) and "
                                "--merge-file (merges.txt)")
        GPT2BPETokenizer(args.vocab_file, args.merge_file)  # read once here: a wrong file is one line
    elif kind in SENTENCEPIECE_TYPES:
        _must_be_file(model)
        check_sentencepiece_model(model)
    elif kind == "TikTokenizer":
        _must_be_file(model)
        check_tiktoken_vocab(model, args.vocab_size, args.tiktoken_num_special_tokens,
                             args.tokenizer_special_tokens)
    elif kind == "HuggingFaceTokenizer":
        check_huggingface_tokenizer(model, args.trust_remote_code)


def _must_be_file(path: str) -> None:
    if not os.path.isfile(path):
        raise TokenizerFileError(f"--tokenizer-model {path}: no such file")
    if not os.access(path, os.R_OK):
        raise TokenizerFileError(f"--tokenizer-model {path}: not readable (permissions)")
