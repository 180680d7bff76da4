"""Tokenizers from real files made here: a small byte-level BPE trained with `tokenizers` and saved as GPT-2's
vocab.json and merges.txt, read back the way Megatron-LM reads --vocab-file and --merge-file and checked
against OpenAI's GPT-2 encoding algorithm; a small SentencePiece model for --tokenizer-model, checked against
the sentencepiece package; the same BPE saved as a Hugging Face tokenizer directory (HuggingFaceTokenizer),
checked against transformers; a tiny tiktoken vocabulary in Megatron's JSON (TikTokenizer), checked against
tiktoken. Each preprocessed with Megatron-LM's flags into Megatron-LM's file names, and trained on."""

from __future__ import annotations

import argparse
import base64
import collections
import json
import os
import re
import shutil
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
from megatron_resil.tools import preprocess_data
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


# Tests that run pretrain.py or preprocess_data as processes (a second of imports or more each): slow, so
# they run once in CI, in the first lane; the tokenizers themselves are tested in-process on both lanes.
_in_subprocesses = pytest.mark.slow


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
def test_wrong_tokenizer_input_stops_with_one_line(gpt2_files, tmp_path, capsys, case):
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
        flags, expected = ["--tokenizer-type", "BertWordPieceCase"], "BertWordPieceCase is not built here"
    with pytest.raises(SystemExit) as stop:  # pretrain.py's own parse_args (the CLI: the tests below)
        parse_args(_pretrain_args(*flags), world_size=1)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and expected in err, err
    assert len(err.strip().splitlines()) <= 2, err  # argparse's usage line and ours


@_in_subprocesses
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


def preprocess(tmp_path: Path, texts: list[str], *tokenizer_flags: str, env: dict[str, str] | None = None
               ) -> tuple[str, str]:
    """Megatron-LM's tools/preprocess_data.py command line, run by preprocess_data's main() in this process
    (a process of its own with `env`: the tool as users start it); returns the prefix and any error."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    argv = ["--input", str(corpus), "--output-prefix", str(tmp_path / "corpus"), "--json-keys", "text",
            *tokenizer_flags, "--append-eod", "--workers", "2"]
    # Megatron-LM's tools/preprocess_data.py names them {output_prefix}_{json_key}_{level}.
    prefix = str(tmp_path / "corpus_text_document")
    if env is not None:
        result = subprocess.run([sys.executable, "-m", "megatron_resil.tools.preprocess_data", *argv],
                                env=env, cwd=launch.REPO, capture_output=True, text=True, timeout=120)
        return prefix, result.stdout + result.stderr if result.returncode else ""
    try:
        preprocess_data.main(argv)
    except SystemExit as stop:
        return prefix, f"preprocess_data exited with code {stop.code} (its line is in the captured stderr)"
    return prefix, ""


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


# HuggingFaceTokenizer and TikTokenizer

HF_TEXTS = [*CORPUS, "unseen: Ωmega 東京 🙂"]


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory) -> str:
    """A Hugging Face tokenizer directory as save_pretrained writes it: a 300-token byte-level BPE whose
    post-processor starts every text with <s>; its eos_token is <|endoftext|>."""
    transformers = pytest.importorskip("transformers")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS * 20, tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOD_TOKEN, "<s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    bpe.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bpe.token_to_id("<s>"))])
    directory = tmp_path_factory.mktemp("hf_tokenizer")
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOD_TOKEN,
                                         bos_token="<s>").save_pretrained(str(directory))
    return str(directory)


def _byte_pair_merges(texts: list[str], merges: int) -> list[bytes]:
    """The 256 bytes, then `merges` tokens: each time the most frequent adjacent pair of the corpus, joined.
    No pre-tokenizing, so tokens span spaces and case changes (which the tiktoken patterns split)."""
    words = [[bytes([b]) for b in text.encode()] for text in texts]
    tokens = [bytes([b]) for b in range(256)]
    while len(tokens) < 256 + merges:
        pairs = collections.Counter(p for w in words for p in zip(w, w[1:], strict=False))
        (a, b), _ = pairs.most_common(1)[0]
        if a + b not in tokens:
            tokens.append(a + b)
        for n, word in enumerate(words):
            merged, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == (a, b):
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            words[n] = merged
    return tokens


TIKTOKEN_SPECIALS = 10  # --tiktoken-num-special-tokens: the 7 megatron-core requires and 3 fillers


@pytest.fixture(scope="module")
def tiktoken_vocab(tmp_path_factory) -> tuple[str, list[bytes]]:
    """Megatron's tiktoken vocabulary (JSON: rank, token_bytes, token_str) of 316 tokens, and its bytes."""
    pytest.importorskip("tiktoken")
    tokens = _byte_pair_merges([*CORPUS, "HelloWorld HelloWorld HelloWorld"] * 5, 60)
    path = tmp_path_factory.mktemp("tiktoken") / "vocab.json"
    path.write_text(json.dumps([{"rank": i, "token_bytes": base64.b64encode(t).decode(),
                                 "token_str": t.decode("utf-8", errors="replace")}
                                for i, t in enumerate(tokens)]))
    return str(path), tokens


def _tiktoken_flags(vocab_file: str, tokens: list[bytes], pattern: str = "v2") -> list[str]:
    return ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", vocab_file,
            "--tiktoken-pattern", pattern,
            "--tiktoken-num-special-tokens", str(TIKTOKEN_SPECIALS),
            "--vocab-size", str(TIKTOKEN_SPECIALS + len(tokens))]


def _flags_for(kind: str, hf_tokenizer_dir: str, tiktoken_vocab: tuple[str, list[bytes]]) -> list[str]:
    if kind == "HuggingFaceTokenizer":
        return ["--tokenizer-type", kind, "--tokenizer-model", hf_tokenizer_dir]
    return _tiktoken_flags(*tiktoken_vocab)


def _tokenizer_from(flags: list[str]):
    return build_tokenizer(parse_args(_pretrain_args(*flags), world_size=1))


def test_huggingface_directory_gives_transformers_ids_and_its_eos_as_eod(hf_tokenizer_dir):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(hf_tokenizer_dir)
    tokenizer = _tokenizer_from(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                 hf_tokenizer_dir])
    assert tokenizer.vocab_size == len(reference) == 300
    assert tokenizer.eod == reference.convert_tokens_to_ids(EOD_TOKEN)
    bos = reference.convert_tokens_to_ids("<s>")
    for text in HF_TEXTS:
        ids = tokenizer.tokenize(text)
        # Megatron-LM's default since 0.17: text to ids adds the tokenizer's own special tokens (here <s>).
        assert ids == reference(text).input_ids and ids[0] == bos
        assert tokenizer.detokenize([*ids, tokenizer.eod]) == text
    assert len(tokenizer.tokenize(CORPUS[0])) < len(CORPUS[0]), "the merges were not applied"
    # --tokenizer-hf-no-include-special-tokens (Megatron-LM 0.16's default): the text's tokens alone.
    plain = _tokenizer_from(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                             hf_tokenizer_dir, "--tokenizer-hf-no-include-special-tokens"])
    assert plain.tokenize(CORPUS[0]) == tokenizer.tokenize(CORPUS[0])[1:]


def test_huggingface_special_tokens_are_added_to_the_vocabulary(hf_tokenizer_dir):
    tokenizer = _tokenizer_from(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                 hf_tokenizer_dir, "--tokenizer-special-tokens", "<tool>", "<think>"])
    assert tokenizer.vocab_size == 302
    a, b = tokenizer.tokenize("a")[1:], tokenizer.tokenize("b")[1:]  # each after its <s>
    assert tokenizer.tokenize("a<tool>b")[1:] == [*a, 300, *b]


def test_tiktoken_vocabulary_gives_its_ranks_after_the_special_tokens(tiktoken_vocab):
    vocab_file, tokens = tiktoken_vocab
    tokenizer = _tokenizer_from(_tiktoken_flags(vocab_file, tokens))
    assert tokenizer.vocab_size == TIKTOKEN_SPECIALS + len(tokens) == 326
    assert tokenizer.eod == 2  # </s>, third of megatron-core's special tokens
    for text in [*CORPUS, "unseen: Ωmega 東京 🙂"]:
        ids = tokenizer.tokenize(text)
        # Each id is the file's rank shifted past the special tokens, and the bytes are the text's.
        assert all(TIKTOKEN_SPECIALS <= i < tokenizer.vocab_size for i in ids)
        assert b"".join(tokens[i - TIKTOKEN_SPECIALS] for i in ids) == text.encode()
        assert tokenizer.detokenize([*ids, tokenizer.eod]) == text
    assert len(tokenizer.tokenize(CORPUS[0])) < len(CORPUS[0]), "the merges were not applied"


def test_tiktoken_pattern_decides_where_tokens_may_not_span(tiktoken_vocab):
    vocab_file, tokens = tiktoken_vocab
    assert b"oW" in b"".join(t for t in tokens if len(t) > 1)  # merges across the case change exist

    def pieces(pattern: str) -> list[bytes]:
        tokenizer = _tokenizer_from(_tiktoken_flags(vocab_file, tokens, pattern))
        return [tokens[i - TIKTOKEN_SPECIALS] for i in tokenizer.tokenize("HelloWorld")]

    # v1 keeps a run of letters whole; v2 splits "Hello" from "World" at the capital letter.
    assert any(b"oW" in piece for piece in pieces("v1"))
    assert not any(b"oW" in piece for piece in pieces("v2"))


@pytest.mark.parametrize("kind", ["HuggingFaceTokenizer", "TikTokenizer"])
def test_preprocess_data_writes_megatron_lm_names_and_the_tokenizers_ids(hf_tokenizer_dir, tiktoken_vocab,
                                                                          tmp_path, kind):
    flags = _flags_for(kind, hf_tokenizer_dir, tiktoken_vocab)
    prefix, error = preprocess(tmp_path, CORPUS, *flags)
    assert not error, error
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix in (".bin", ".idx")) == [
        "corpus_text_document.bin", "corpus_text_document.idx"]
    tokenizer = _tokenizer_from(flags)
    dataset = IndexedDataset(prefix)
    assert [dataset[i].tolist() for i in range(len(dataset))] == [
        tokenizer.tokenize(text) + [tokenizer.eod] for text in CORPUS]


@_in_subprocesses
def test_a_hub_name_is_read_from_the_local_hugging_face_cache(hf_tokenizer_dir, tmp_path):
    """--tokenizer-model acme/tiny-bpe, as launch scripts name hub tokenizers, is the snapshot already in the
    cache (HF_HUB_CACHE); nothing is downloaded (and this machine could not)."""
    repo = tmp_path / "hub" / "models--acme--tiny-bpe"
    shutil.copytree(hf_tokenizer_dir, repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    env = {**launch.env(), "HF_HUB_CACHE": str(tmp_path / "hub")}
    prefix, error = preprocess(tmp_path, CORPUS, "--tokenizer-type", "HuggingFaceTokenizer",
                               "--tokenizer-model", "acme/tiny-bpe", env=env)
    assert not error, error
    tokenizer = _tokenizer_from(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                 hf_tokenizer_dir])
    dataset = IndexedDataset(prefix)
    assert [dataset[i].tolist() for i in range(len(dataset))] == [
        tokenizer.tokenize(text) + [tokenizer.eod] for text in CORPUS]


@_in_subprocesses
def test_preprocess_data_writes_one_dataset_per_json_key(tmp_path):
    corpus = tmp_path / "in.jsonl"
    corpus.write_text(json.dumps({"text": "body", "title": "head"}) + "\n")
    result = subprocess.run(
        [sys.executable, "-m", "megatron_resil.tools.preprocess_data", "--input", str(corpus),
         "--output-prefix", str(tmp_path / "out"), "--json-keys", "text", "title"],
        env=launch.env(), cwd=launch.REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    # Each dataset kept referenced while read: its __del__ unmaps what dataset[0] views.
    text = IndexedDataset(str(tmp_path / "out_text_document"))
    title = IndexedDataset(str(tmp_path / "out_title_document"))
    assert (bytes(text[0].tolist()), bytes(title[0].tolist())) == (b"body", b"head")


@pytest.mark.parametrize("case", ["hf missing directory", "hf hub name not cached", "hf not a tokenizer",
                                  "hf file", "hf with gpt-2 files", "tiktoken missing file",
                                  "tiktoken not json", "tiktoken vocab too small", "tiktoken special tokens"])
def test_wrong_huggingface_or_tiktoken_input_stops_with_one_line(hf_tokenizer_dir, tiktoken_vocab, tmp_path,
                                                                 capsys, case):
    vocab_file, tokens = tiktoken_vocab
    hf = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model"]
    empty = tmp_path / "empty"
    empty.mkdir()
    bad_json = tmp_path / "vocab.json"
    bad_json.write_text('[{"rank": 0}]')
    missing = tmp_path / "nope"
    not_found = "no such directory, nor a hub name in the local Hugging Face cache; nothing is downloaded"
    flags, expected = {
        "hf missing directory": ([*hf, str(missing)], f"--tokenizer-model {missing}: {not_found}"),
        "hf hub name not cached": ([*hf, "nobody-here/no-such-tokenizer"],
                                   f"--tokenizer-model nobody-here/no-such-tokenizer: {not_found}"),
        "hf not a tokenizer": ([*hf, str(empty)], f"--tokenizer-model {empty}: not a Hugging Face tokenizer"),
        "hf file": ([*hf, vocab_file], f"--tokenizer-model {vocab_file}: a file"),
        "hf with gpt-2 files": ([*hf, hf_tokenizer_dir, "--vocab-file", vocab_file],
                                "--vocab-file/--merge-file: HuggingFaceTokenizer reads the files of its"),
        "tiktoken missing file": (_tiktoken_flags(str(tmp_path / "nope.json"), tokens),
                                  f"--tokenizer-model {tmp_path / 'nope.json'}: no such file"),
        "tiktoken not json": (
            _tiktoken_flags(str(bad_json), tokens),
            f"--tokenizer-model {bad_json}: entry 0 is not {{rank, token_bytes, token_str}}"),
        "tiktoken vocab too small": (
            _tiktoken_flags(vocab_file, tokens)[:-2],
            f"--tokenizer-model {vocab_file}: 316 tokens, fewer than --vocab-size 131072 (the default) less "
            "--tiktoken-num-special-tokens 10 asks for; pass --vocab-size 326"),
        "tiktoken special tokens": (
            [*_tiktoken_flags(vocab_file, tokens), "--tokenizer-special-tokens", "<unk>", "<s>", "</s>"],
            "must be unique and include <unk> <s> </s> <mask>"),
    }[case]
    with pytest.raises(SystemExit) as stop:
        parse_args(_pretrain_args(*flags), world_size=1)
    line = capsys.readouterr().err
    assert stop.value.code == 2 and line.count("\n") == 1 and expected in line, line
    # preprocess_data reads the same flags and stops with the same line.
    corpus = tmp_path / "in.jsonl"
    corpus.write_text(json.dumps({"text": "a"}) + "\n")
    with pytest.raises(SystemExit) as stop:
        preprocess_data.main(["--input", str(corpus), "--output-prefix", str(tmp_path / "out"), *flags])
    assert stop.value.code == 2
    assert capsys.readouterr().err == line.replace("pretrain.py: error:", "preprocess_data: error:")


@_in_subprocesses
@pytest.mark.parametrize("package", ["transformers", "tiktoken"])
def test_a_missing_hf_or_tiktoken_package_is_named_with_its_pip_command(hf_tokenizer_dir, tiktoken_vocab,
                                                                        tmp_path, package):
    blocked = tmp_path / "blocked" / package
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('not installed')\n")
    kind = "HuggingFaceTokenizer" if package == "transformers" else "TikTokenizer"
    flags = _flags_for(kind, hf_tokenizer_dir, tiktoken_vocab)
    env = {**launch.env(standby=False), "PYTHONPATH": f"{blocked.parent}{os.pathsep}{launch.REPO}"}
    result = subprocess.run([sys.executable, launch.PRETRAIN, *_pretrain_args(*flags), "--check-args-only"],
                            env=env, cwd=launch.REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"pretrain.py: error: --tokenizer-type {kind} needs the {package} package: pip install {package} "
        "(or pip install megatron-resil[tokenizers])"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["HuggingFaceTokenizer", "TikTokenizer"])
def test_a_tiny_gpt_trains_on_data_the_tokenizer_wrote(hf_tokenizer_dir, tiktoken_vocab, tmp_path, kind):
    flags = _flags_for(kind, hf_tokenizer_dir, tiktoken_vocab)
    texts = [f"document {i}: " + CORPUS[i % len(CORPUS)] * (1 + i % 5) for i in range(200)]
    prefix, error = preprocess(tmp_path, texts, *flags)
    assert not error, error
    training = [flag for flag in launch.TINY_TRAINING if flag != "--mock-data"]
    model = launch.TINY_MODEL[:launch.TINY_MODEL.index("--tokenizer-type")]
    result = launch.run([*model, *training, "--train-iters", "3", "--data-path", prefix, "--split", "90,10,0",
                         *flags], nproc=1)
    assert result.returncode == 0, result.stdout[-3000:]
    losses = launch.losses(result.stdout)
    assert sorted(losses) == [1, 2, 3]
    # Near-zero initial logits make the first loss ln(outputs): 300 or 326 tokens, padded to 384.
    assert abs(float(losses[1][0]) - numpy.log(384)) < 0.1, losses


def test_building_the_null_tokenizer_and_every_module_of_ours_imports_neither_transformers_nor_tiktoken():
    """Both are installed here (HuggingFaceTokenizer, TikTokenizer); any megatron-core tokenizer module runs
    megatron.core.tokenizers.text's package, which imports transformers (a second or more per rank, and
    its import hooks). A run that builds neither tokenizer must not pay for them."""
    code = """
import importlib, pkgutil, sys
import megatron_resil
from megatron_resil import patches
patches.install_import_speedups()  # as pretrain.py and preprocess_data do, or TorchInductor is imported
from megatron_resil.tokenizer import NullTokenizer
tok = NullTokenizer(128)
assert tok.tokenize("1 2 127") == [1, 2, 127] and tok.eod == 128 and tok.vocab_size == 129
for module in pkgutil.walk_packages(megatron_resil.__path__, "megatron_resil."):
    importlib.import_module(module.name)
print("imported:", sorted(m for m in ("transformers", "tiktoken") if m in sys.modules))
"""
    result = subprocess.run([sys.executable, "-c", code], env=launch.env(), cwd=launch.REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "imported: []" in result.stdout, result.stdout
