"""The tokenizers under Megatron-LM's --tokenizer-type names: NullTokenizer, GPT2BPETokenizer
(tokenizer_files.py), SentencePieceTokenizer (and GPTSentencePieceTokenizer, Llama2Tokenizer, which
Megatron-LM builds the same way), and a UTF-8 byte tokenizer that needs no files.

All expose what training and megatron-core's datasets read: `vocab_size` (unpadded), `eod`,
`tokenize`, `detokenize`, and `unique_identifiers` (hashed into the dataset index cache keys).
"""

from __future__ import annotations

import argparse
import inspect
from collections import OrderedDict
from collections.abc import Iterable

from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer as _CoreNullTokenizer
from megatron.core.tokenizers.text.libraries.sentencepiece_tokenizer import (
    SentencePieceTokenizer as _CoreSentencePieceTokenizer,
)

from megatron_resil.tokenizer_files import SENTENCEPIECE_TYPES, GPT2BPETokenizer, check_sentencepiece_model


class NullTokenizer:
    """megatron-core's NullTokenizer: text is integer ids; ids 0..N-1 are data, N is EOD.

    `vocab_size` is N + 1, as in Megatron-LM, so `--vocab-size N` leaves room for the EOD id.
    """

    def __init__(self, vocab_size: int) -> None:
        if "eod_id" in inspect.signature(_CoreNullTokenizer).parameters:
            # megatron-core 0.19 counts EOD inside vocab_size (EOD = N - 1): asked for N + 1 with EOD N, it
            # gives 0.16's (and Megatron-LM's) vocabulary, so models, data and checkpoints match across both.
            self._core = _CoreNullTokenizer(vocab_size + 1, eod_id=vocab_size)
        else:
            self._core = _CoreNullTokenizer(vocab_size)
        self.vocab_size: int = self._core.vocab_size
        self.eod: int = self._core.eod
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("vocab_size", self.vocab_size)])

    def tokenize(self, text: str) -> list[int]:
        # Megatron splits on single spaces; any whitespace accepts the same inputs and more.
        ids = self._core.tokens_to_ids(text.split())
        for token in ids:
            # Out-of-range ids would only surface later as an embedding index error mid-training.
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"token id {token} is outside [0, {self.vocab_size})")
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._core.ids_to_text([int(i) for i in ids])


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255 and EOD is 256."""

    def __init__(self) -> None:
        self.eod: int = 256
        self.vocab_size: int = 257
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("vocab_size", self.vocab_size)])

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int]) -> str:
        # EOD has no byte; a model's output may also split a multi-byte character.
        data = bytes(int(i) for i in ids if int(i) != self.eod)
        return data.decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    """megatron-core's SentencePiece tokenizer on --tokenizer-model: the model's pieces are the vocabulary
    and its end-of-sentence id is EOD, as in Megatron-LM."""

    def __init__(self, model_file: str) -> None:
        check_sentencepiece_model(model_file)  # a missing package or a wrong file: one line
        self._core = _CoreSentencePieceTokenizer(model_file)
        self.vocab_size: int = self._core.vocab_size
        self.eod: int = self._core.eod
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("tokenizer_model", model_file),
             ("vocab_size", self.vocab_size)])

    def tokenize(self, text: str) -> list[int]:
        return self._core.text_to_ids(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._core.ids_to_text([int(i) for i in ids])


Tokenizer = NullTokenizer | ByteTokenizer | GPT2BPETokenizer | SentencePieceTokenizer


def build_tokenizer(args: argparse.Namespace) -> Tokenizer:
    """Build the tokenizer named by `args.tokenizer_type` (NullTokenizer also reads `args.vocab_size`,
    GPT2BPETokenizer `args.vocab_file` and `args.merge_file`, SentencePiece `args.tokenizer_model`)."""
    if args.tokenizer_type == "NullTokenizer":
        if getattr(args, "vocab_size", None) is None:
            raise ValueError("NullTokenizer needs a vocab_size")
        return NullTokenizer(args.vocab_size)
    if args.tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    if args.tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(args.vocab_file, args.merge_file)
    if args.tokenizer_type in SENTENCEPIECE_TYPES:
        return SentencePieceTokenizer(args.tokenizer_model)
    raise ValueError(f"unknown tokenizer_type {args.tokenizer_type!r}")
