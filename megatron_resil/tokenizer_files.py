"""The tokenizers' own files, read with the optional packages that run them, before megatron-core is
imported (so start-up checks stop on a wrong file with one line): GPT-2's vocab.json and merges.txt,
a SentencePiece model, a Hugging Face tokenizer directory and Megatron's tiktoken vocabulary (.json).

GPT2BPETokenizer is GPT-2's byte-level BPE run by Hugging Face's `tokenizers` package. megatron-core (0.16
and 0.19) builds this tokenizer through transformers' AutoTokenizer("gpt2"), which
asks the Hugging Face hub for GPT-2's configuration; here the two files are all that is read. The ids are
Megatron-LM's: GPT-2's pre-tokenizing pattern and byte-to-unicode map, `<|endoftext|>` in text read as the
one EOD token, vocab_size = the entries of vocab.json plus the --tokenizer-special-tokens it lacks (added
after them in order, as transformers' add_special_tokens numbers them).
"""

from __future__ import annotations

import base64
import binascii
import importlib
import json
import os
from collections import OrderedDict
from collections.abc import Iterable
from types import ModuleType

EOD_TOKEN = "<|endoftext|>"
# Megatron-LM (megatron-core's build_tokenizer) builds these three alike, from --tokenizer-model.
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
# megatron-core's TikTokenTokenizer: the special tokens it requires, and its vocabulary size by default.
TIKTOKEN_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
TIKTOKEN_DEFAULT_VOCAB_SIZE = 2**17


class TokenizerFileError(ValueError):
    """A tokenizer file or package a user can fix; the message is one line naming the flag or package."""


def require_package(package: str, needed_by: str) -> ModuleType:
    """Import an optional package, or say in one line which package and how to install it."""
    try:
        return importlib.import_module(package)
    except ImportError:
        raise TokenizerFileError(f"{needed_by} needs the {package} package: pip install {package} "
                                 "(or pip install megatron-resil[tokenizers])") from None


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def check_tiktoken_vocab(path: str, vocab_size: int | None, num_special_tokens: int,
                         special_tokens: list[str] | None) -> None:
    """Megatron's tiktoken vocabulary (a JSON list of {rank, token_bytes, token_str}, the 256 single bytes
    first) holding the --vocab-size less --tiktoken-num-special-tokens tokens megatron-core will take."""
    require_package("tiktoken", "--tokenizer-type TikTokenizer")
    where = f"--tokenizer-model {path}"
    if not path.endswith(".json"):
        raise TokenizerFileError(f"{where}: TikTokenizer reads Megatron's tiktoken vocabulary, a .json file")
    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TokenizerFileError(f"{where}: not a tiktoken vocabulary ({_first_line(err)})") from None
    if not isinstance(vocab, list):
        raise TokenizerFileError(f"{where}: not a tiktoken vocabulary (a JSON list of tokens)")
    for i, token in enumerate(vocab):
        if not isinstance(token, dict) or token.keys() != {"rank", "token_bytes", "token_str"}:
            raise TokenizerFileError(f"{where}: entry {i} is not {{rank, token_bytes, token_str}}")
        try:
            token_bytes = base64.b64decode(token["token_bytes"], validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise TokenizerFileError(f"{where}: entry {i}: token_bytes is not base64") from None
        if token["rank"] != i or (i < 256 and token_bytes != bytes([i])):
            raise TokenizerFileError(f"{where}: entry {i} has rank {token['rank']}; the ranks must count "
                                     "from 0, the 256 single bytes first")
    specials = list(TIKTOKEN_SPECIAL_TOKENS) if special_tokens is None else special_tokens
    missing = [t for t in TIKTOKEN_SPECIAL_TOKENS if t not in specials]
    if missing or len(set(specials)) != len(specials):
        raise TokenizerFileError(f"--tokenizer-special-tokens {' '.join(specials)}: must be unique and "
                                 f"include {' '.join(TIKTOKEN_SPECIAL_TOKENS)}")
    size = TIKTOKEN_DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size
    size_flag = f"--vocab-size {size}" + (" (the default)" if vocab_size is None else "")
    if not len(specials) <= num_special_tokens < size:
        raise TokenizerFileError(f"--tiktoken-num-special-tokens {num_special_tokens}: must be at least the "
                                 f"{len(specials)} special tokens and below {size_flag}")
    if len(vocab) < size - num_special_tokens:
        raise TokenizerFileError(f"{where}: {len(vocab)} tokens, fewer than {size_flag} less "
                                 f"--tiktoken-num-special-tokens {num_special_tokens} asks for; pass "
                                 f"--vocab-size {len(vocab) + num_special_tokens} (or less)")


def huggingface_tokenizer_dir(name_or_dir: str) -> str:
    """The local directory of a Hugging Face tokenizer: --tokenizer-model itself, or a hub name's snapshot
    already in the local Hugging Face cache. Nothing is downloaded."""
    where = f"--tokenizer-model {name_or_dir}"
    if os.path.isdir(name_or_dir):
        if not os.access(name_or_dir, os.R_OK | os.X_OK):
            raise TokenizerFileError(f"{where}: directory not readable (permissions)")
        return name_or_dir
    if os.path.exists(name_or_dir):
        raise TokenizerFileError(f"{where}: a file; HuggingFaceTokenizer reads the directory of a tokenizer "
                                 "(tokenizer.save_pretrained(DIR))")
    hub = require_package("huggingface_hub", "--tokenizer-type HuggingFaceTokenizer")
    try:
        return hub.snapshot_download(repo_id=name_or_dir, local_files_only=True)
    except (OSError, ValueError):  # not in the cache, or not a hub name at all
        raise TokenizerFileError(f"{where}: no such directory, nor a hub name in the local Hugging Face "
                                 "cache; nothing is downloaded here: pass the tokenizer's directory "
                                 "(tokenizer.save_pretrained(DIR))") from None


def check_huggingface_tokenizer(name_or_dir: str, trust_remote_code: bool) -> None:
    """A tokenizer transformers loads from its local directory, with the end-of-sentence (or separator)
    token megatron-core's HuggingFaceTokenizer takes as end of document."""
    directory = huggingface_tokenizer_dir(name_or_dir)
    transformers = require_package("transformers", "--tokenizer-type HuggingFaceTokenizer")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code,
                                                               local_files_only=True)
    except Exception as err:  # transformers raises OSError, ValueError, KeyError, ... for a wrong directory
        raise TokenizerFileError(f"--tokenizer-model {name_or_dir}: not a Hugging Face tokenizer "
                                 f"({_first_line(err)})") from None
    if tokenizer.eos_token is None and tokenizer.sep_token is None:
        raise TokenizerFileError(f"--tokenizer-model {name_or_dir}: the tokenizer has no eos_token (nor "
                                 "sep_token), which Megatron uses as end of document; set one in its "
                                 "tokenizer_config.json")


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
    detokenize and unique_identifiers; and token_to_id, unk_id for the FIM dataset's sentinel tokens."""

    def __init__(self, vocab_file: str, merge_file: str, special_tokens: list[str] | None = None) -> None:
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
        # Megatron-LM's additional_special_tokens: one already in vocab.json keeps its id, the others take
        # the next ids in the order given; all are matched whole in text and left out of detokenized text.
        self._bpe.add_special_tokens(list(special_tokens or []))
        self.vocab_size: int = self._bpe.get_vocab_size(with_added_tokens=True)
        self.eod: int = vocab[EOD_TOKEN]
        # transformers' GPT-2 tokenizer answers an unknown token with its unk_token, <|endoftext|>.
        self.unk_id: int = self.eod
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("vocab_file", vocab_file), ("merge_file", merge_file),
             ("vocab_size", self.vocab_size)])
        if special_tokens:
            self.unique_identifiers["special_tokens"] = list(special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of `token` in the vocabulary (added special tokens included), None where it has none."""
        return self._bpe.token_to_id(token)

    def tokenize(self, text: str) -> list[int]:
        return self._bpe.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Iterable[int]) -> str:
        # Special tokens (EOD) are left out, as megatron-core's ids_to_text does by default.
        return self._bpe.decode([int(i) for i in ids], skip_special_tokens=True)
