"""JSONL to megatron-core indexed dataset (PREFIX.bin + PREFIX.idx), one document per line.

Outputs appear atomically: a reader sees the previous pair, no pair, or the complete new pair.
Bad input ends in one line on stderr naming the file, line or flag, and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import NoReturn

import numpy

with warnings.catch_warnings():
    # megatron-core warns on import about Apex, Transformer Engine and pynvml, none of which
    # preprocessing uses; stderr stays free for the one line that names bad input.
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    from megatron_resil.arguments.data import BUILT_TOKENIZERS, MEGATRON_TOKENIZERS
    from megatron_resil.tokenizer import build_tokenizer
    from megatron_resil.tokenizer_files import SENTENCEPIECE_TYPES, TokenizerFileError

PROG = "preprocess_data"


class InputError(Exception):
    """A user-fixable problem with the input or the flags; the message names where it is."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        _fail(message)


def _fail(message: str) -> NoReturn:
    sys.stderr.write(f"{PROG}: error: {message}\n")
    sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, allow_abbrev=False,
                     description="Tokenize a JSONL file into a megatron-core indexed dataset.")
    parser.add_argument("--input", required=True, help="JSONL file, one JSON object per line")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--json-keys", default="text", metavar="KEY",
                        help="field holding each document's text (one key)")
    parser.add_argument("--append-eod", action="store_true",
                        help="end every non-empty document with the EOD token")
    parser.add_argument("--tokenizer-type", choices=("ByteTokenizer", *MEGATRON_TOKENIZERS),
                        default="ByteTokenizer", help="built here: " + ", ".join(BUILT_TOKENIZERS))
    parser.add_argument("--vocab-size", type=int, default=None, help="vocabulary size for NullTokenizer")
    parser.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: GPT-2's vocab.json")
    parser.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: GPT-2's merges.txt")
    parser.add_argument("--tokenizer-model", default=None, help="SentencePieceTokenizer: the .model file")
    parser.add_argument("--workers", type=int, default=1,
                        help="accepted for Megatron-LM command lines; this tool tokenizes in one process")
    return parser


def _validate(args: argparse.Namespace) -> None:
    if not os.path.isfile(args.input):
        raise InputError(f"--input {args.input}: no such file")
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        raise InputError(f"--output-prefix {args.output_prefix}: directory {out_dir} does not exist")
    if args.tokenizer_type == "NullTokenizer":
        if args.vocab_size is None:
            raise InputError("--tokenizer-type NullTokenizer needs --vocab-size")
        if args.vocab_size < 1:
            raise InputError(f"--vocab-size {args.vocab_size} must be positive")
    elif args.vocab_size is not None:
        raise InputError(f"--vocab-size applies to NullTokenizer only, not {args.tokenizer_type}")
    if args.tokenizer_type not in BUILT_TOKENIZERS:
        raise InputError(f"--tokenizer-type {args.tokenizer_type} is not built yet here (built: "
                         f"{', '.join(BUILT_TOKENIZERS)})")
    files = {"GPT2BPETokenizer": (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file))}
    files.update({name: (("--tokenizer-model", args.tokenizer_model),) for name in SENTENCEPIECE_TYPES})
    for flag, path in files.get(args.tokenizer_type, ()):
        if path is None:
            raise InputError(f"--tokenizer-type {args.tokenizer_type} needs {flag}")
        if not os.path.isfile(path):
            raise InputError(f"{flag} {path}: no such file")


def _documents(path: str, key: str) -> Iterator[tuple[int, str]]:
    """Yield (line number, text) per non-blank line."""
    # Binary lines, decoded one by one, so an encoding error names its own line.
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise InputError(f"{path}:{lineno}: not valid UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise InputError(f"{path}:{lineno}: invalid JSON ({err.msg})") from None
            if not isinstance(record, dict):
                raise InputError(f"{path}:{lineno}: expected a JSON object")
            if key not in record:
                raise InputError(f"{path}:{lineno}: no key {key!r} (choose one with --json-keys)")
            if not isinstance(record[key], str):
                raise InputError(f"{path}:{lineno}: {key!r} is not a string")
            yield lineno, record[key]


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def preprocess(args: argparse.Namespace) -> tuple[int, int, int]:
    """Write the dataset; returns (documents written, empty documents skipped, tokens)."""
    try:
        tokenizer = build_tokenizer(args)
    except TokenizerFileError as err:
        raise InputError(str(err)) from None
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    bin_path, idx_path = args.output_prefix + ".bin", args.output_prefix + ".idx"
    tmp_bin, tmp_idx = f"{bin_path}.tmp-{os.getpid()}", f"{idx_path}.tmp-{os.getpid()}"
    documents = skipped = tokens = 0
    builder = IndexedDatasetBuilder(tmp_bin, dtype=dtype)
    try:
        for lineno, text in _documents(args.input, args.json_keys):
            try:
                ids = tokenizer.tokenize(text)
            except ValueError as err:
                raise InputError(f"{args.input}:{lineno}: {err}") from None
            # A zero-length document adds nothing to train on and only skews document sampling.
            if not ids:
                skipped += 1
                continue
            if args.append_eod:
                ids.append(tokenizer.eod)
            builder.add_document(numpy.asarray(ids, dtype=dtype), [len(ids)])
            documents += 1
            tokens += len(ids)
        if documents == 0:
            raise InputError(f"{args.input}: no non-empty documents under key {args.json_keys!r}")
        builder.finalize(tmp_idx)
        _fsync(tmp_bin)
        _fsync(tmp_idx)
        # Drop the old index first: between the two renames a reader then finds no .idx
        # rather than an old .idx describing a new .bin.
        if os.path.exists(idx_path):
            os.remove(idx_path)
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_idx, idx_path)
        _fsync(os.path.dirname(os.path.abspath(idx_path)))
    finally:
        builder.data_file.close()  # finalize closes it too; this covers the error paths
        for tmp in (tmp_bin, tmp_idx):
            if os.path.exists(tmp):
                os.remove(tmp)
    return documents, skipped, tokens


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        _validate(args)
        documents, skipped, tokens = preprocess(args)
    except InputError as err:
        _fail(str(err))
    except OSError as err:
        # Not bad input but the machine (permissions, full disk): still one line, exit code 1.
        sys.stderr.write(f"{PROG}: error: {err.filename or args.output_prefix}: {err.strerror}\n")
        sys.exit(1)
    print(f"{PROG}: {documents} documents ({skipped} empty skipped), {tokens} tokens -> "
          f"{args.output_prefix}.bin, {args.output_prefix}.idx")


if __name__ == "__main__":
    main()
