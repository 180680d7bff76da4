"""The tokenizers' own files, read with the optional packages that run them, before megatron-core is
imported (so start-up checks stop on a wrong file with one line): GPT-2's vocab.json and merges.txt, and
a SentencePiece model.

GPT2BPETokenizer is GPT-2's byte-level BPE run by Hugging Face's `tokenizers` package. megatron-core (0.16
and 0.19) builds this tokenizer through transformers' AutoTokenizer("gpt2"), which
asks the Hugging Face hub for GPT-2's configuration; here the two files are all that is read. The ids are
Megatron-LM's: GPT-2's pre-tokenizing pattern and byte-to-unicode map, `<|endoftext|>` in text read as the
one EOD token, vocab_size = the entries of vocab.json.
"""

from __future__ import annotations

import importlib
import json
from collections import OrderedDict
from collections.abc import Iterable
from types import ModuleType

EOD_TOKEN = "<|endoftext|>"
# Megatron-LM (megatron-core's build_tokenizer) builds these three alike, from --tokenizer-model.
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")


class TokenizerFileError(ValueError):
    """A tokenizer file or package a user can fix; the message is one line naming the flag or package."""


def require_package(package: str, needed_by: str) -> ModuleType:
    """Import an optional package, or say in one line which package and how to install it."""
    try:
        return importlib.import_module(package)
    except ImportError:
        raise TokenizerFileError(f"{needed_by} needs the {package} package: pip install {package} "
                                 "(or pip install megatron-resil[tokenizers])") from None


def check_sentencepiece_model(model_file: str) -> None:
    """A SentencePiece model that loads and has the end-of-sentence piece Megatron's EOD is."""
    sentencepiece = require_package("sentencepiece", "a SentencePiece --tokenizer-type")
    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.Load(model_file)
    except (OSError, RuntimeError) as err:
        first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise TokenizerFileError(f"--tokenizer-model {model_file}: not a SentencePiece model "
                                 f"({first_line})") from None
    if processor.eos_id() < 0:
        raise TokenizerFileError(f"--tokenizer-model {model_file}: the model has no end-of-sentence piece, "
                                 "which Megatron uses as end of document; train it with eos_id >= 0")


class GPT2BPETokenizer:
    """GPT-2's byte-level BPE, with what training and the datasets read: vocab_size, eod, tokenize,
    detokenize and unique_identifiers."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        tokenizers = require_package("tokenizers", "--tokenizer-type GPT2BPETokenizer")
        try:
            with open(vocab_file, encoding="utf-8") as f:
                vocab = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise TokenizerFileError(f"--vocab-file {vocab_file}: not a GPT-2 vocab.json ({err})") from None
        if not isinstance(vocab, dict) or EOD_TOKEN not in vocab:
            raise TokenizerFileError(f"--vocab-file {vocab_file}: no {EOD_TOKEN} entry, GPT-2's end of "
                                     "document; is it GPT-2's vocab.json?")
        try:
            model = tokenizers.models.BPE.from_file(vocab_file, merge_file)
        except Exception as err:  # tokenizers raises a bare Exception for a bad or mismatched merges file
            first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise TokenizerFileError(f"--merge-file {merge_file}: not merges.txt for --vocab-file "
                                     f"{vocab_file} ({first_line})") from None
        self._bpe = tokenizers.Tokenizer(model)
        self._bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._bpe.decoder = tokenizers.decoders.ByteLevel()
        # Already in vocab.json, so its id stays; as a special token it is matched whole in text.
        self._bpe.add_special_tokens([EOD_TOKEN])
        self.vocab_size: int = self._bpe.get_vocab_size(with_added_tokens=True)
        self.eod: int = vocab[EOD_TOKEN]
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("vocab_file", vocab_file), ("merge_file", merge_file),
             ("vocab_size", self.vocab_size)])

    def tokenize(self, text: str) -> list[int]:
        return self._bpe.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Iterable[int]) -> str:
        # Special tokens (EOD) are left out, as megatron-core's ids_to_text does by default.
        return self._bpe.decode([int(i) for i in ids], skip_special_tokens=True)
