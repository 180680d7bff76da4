"""Fill-in-the-middle data (--fim-data) and --tokenizer-special-tokens, on real files made here: a small GPT-2
byte-level BPE (vocab.json, merges.txt) and a SentencePiece model, a code-like corpus preprocessed with our
tools/preprocess_data into Megatron-LM's indexed files, and datasets built as pretrain.py builds them.

The FIM samples are checked against the plain samples of the same data: every piece cut at the end-of-document
token comes back, its parts in PSM or SPM order between Megatron-LM's sentinels, and the sample keeps its
length; a two-rank run trains on them and resumes exactly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_resil.arguments import parse_args
from megatron_resil.data import build_datasets
from megatron_resil.tokenizer import build_tokenizer
from megatron_resil.tokenizer_files import EOD_TOKEN
from megatron_resil.tools import preprocess_data
from tests import launch

tokenizers = pytest.importorskip("tokenizers")

FIM_TOKENS = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"]
# ASCII text, so any character boundary FIM draws is also one in the decoded ids.
CORPUS = [f"def step_{i}(x, y):\n    return x * {i} + y  # {'quick brown fox ' * (i % 4)}\n" * (1 + i % 3)
          for i in range(40)]
SEQ = 48


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory) -> tuple[str, str]:
    """vocab.json and merges.txt of a 300-token byte-level BPE trained on the corpus."""
    directory = tmp_path_factory.mktemp("gpt2_bpe")
    trained = tokenizers.ByteLevelBPETokenizer()
    trained.train_from_iterator(CORPUS * 5, vocab_size=300, min_frequency=1, special_tokens=[EOD_TOKEN])
    trained.save_model(str(directory))
    return str(directory / "vocab.json"), str(directory / "merges.txt")


def _gpt2_flags(gpt2_files: tuple[str, str], *special_tokens: str) -> list[str]:
    vocab_file, merge_file = gpt2_files
    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_file, "--merge-file", merge_file]
    return [*flags, "--tokenizer-special-tokens", *special_tokens] if special_tokens else flags


def _preprocess(directory: Path, texts: list[str], tokenizer_flags: list[str]) -> str:
    corpus = directory / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    preprocess_data.main(["--input", str(corpus), "--output-prefix", str(directory / "corpus"),
                          "--json-keys", "text", *tokenizer_flags, "--append-eod"])
    return str(directory / "corpus_text_document")


@pytest.fixture(scope="module")
def corpus(gpt2_files, tmp_path_factory) -> str:
    return _preprocess(tmp_path_factory.mktemp("corpus"), CORPUS, _gpt2_flags(gpt2_files, *FIM_TOKENS))


def _mock_args(*flags: str):
    return parse_args(["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
                       "--seq-length", "8", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
                       "--mock-data", *flags], world_size=1)


def _args(corpus: str, cache: Path, *flags: str):
    return parse_args(["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
                       "--seq-length", str(SEQ), "--micro-batch-size", "2", "--train-iters", "8",
                       "--lr", "1e-3", "--data-path", corpus, "--split", "100,0,0", "--eval-iters", "0",
                       "--data-cache-path", str(cache), *flags], world_size=1)


def _samples(args) -> tuple[list[list[int]], object]:
    """Every training sample's seq_length + 1 ids (tokens and the last label), and the tokenizer."""
    tokenizer = build_tokenizer(args)
    train, _ = build_datasets(args, tokenizer)
    samples = []
    for i in range(len(train)):
        sample = train[i]
        assert len(sample["tokens"]) == SEQ
        samples.append([*sample["tokens"].tolist(), int(sample["labels"][-1])])
    return samples, tokenizer


def _pieces(ids: list[int], eod: int) -> list[list[int]]:
    pieces, piece = [], []
    for i in ids:
        if i == eod:
            pieces.append(piece)
            piece = []
        else:
            piece.append(i)
    return [*pieces, piece]


@pytest.fixture(scope="module")
def plain(corpus, gpt2_files, tmp_path_factory):
    args = _args(corpus, tmp_path_factory.mktemp("cache"), *_gpt2_flags(gpt2_files, *FIM_TOKENS))
    return _samples(args)


@pytest.mark.parametrize("spm", [False, True], ids=["PSM", "SPM"])
def test_every_piece_comes_back_in_megatron_lms_fim_layout_and_the_sample_keeps_its_length(
        corpus, gpt2_files, plain, tmp_path, spm):
    plain_samples, tokenizer = plain
    args = _args(corpus, tmp_path, *_gpt2_flags(gpt2_files, *FIM_TOKENS), "--fim-data", "--fim-rate", "1",
                 "--fim-spm-rate", "1" if spm else "0")
    samples, _ = _samples(args)
    prefix, middle, suffix, pad = (tokenizer.token_to_id(t) for t in FIM_TOKENS)
    assert len({prefix, middle, suffix, pad, tokenizer.eod}) == 5 and min(prefix, middle, suffix, pad) >= 300
    assert len(samples) == len(plain_samples) > 10
    checked = with_prefix = 0
    for fim_sample, plain_sample in zip(samples, plain_samples, strict=True):
        assert len(fim_sample) == SEQ + 1
        originals = [p for p in _pieces(plain_sample, tokenizer.eod)[:-1] if p]  # each ended by its EOD
        # The pieces the FIM sample completes (its last one is cut at the sample's length).
        for original, piece in zip(originals, _pieces(fim_sample, tokenizer.eod)[:-1], strict=False):
            assert piece.count(prefix) == piece.count(middle) == piece.count(suffix) == 1, piece
            m = piece.index(middle)
            if spm:  # <prefix> <suffix> suffix <middle> prefix middle
                assert piece[:2] == [prefix, suffix]
                parts = [piece[m + 1:], piece[2:m]]
            else:  # <prefix> prefix <suffix> suffix <middle> middle
                s = piece.index(suffix)
                assert piece[0] == prefix and s < m
                parts = [piece[1:s], piece[m + 1:], piece[s + 1:m]]
                with_prefix += s > 1
            assert "".join(tokenizer.detokenize(p) for p in parts) == tokenizer.detokenize(original)
            checked += 1
    assert checked > 10
    assert spm or with_prefix > checked // 2  # PSM read as SPM would have an empty prefix each time


def test_empty_pieces_drop_their_eod_and_the_empty_last_piece_becomes_three_sentinels(gpt2_files):
    """Megatron-LM's layout at the edges: an end-of-document token is kept only after a non-empty piece, the
    piece after the last one is FIM'd even when empty, and a short result is padded with the FIM pad."""
    from megatron_resil import fim

    tokenizer = build_tokenizer(_mock_args(*_gpt2_flags(gpt2_files, *FIM_TOKENS)))
    prefix, middle, suffix, pad = (tokenizer.token_to_id(t) for t in FIM_TOKENS)
    settings = fim.FIMSettings(rate=1.0, spm_rate=0.0, prefix_id=prefix, middle_id=middle, suffix_id=suffix,
                               pad_id=pad, eod_id=tokenizer.eod)
    word = tokenizer.tokenize("return x")
    sample = numpy.array([tokenizer.eod] * 10 + [*word, tokenizer.eod])
    out = fim.FIMTransform(settings, tokenizer)(sample, fim.sample_rng(1234, 0, 0)).tolist()
    assert len(out) == len(sample)
    piece, rest = out[:out.index(tokenizer.eod)], out[out.index(tokenizer.eod):]
    assert rest[:4] == [tokenizer.eod, prefix, suffix, middle] and set(rest[4:]) == {pad}
    s, m = piece.index(suffix), piece.index(middle)
    assert piece[0] == prefix and s < m
    assert tokenizer.detokenize(piece[1:s] + piece[m + 1:] + piece[s + 1:m]) == "return x"


def test_fim_rate_0_leaves_every_sample_as_it_is_and_rate_1_changes_every_one(corpus, gpt2_files, plain,
                                                                               tmp_path):
    plain_samples, tokenizer = plain
    flags = [*_gpt2_flags(gpt2_files, *FIM_TOKENS), "--fim-data"]
    unchanged, _ = _samples(_args(corpus, tmp_path / "0", *flags, "--fim-rate", "0"))
    assert unchanged == plain_samples
    every, _ = _samples(_args(corpus, tmp_path / "1", *flags, "--fim-rate", "1"))
    assert all(s[0] == tokenizer.token_to_id("<fim_prefix>") or s[0] == tokenizer.eod for s in every)
    assert all(a != b for a, b in zip(every, plain_samples, strict=True))


def test_each_sample_is_the_same_fim_sample_in_any_order_and_the_seed_changes_them(corpus, gpt2_files,
                                                                                   tmp_path):
    flags = [*_gpt2_flags(gpt2_files, *FIM_TOKENS), "--fim-data"]
    args = _args(corpus, tmp_path, *flags)
    train, _ = build_datasets(args, build_tokenizer(args))
    forward = [train[i]["tokens"].tolist() for i in range(len(train))]
    again, _ = build_datasets(args, build_tokenizer(args))
    backward = [again[i]["tokens"].tolist() for i in reversed(range(len(again)))][::-1]
    assert forward == backward
    other, _ = _samples(_args(corpus, tmp_path, *flags, "--seed", "7"))
    assert [s[:-1] for s in other] != forward


def test_fim_tokens_missing_from_the_vocabulary_take_gpt2s_unknown_id_with_a_warning(corpus, gpt2_files,
                                                                                    tmp_path, capsys):
    args = _args(corpus, tmp_path, *_gpt2_flags(gpt2_files), "--fim-data", "--fim-rate", "1")
    warning = capsys.readouterr().err
    assert "--fim-prefix-token <fim_prefix>" in warning and "unknown token's id" in warning
    samples, tokenizer = _samples(args)
    # Megatron-LM's GPT-2 tokenizer answers an unknown token with <|endoftext|>: every sentinel is EOD.
    assert all(tokenizer.eod in s for s in samples)


@pytest.mark.parametrize("flags, named", [
    (["--mock-data"], "--mock-data"),
    (["--fim-rate", "1.5"], "--fim-rate 1.5"),
    (["--fim-split-sample", "<fim_pad>"], "--fim-split-sample <fim_pad> needs --fim-fragment-rate"),
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "300"], "--tokenizer-type NullTokenizer cannot"),
])
def test_what_cannot_make_fim_samples_stops_with_one_line(corpus, gpt2_files, tmp_path, capsys, flags, named):
    tokenizer = [] if "--tokenizer-type" in flags else _gpt2_flags(gpt2_files)
    with pytest.raises(SystemExit) as stop:
        if "--mock-data" in flags:
            _mock_args(*tokenizer, "--fim-data")
        else:
            _args(corpus, tmp_path, *tokenizer, "--fim-data", *flags)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert named in lines[-1] and "Traceback" not in "".join(lines)


# --- --tokenizer-special-tokens ---------------------------------------------------------------------------

def test_gpt2_special_tokens_get_transformers_ids_and_text_holds_each_as_one_id(gpt2_files):
    transformers = pytest.importorskip("transformers")
    specials = ["<fim_prefix>", EOD_TOKEN, "<tool>", "<fim_prefix>"]
    tokenizer = build_tokenizer(_mock_args(*_gpt2_flags(gpt2_files, *specials)))
    # Megatron-LM builds GPT2BPETokenizer as transformers' GPT-2 tokenizer with additional_special_tokens.
    reference = transformers.GPT2TokenizerFast(*gpt2_files)
    reference.add_special_tokens({"additional_special_tokens": specials})
    assert tokenizer.vocab_size == len(reference) == 302
    assert [tokenizer.token_to_id(t) for t in specials] == reference.convert_tokens_to_ids(specials) \
        == [300, tokenizer.eod, 301, 300]
    text = "def f(x):<fim_prefix> return x<tool>quick<|endoftext|>"
    ids = tokenizer.tokenize(text)
    assert ids == reference(text).input_ids
    assert ids.count(300) == ids.count(301) == ids.count(tokenizer.eod) == 1
    assert tokenizer.detokenize(ids) == "def f(x): return xquick"  # special tokens left out, as Megatron-LM


def test_preprocess_data_writes_special_tokens_as_single_ids(gpt2_files, tmp_path):
    flags = _gpt2_flags(gpt2_files, *FIM_TOKENS)
    prefix = _preprocess(tmp_path, ["ab<fim_middle>cd", "<fim_suffix>"], flags)
    tokenizer = build_tokenizer(_mock_args(*flags))
    dataset = IndexedDataset(prefix)
    # <fim_prefix> <fim_middle> <fim_suffix> <fim_pad> take 300-303; EOD (<|endoftext|>) is 0.
    assert dataset[0].tolist() == [*tokenizer.tokenize("ab"), 301, *tokenizer.tokenize("cd"), 0]
    assert dataset[1].tolist() == [302, 0]


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory) -> str:
    sentencepiece = pytest.importorskip("sentencepiece")
    directory = tmp_path_factory.mktemp("sentencepiece")
    (directory / "corpus.txt").write_text("\n".join(CORPUS), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(input=str(directory / "corpus.txt"),
                                             model_prefix=str(directory / "sp"), vocab_size=60,
                                             model_type="bpe", minloglevel=2)
    return str(directory / "sp.model")


def _sentencepiece_args(model: str, *flags: str):
    return _mock_args("--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model, *flags)


def test_sentencepiece_special_tokens_take_ids_after_the_pieces_and_split_the_text(sentencepiece_model,
                                                                                   capsys):
    import sentencepiece

    model = sentencepiece.SentencePieceProcessor(model_file=sentencepiece_model)
    with pytest.raises(SystemExit) as stop:  # Megatron-LM: only megatron-core's legacy wrapper takes them
        _sentencepiece_args(sentencepiece_model, "--tokenizer-special-tokens", "<tool>")
    assert stop.value.code == 2 and "needs --tokenizer-sentencepiece-legacy" in capsys.readouterr().err
    tokenizer = build_tokenizer(_sentencepiece_args(
        sentencepiece_model, "--tokenizer-sentencepiece-legacy",
        "--tokenizer-special-tokens", "<tool>", "</s>", "<think>"))
    # A new token takes the next id after the model's pieces, in order; a piece of the model keeps its id.
    assert tokenizer.vocab_size == model.get_piece_size() + 2 == 62
    assert tokenizer.eod == model.eos_id() == model.piece_to_id("</s>")
    ids = tokenizer.tokenize("return x<tool>quick</s>")
    after_tool = model.encode("quick")
    if model.id_to_piece(after_tool[0]) == "▁":  # the legacy wrapper trims a lone separator after a token
        after_tool = after_tool[1:]
    assert ids == [*model.encode("return x"), 60, *after_tool, model.eos_id()]
    assert "<think>" in tokenizer.detokenize([61])


# --- a real run ---------------------------------------------------------------------------------------------

@pytest.mark.slow  # first lane only (CI time): the second lane's tier runs this file's fast tests
def test_two_ranks_train_on_fim_samples_and_resume_exactly(gpt2_files, tmp_path):
    """Two data-parallel ranks train 3 iterations on FIM samples of a preprocessed corpus, saving at 2; a
    second job resumed from that iteration-2 checkpoint prints the same loss and grad norm for iteration 3."""
    prefix = _preprocess(tmp_path, CORPUS * 3, _gpt2_flags(gpt2_files, *FIM_TOKENS))
    model = launch.TINY_MODEL[:launch.TINY_MODEL.index("--tokenizer-type")]
    training = [flag for flag in launch.TINY_TRAINING if flag != "--mock-data"]
    common = [*model, *training, "--train-iters", "3", "--split", "100,0,0", "--eval-iters", "0",
              "--data-path", prefix, *_gpt2_flags(gpt2_files, *FIM_TOKENS), "--fim-data", "--fim-rate", "0.9",
              "--fim-spm-rate", "0.5"]
    whole = tmp_path / "whole"
    result = launch.run([*common, "--save", str(whole), "--load", str(whole), "--save-interval", "2"])
    assert result.returncode == 0, result.stdout[-4000:]
    expected = launch.losses(result.stdout)
    assert sorted(expected) == [1, 2, 3]
    # Near-zero initial logits make the first loss ln(outputs): 300 tokens and the 4 FIM ones, padded to 384.
    assert abs(float(expected[1][0]) - numpy.log(384)) < 0.1, expected

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(whole / "iter_0000002", resumed / "iter_0000002")
    (resumed / "latest_checkpointed_iteration.txt").write_text("2")
    result = launch.run([*common, "--save", str(resumed), "--load", str(resumed), "--save-interval", "100"])
    assert result.returncode == 0, result.stdout[-4000:]
    again = launch.losses(result.stdout)
    assert sorted(again) == [3]
    assert again == {3: expected[3]}
