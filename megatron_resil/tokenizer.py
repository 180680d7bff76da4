"""The tokenizers under Megatron-LM's --tokenizer-type names: NullTokenizer, GPT2BPETokenizer
(tokenizer_files.py), SentencePieceTokenizer (and GPTSentencePieceTokenizer, Llama2Tokenizer, which
Megatron-LM builds the same way), HuggingFaceTokenizer and TikTokenizer (megatron-core's, as Megatron-LM
builds them from its flags), and a UTF-8 byte tokenizer that needs no files.

All expose what training and megatron-core's datasets read: `vocab_size` (unpadded), `eod`,
`tokenize`, `detokenize`, and `unique_identifiers` (hashed into the dataset index cache keys).
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from collections.abc import Iterable

# megatron-core's tokenizer classes are imported where a tokenizer is built, not here: importing any of
# them runs megatron.core.tokenizers.text's package, which imports transformers whenever it is installed
# (a second or more of every rank's start-up, and its import hooks) for tokenizers most runs never build.
from megatron_resil.tokenizer_files import (
    SENTENCEPIECE_TYPES,
    TIKTOKEN_DEFAULT_VOCAB_SIZE,
    GPT2BPETokenizer,
    check_huggingface_tokenizer,
    check_sentencepiece_model,
    check_tiktoken_vocab,
    huggingface_tokenizer_dir,
)


class NullTokenizer:
    """Megatron-LM's NullTokenizer: text is integer ids separated by spaces; ids 0..N-1 are data, N is EOD.

    `vocab_size` is N + 1, as in Megatron-LM (and megatron-core 0.16's), so `--vocab-size N` leaves room for
    the EOD id. Ours, not megatron-core's: 0.19's counts EOD inside N, and importing it costs what the note
    above says.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size: int = vocab_size + 1
        self.eod: int = vocab_size
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("vocab_size", self.vocab_size)])

    def tokenize(self, text: str) -> list[int]:
        # Megatron splits on single spaces; any whitespace accepts the same inputs and more.
        ids = [int(token) for token in text.split()]
        for token in ids:
            # Out-of-range ids would only surface later as an embedding index error mid-training.
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"token id {token} is outside [0, {self.vocab_size})")
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


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
    and its end-of-sentence id is EOD, as in Megatron-LM.

    `special_tokens` (--tokenizer-special-tokens, which Megatron-LM takes only with
    --tokenizer-sentencepiece-legacy) go through megatron-core's legacy wrapper, the one that takes them: a
    token that is a piece of the model keeps its id, the others take ids after the model's pieces in the
    order given, and text is split at them before the model encodes the rest. EOD stays the model's
    end-of-sentence piece (the legacy wrapper itself has no eod: Megatron-LM's GPT run stops there).
    """

    def __init__(self, model_file: str, special_tokens: list[str] | None = None) -> None:
        check_sentencepiece_model(model_file)  # a missing package or a wrong file: one line
        from megatron.core.tokenizers.text.libraries.sentencepiece_tokenizer import (
            SentencePieceTokenizer as _CoreSentencePieceTokenizer,
        )
        if special_tokens:
            self._core = _CoreSentencePieceTokenizer(model_file, special_tokens=list(special_tokens),
                                                     legacy=True)
            self.eod: int = self._core.tokenizer.eos_id()
        else:
            self._core = _CoreSentencePieceTokenizer(model_file)
            self.eod = self._core.eod
        self.vocab_size: int = self._core.vocab_size
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("tokenizer_model", model_file),
             ("vocab_size", self.vocab_size)])
        if special_tokens:
            self.unique_identifiers["special_tokens"] = list(special_tokens)

    def tokenize(self, text: str) -> list[int]:
        return self._core.text_to_ids(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._core.ids_to_text([int(i) for i in ids])


class HuggingFaceTokenizer:
    """megatron-core's HuggingFaceTokenizer (transformers' AutoTokenizer) on a local directory: the
    vocabulary is len(tokenizer) with any added special tokens, EOD its eos_token (else sep_token)."""

    def __init__(self, name_or_dir: str, special_tokens: list[str] | None = None, use_fast: bool = True,
                 include_special_tokens: bool = True, trust_remote_code: bool = False) -> None:
        check_huggingface_tokenizer(name_or_dir, trust_remote_code)  # a wrong directory: one line
        # Imported here: the module imports transformers (a second or two) whenever it is installed.
        from megatron.core.tokenizers.text.libraries.huggingface_tokenizer import (
            HuggingFaceTokenizer as _CoreHuggingFaceTokenizer,
        )

        self._core = _CoreHuggingFaceTokenizer(
            huggingface_tokenizer_dir(name_or_dir), additional_special_tokens=list(special_tokens or []),
            use_fast=use_fast, trust_remote_code=trust_remote_code,
            include_special_tokens=include_special_tokens)
        self.vocab_size: int = self._core.vocab_size
        self.eod: int = self._core.eod
        self.unk_id: int | None = self._core.tokenizer.unk_token_id
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("tokenizer_model", name_or_dir),
             ("include_special_tokens", include_special_tokens), ("vocab_size", self.vocab_size)])

    def token_to_id(self, token: str) -> int | None:
        """The id of `token` in the vocabulary (added special tokens included), None where it has none."""
        return self._core.tokenizer.get_vocab().get(token)

    def tokenize(self, text: str) -> list[int]:
        return list(self._core.text_to_ids(text))

    def detokenize(self, ids: Iterable[int]) -> str:
        # Special tokens (EOD, BOS) are left out, as megatron-core 0.16 does by default.
        return self._core.ids_to_text([int(i) for i in ids], remove_special_tokens=True)


class TikTokenizer:
    """megatron-core's TikTokenTokenizer on Megatron's tiktoken vocabulary (.json): ids below
    num_special_tokens are the special tokens, then the vocabulary's first vocab_size - num_special_tokens
    tokens; EOD is </s>."""

    def __init__(self, vocab_json: str, pattern: str | None, vocab_size: int | None,
                 num_special_tokens: int, special_tokens: list[str] | None) -> None:
        check_tiktoken_vocab(vocab_json, vocab_size, num_special_tokens, special_tokens)
        from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import TikTokenTokenizer

        self._core = TikTokenTokenizer(
            vocab_json, special_tokens=special_tokens, num_special_tokens=num_special_tokens,
            pattern=pattern or "v2", vocab_size=vocab_size or TIKTOKEN_DEFAULT_VOCAB_SIZE)
        self._num_special_tokens = num_special_tokens
        self.vocab_size: int = self._core.vocab_size
        self.eod: int = self._core.eod
        self.unk_id: int | None = None  # megatron-core's token_to_id has no fallback: an unknown token fails
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("tokenizer_model", vocab_json), ("pattern", pattern or "v2"),
             ("num_special_tokens", num_special_tokens), ("vocab_size", self.vocab_size)])

    def token_to_id(self, token: str) -> int | None:
        """A special token's id, else the id of the vocabulary token `token` spells; else None."""
        try:
            return int(self._core.token_to_id(token))
        except KeyError:
            return None

    def tokenize(self, text: str) -> list[int]:
        return list(self._core.text_to_ids(text))

    def detokenize(self, ids: Iterable[int]) -> str:
        # Special tokens are left out. The bytes are joined before decoding (megatron-core 0.19 does;
        # 0.16's ids_to_text decodes token by token and breaks a character split across two tokens).
        kept = [int(i) for i in ids if int(i) >= self._num_special_tokens]
        return self._core.tokenizer.decode(kept)


Tokenizer = (NullTokenizer | ByteTokenizer | GPT2BPETokenizer | SentencePieceTokenizer | HuggingFaceTokenizer
             | TikTokenizer)


def build_tokenizer(args: argparse.Namespace) -> Tokenizer:
    """Build the tokenizer named by `args.tokenizer_type` from the flags Megatron-LM reads for it
    (arguments/tokenizer.py)."""
    if args.tokenizer_type == "NullTokenizer":
        if getattr(args, "vocab_size", None) is None:
            raise ValueError("NullTokenizer needs a vocab_size")
        return NullTokenizer(args.vocab_size)
    if args.tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    special_tokens = getattr(args, "tokenizer_special_tokens", None)
    if args.tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(args.vocab_file, args.merge_file, special_tokens)
    if args.tokenizer_type in SENTENCEPIECE_TYPES:
        return SentencePieceTokenizer(args.tokenizer_model, special_tokens)
    if args.tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(
            args.tokenizer_model, args.tokenizer_special_tokens, use_fast=not args.tokenizer_hf_no_use_fast,
            include_special_tokens=not args.tokenizer_hf_no_include_special_tokens,
            trust_remote_code=args.trust_remote_code)
    if args.tokenizer_type == "TikTokenizer":
        return TikTokenizer(args.tokenizer_model, args.tiktoken_pattern, args.vocab_size,
                            args.tiktoken_num_special_tokens, args.tokenizer_special_tokens)
    raise ValueError(f"unknown tokenizer_type {args.tokenizer_type!r}")
