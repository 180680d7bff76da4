"""Tokenizers from real files made here: a small byte-level BPE trained with `tokenizers` and saved as GPT-2's
vocab.json and merges.txt, read back the way Megatron-LM reads --vocab-file and --merge-file and checked
against OpenAI's GPT-2 encoding algorithm; a small SentencePiece model for --tokenizer-model, checked against
the sentencepiece package. Both preprocessed with Megatron-LM's flags; GPT-2's trained on."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_resil.arguments import parse_args
from megatron_resil.model import padded_vocab_size
from megatron_resil.tokenizer import SentencePieceTokenizer, build_tokenizer
from megatron_resil.tokenizer_files import EOD_TOKEN, GPT2BPETokenizer
from tests import launch

tokenizers = pytest.importorskip("tokenizers")
sentencepiece = pytest.importorskip("sentencepiece")

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Megatron trains GPT models; it's fast, isn't it?",
          "Checkpoints are saved every 100 iterations and verified on load.", "naïve café, ümlaut ✓ 123"]
ASCII_TEXTS = ["The quick brown fox", "it's  fast!\n\n  trains   GPT models 1234",
               " leading space and tabs\t\tx"]


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory) -> tuple[str, str, object]:
    """vocab.json and merges.txt of a 300-token byte-level BPE, and the trainer's own tokenizer object."""
    directory = tmp_path_factory.mktemp("gpt2_bpe")
    trained = tokenizers.ByteLevelBPETokenizer()
    trained.train_from_iterator(CORPUS * 20, vocab_size=300, min_frequency=1, special_tokens=[EOD_TOKEN])
    trained.save_model(str(directory))
    return str(directory / "vocab.json"), str(directory / "merges.txt"), trained


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory) -> str:
    """A 60-piece SentencePiece BPE model (with <unk>, <s>, </s>: EOD is </s>)."""
    directory = tmp_path_factory.mktemp("sentencepiece")
    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 20), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(directory / "tokenizer"),
                                             vocab_size=60, model_type="bpe", minloglevel=2)
    return str(directory / "tokenizer.model")


def _openai_gpt2_encode(text: str, vocab_file: str, merge_file: str) -> list[int]:
    """GPT-2's original encoder (OpenAI's encoder.py), for ASCII text: its \\p{L} and \\p{N} are the ASCII
    letters and digits there."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    byte_to_char = {b: chr(b) for b in printable}
    byte_to_char.update({b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in printable)})
    with open(vocab_file, encoding="utf-8") as f:
        vocab = json.load(f)
    with open(merge_file, encoding="utf-8") as f:
        ranks = {tuple(line.split()): rank for rank, line in enumerate(f.read().splitlines()[1:]) if line}
    ids = []
    pattern = r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+"""
    for piece in re.findall(pattern, text):
        word = [byte_to_char[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            best = min(zip(word, word[1:], strict=False), key=lambda pair: ranks.get(pair, float("inf")))
            if best not in ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        ids += [vocab[token] for token in word]
    return ids


def test_gpt2_files_give_gpt2s_ids_eod_and_vocab_size(gpt2_files):
    vocab_file, merge_file, trained = gpt2_files
    tokenizer = GPT2BPETokenizer(vocab_file, merge_file)
    with open(vocab_file, encoding="utf-8") as f:
        vocab = json.load(f)
    assert tokenizer.vocab_size == len(vocab) == 300
    assert tokenizer.eod == vocab[EOD_TOKEN]
    for text in ASCII_TEXTS:
        ids = tokenizer.tokenize(text)
        assert ids == _openai_gpt2_encode(text, vocab_file, merge_file)
        assert len(ids) < len(text.encode()), "the merges were not applied"
        assert tokenizer.detokenize(ids) == text
    for text in CORPUS + ["unseen: Ωmega 東京 🙂"]:
        ids = tokenizer.tokenize(text)
        assert ids == trained.encode(text).ids
        assert tokenizer.detokenize(ids) == text
    # <|endoftext|> in text is the one EOD token (megatron-core's GPT-2 tokenizer); detokenize drops it.
    a, b = tokenizer.tokenize("a"), tokenizer.tokenize("b")
    assert tokenizer.tokenize(f"a{EOD_TOKEN}b") == [*a, tokenizer.eod, *b]
    assert tokenizer.detokenize(tokenizer.tokenize(f"a{EOD_TOKEN}b")) == "ab"


def test_sentencepiece_model_gives_its_ids_and_eos_as_eod(sentencepiece_model):
    tokenizer = SentencePieceTokenizer(sentencepiece_model)
    reference = sentencepiece.SentencePieceProcessor(model_file=sentencepiece_model)
    assert tokenizer.vocab_size == reference.get_piece_size() == 60
    assert tokenizer.eod == reference.eos_id() == reference.piece_to_id("</s>")
    for text in CORPUS + ["unseen words here"]:
        ids = tokenizer.tokenize(text)
        assert ids == reference.encode(text)
        assert tokenizer.detokenize(ids) == text
    assert len(tokenizer.tokenize(CORPUS[0])) < len(CORPUS[0]), "the merges were not applied"


def test_vocab_is_padded_as_megatron_lm_does(gpt2_files):
    vocab_file, merge_file, _ = gpt2_files
    tokenizer = build_tokenizer(argparse.Namespace(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab_file,
                                                   merge_file=merge_file))
    # --make-vocab-size-divisible-by x tensor-parallel size: 300 -> 384 at TP 1, 512 at TP 4.
    for tp, padded in ((1, 384), (4, 512)):
        args = argparse.Namespace(make_vocab_size_divisible_by=128, tensor_model_parallel_size=tp)
        assert padded_vocab_size(tokenizer.vocab_size, args) == padded


def _pretrain_args(*tokenizer_flags: str) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--mock-data", *tokenizer_flags]


def test_pretrain_takes_megatron_lms_gpt2_flags(gpt2_files):
    vocab_file, merge_file, _ = gpt2_files
    args = parse_args(_pretrain_args("--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_file,
                                     "--merge-file", merge_file), world_size=1)
    assert args.tokenizer_type == "GPT2BPETokenizer"
    # pretrain_gpt.py's default: --vocab-file with --merge-file and no --tokenizer-type is GPT-2's BPE.
    args = parse_args(_pretrain_args("--vocab-file", vocab_file, "--merge-file", merge_file), world_size=1)
    assert args.tokenizer_type == "GPT2BPETokenizer"


@pytest.mark.parametrize("name", ["SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"])
def test_pretrain_takes_sentencepiece_types_with_tokenizer_model(sentencepiece_model, name):
    args = parse_args(_pretrain_args("--tokenizer-type", name, "--tokenizer-model", sentencepiece_model),
                      world_size=1)
    assert build_tokenizer(args).eod == SentencePieceTokenizer(sentencepiece_model).eod


@pytest.mark.parametrize("case", ["no merges", "vocab without EOD", "merges of another vocab",
                                  "no tokenizer model", "not a sentencepiece model", "unbuilt type"])
def test_wrong_tokenizer_input_stops_with_one_line(gpt2_files, tmp_path, case):
    vocab_file, merge_file, _ = gpt2_files
    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_file, "--merge-file", merge_file]
    expected = ""
    if case == "no merges":
        flags, expected = flags[:4], "--tokenizer-type GPT2BPETokenizer needs --vocab-file"
    elif case == "vocab without EOD":
        bad = tmp_path / "vocab.json"
        bad.write_text(json.dumps({"a": 0, "b": 1}))
        flags[3], expected = str(bad), f"--vocab-file {bad}: no {EOD_TOKEN} entry"
    elif case == "merges of another vocab":
        bad = tmp_path / "merges.txt"
        bad.write_text("#version: 0.2\nzz qq\n")
        flags[5], expected = str(bad), f"--merge-file {bad}: not merges.txt for --vocab-file"
    elif case == "no tokenizer model":
        flags, expected = ["--tokenizer-type", "Llama2Tokenizer"], "Llama2Tokenizer needs --tokenizer-model"
    elif case == "not a sentencepiece model":
        flags = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", vocab_file]
        expected = f"--tokenizer-model {vocab_file}: not a SentencePiece model"
    else:
        flags, expected = ["--tokenizer-type", "TikTokenizer"], "TikTokenizer is not built yet here"
    result = launch.run_single([*_pretrain_args(*flags), "--check-args-only"])
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 2, result.stderr  # argparse's usage line and ours
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("package", ["tokenizers", "sentencepiece"])
def test_a_missing_tokenizer_package_is_named_with_its_pip_command(gpt2_files, sentencepiece_model, tmp_path,
                                                                   package):
    vocab_file, merge_file, _ = gpt2_files
    blocked = tmp_path / "blocked" / package
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('not installed')\n")
    flags = {"tokenizers": ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_file,
                            "--merge-file", merge_file],
             "sentencepiece": ["--tokenizer-type", "SentencePieceTokenizer",
                               "--tokenizer-model", sentencepiece_model]}[package]
    env = {**launch.env(), "PYTHONPATH": f"{blocked.parent}:{launch.REPO}"}
    result = subprocess.run([sys.executable, launch.PRETRAIN, *_pretrain_args(*flags), "--check-args-only"],
                            env=env, cwd=launch.REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert f"needs the {package} package: pip install {package}" in result.stderr.splitlines()[-1]


def preprocess(tmp_path: Path, texts: list[str], *tokenizer_flags: str) -> tuple[str, str]:
    """Megatron-LM's tools/preprocess_data.py command line; returns the prefix and any error."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    prefix = str(tmp_path / "corpus")
    result = subprocess.run(
        [sys.executable, "-m", "megatron_resil.tools.preprocess_data", "--input", str(corpus),
         "--output-prefix", prefix, "--json-keys", "text", *tokenizer_flags, "--append-eod",
         "--workers", "2"],
        env=launch.env(), cwd=launch.REPO, capture_output=True, text=True, timeout=120)
    return prefix, result.stdout + result.stderr if result.returncode else ""


def preprocess_gpt2(tmp_path: Path, vocab_file: str, merge_file: str, texts: list[str]) -> tuple[str, str]:
    return preprocess(tmp_path, texts, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_file,
                      "--merge-file", merge_file)


def test_preprocess_data_writes_gpt2_ids_with_eod(gpt2_files, tmp_path):
    vocab_file, merge_file, _ = gpt2_files
    prefix, error = preprocess_gpt2(tmp_path, vocab_file, merge_file, CORPUS)
    assert not error, error
    tokenizer = GPT2BPETokenizer(vocab_file, merge_file)
    dataset = IndexedDataset(prefix)
    assert len(dataset) == len(CORPUS)
    for i, text in enumerate(CORPUS):
        assert dataset[i].tolist() == tokenizer.tokenize(text) + [tokenizer.eod]
    assert dataset[0].dtype == numpy.uint16  # Megatron-LM's DType.optimal_dtype for a vocabulary < 65500


def test_preprocess_data_writes_sentencepiece_ids_with_eod(sentencepiece_model, tmp_path):
    prefix, error = preprocess(tmp_path, CORPUS, "--tokenizer-type", "GPTSentencePieceTokenizer",
                               "--tokenizer-model", sentencepiece_model)
    assert not error, error
    tokenizer = SentencePieceTokenizer(sentencepiece_model)
    dataset = IndexedDataset(prefix)
    assert [dataset[i].tolist() for i in range(len(dataset))] == [
        tokenizer.tokenize(text) + [tokenizer.eod] for text in CORPUS]


@pytest.mark.slow
def test_two_ranks_train_on_gpt2_tokenized_data(gpt2_files, tmp_path):
    vocab_file, merge_file, _ = gpt2_files
    texts = [f"document {i}: " + CORPUS[i % len(CORPUS)] * (1 + i % 5) for i in range(200)]
    prefix, error = preprocess_gpt2(tmp_path, vocab_file, merge_file, texts)
    assert not error, error
    training = [flag for flag in launch.TINY_TRAINING if flag != "--mock-data"]
    model = launch.TINY_MODEL[:launch.TINY_MODEL.index("--tokenizer-type")]
    result = launch.run([*model, *training, "--train-iters", "3", "--data-path", prefix, "--split", "90,10,0",
                         "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_file,
                         "--merge-file", merge_file])
    assert result.returncode == 0, result.stdout[-3000:]
    losses = launch.losses(result.stdout)
    assert sorted(losses) == [1, 2, 3]
    # Near-zero initial logits make the first loss ln(outputs): the vocabulary of 300 padded to 384.
    assert abs(float(losses[1][0]) - numpy.log(384)) < 0.1, losses
