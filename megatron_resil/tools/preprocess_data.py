"""JSONL to megatron-core indexed datasets, one document per line, named as Megatron-LM's
tools/preprocess_data.py names them: PREFIX_KEY_document.bin and .idx for each --json-keys KEY, or
PREFIX_KEY_sentence with --split-sentences (each document's sentences its sequences: sentence_splitter.py).

Outputs appear atomically: a reader sees the previous pair, no pair, or the complete new pair.
Bad input ends in one line on stderr naming the file, line or flag, and exit code 2.
"""

import argparse
import dataclasses
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import NoReturn

import numpy

from megatron_resil import patches
from megatron_resil.arguments import tokenizer as tokenizer_args
from megatron_resil.arguments.errors import ArgumentError
from megatron_resil.arguments.flag_table import add_flags
from megatron_resil.tokenizer import build_tokenizer
from megatron_resil.tokenizer_files import TokenizerFileError
from megatron_resil.tools.sentence_splitter import SplitterUnavailable, sentence_splitter

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
                     description="Tokenize a JSONL file into megatron-core indexed datasets.")
    parser.add_argument("--input", required=True, help="JSONL file, one JSON object per line")
    parser.add_argument("--output-prefix", required=True,
                        help="writes PREFIX_KEY_document.bin and .idx for each --json-keys KEY "
                             "(PREFIX_KEY_sentence with --split-sentences)")
    parser.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                        help="fields holding each document's text, one dataset each (default: text)")
    parser.add_argument("--append-eod", action="store_true",
                        help="end every non-empty document with the EOD token")
    parser.add_argument("--split-sentences", action="store_true",
                        help="split documents into sentences with NLTK's punkt model (needs nltk and its "
                             "punkt data); each sentence is a sequence of its document")
    parser.add_argument("--keep-newlines", action="store_true",
                        help="with --split-sentences: keep the newlines between sentences")
    parser.add_argument("--lang", default="english", help="with --split-sentences: punkt's language")
    # pretrain.py's tokenizer rows; the byte tokenizer (no files) by default.
    rows = [dataclasses.replace(flag, default="ByteTokenizer") if flag is tokenizer_args.TYPE_FLAG else flag
            for flag in tokenizer_args.FLAGS]
    add_flags(parser, "tokenizer", rows)
    parser.add_argument("--workers", type=int, default=1,
                        help="accepted for Megatron-LM command lines; this tool tokenizes in one process")
    return parser


def output_prefixes(args: argparse.Namespace) -> list[str]:
    """Megatron-LM's names: {output_prefix}_{json_key}_{level}, one per key."""
    level = "sentence" if args.split_sentences else "document"
    return [f"{args.output_prefix}_{key}_{level}" for key in args.json_keys]


def _validate(args: argparse.Namespace) -> None:
    if not os.path.isfile(args.input):
        raise InputError(f"--input {args.input}: no such file")
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        raise InputError(f"--output-prefix {args.output_prefix}: directory {out_dir} does not exist")
    if len(set(args.json_keys)) != len(args.json_keys):
        raise InputError(f"--json-keys {' '.join(args.json_keys)}: a key is named twice")
    try:
        tokenizer_args.validate(args)
    except ArgumentError as err:
        raise InputError(str(err)) from None


def _documents(path: str, keys: list[str]) -> Iterator[tuple[int, list[str]]]:
    """Yield (line number, the text under each key) per non-blank line."""
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
            for key in keys:
                if key not in record:
                    raise InputError(f"{path}:{lineno}: no key {key!r} (choose one with --json-keys)")
                if not isinstance(record[key], str):
                    raise InputError(f"{path}:{lineno}: {key!r} is not a string")
            yield lineno, [record[key] for key in keys]


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _indexed_dataset():
    """megatron-core's dataset writer, imported once the arguments are good and with the start-up patches
    in place: megatron-core decorates functions with torch.compile as it is imported, which without them
    imports TorchInductor (seconds of a tool that tokenizes a few lines)."""
    patches.install_import_speedups()
    with warnings.catch_warnings():
        # megatron-core warns on import about Apex, Transformer Engine and pynvml, none of which
        # preprocessing uses; stderr stays free for the one line that names bad input.
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    return DType, IndexedDatasetBuilder


def preprocess(args: argparse.Namespace,
               split: Callable[[str], list[str]] | None = None) -> tuple[int, int, int]:
    """Write one dataset per key, each document one sequence, or with `split` one per sentence (as
    Megatron-LM: sentences with no tokens left out, EOD counted in the last one); returns (documents
    written, empty documents skipped, tokens), all keys."""
    DType, IndexedDatasetBuilder = _indexed_dataset()  # noqa: N806 - megatron-core's class names
    try:
        tokenizer = build_tokenizer(args)
    except TokenizerFileError as err:
        raise InputError(str(err)) from None
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    outputs = [(prefix + ".bin", prefix + ".idx") for prefix in output_prefixes(args)]
    temporaries = [(f"{b}.tmp-{os.getpid()}", f"{i}.tmp-{os.getpid()}") for b, i in outputs]
    documents = skipped = tokens = 0
    builders = []
    try:
        for tmp_bin, _ in temporaries:
            builders.append(IndexedDatasetBuilder(tmp_bin, dtype=dtype))
        written = [0] * len(builders)
        for lineno, texts in _documents(args.input, args.json_keys):
            for k, text in enumerate(texts):
                try:
                    sentences = [tokenizer.tokenize(part) for part in (split(text) if split else [text])]
                except ValueError as err:
                    raise InputError(f"{args.input}:{lineno}: {err}") from None
                lengths = [len(ids) for ids in sentences if ids]
                ids = [i for sentence in sentences for i in sentence]
                # A zero-length document adds nothing to train on and only skews document sampling.
                if not ids:
                    skipped += 1
                    continue
                if args.append_eod:
                    ids.append(tokenizer.eod)
                    lengths[-1] += 1
                builders[k].add_document(numpy.asarray(ids, dtype=dtype), lengths)
                written[k] += 1
                documents += 1
                tokens += len(ids)
        for key, count in zip(args.json_keys, written, strict=True):
            if count == 0:
                raise InputError(f"{args.input}: no non-empty documents under key {key!r}")
        for builder, (tmp_bin, tmp_idx) in zip(builders, temporaries, strict=True):
            builder.finalize(tmp_idx)
            _fsync(tmp_bin)
            _fsync(tmp_idx)
        for (bin_path, idx_path), (tmp_bin, tmp_idx) in zip(outputs, temporaries, strict=True):
            # Drop the old index first: between the two renames a reader then finds no .idx
            # rather than an old .idx describing a new .bin.
            if os.path.exists(idx_path):
                os.remove(idx_path)
            os.replace(tmp_bin, bin_path)
            os.replace(tmp_idx, idx_path)
        _fsync(os.path.dirname(os.path.abspath(args.output_prefix)))
    finally:
        for builder in builders:
            builder.data_file.close()  # finalize closes it too; this covers the error paths
        for tmp in (path for pair in temporaries for path in pair):
            if os.path.exists(tmp):
                os.remove(tmp)
    return documents, skipped, tokens


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        _validate(args)
        split = sentence_splitter(args.lang, args.keep_newlines) if args.split_sentences else None
        documents, skipped, tokens = preprocess(args, split)
    except (InputError, SplitterUnavailable) as err:
        _fail(str(err))
    except OSError as err:
        # Not bad input but the machine (permissions, full disk): still one line, exit code 1.
        sys.stderr.write(f"{PROG}: error: {err.filename or args.output_prefix}: {err.strerror}\n")
        sys.exit(1)
    written = ", ".join(f"{prefix}.bin, {prefix}.idx" for prefix in output_prefixes(args))
    print(f"{PROG}: {documents} documents ({skipped} empty skipped), {tokens} tokens -> {written}")


if __name__ == "__main__":
    main()
