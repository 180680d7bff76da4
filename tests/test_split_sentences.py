"""preprocess_data --split-sentences, Megatron-LM's: NLTK's punkt model splits each document into sentences,
each a sequence of the document, written as PREFIX_KEY_sentence. NLTK is a test dependency; its punkt data is
a download, so the test trains a small punkt model with NLTK's own PunktTrainer on text it writes and saves
it where NLTK 3.9 and later look for punkt (NLTK_DATA/tokenizers/punkt_tab/LANG/), all offline. Without nltk
(hidden from the tool's process) or without the model, the flag stops with one line."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import launch

nltk = pytest.importorskip("nltk", reason="nltk is a test dependency (setup.py's test extra)")

# The second document is one sentence; the third's "Dr." is an abbreviation only a trained model knows (an
# untrained punkt splits after it).
TEXTS = ["The fox jumps. The dog sleeps!  Is it late?", "One sentence only",
         "Dr. Watson came home. He slept."]

# The tool, run with `import nltk` failing as it does where nltk is not installed.
WITHOUT_NLTK = ("import runpy, sys; sys.modules['nltk'] = None; runpy.run_module("
                "'megatron_resil.tools.preprocess_data', run_name='__main__', alter_sys=True)")


def _training_text() -> str:
    """About 750 words: every word that ends a sentence also stands inside one (else punkt takes it for an
    abbreviation), and "Dr." and "Mrs." always come before a capitalised name."""
    nouns = ["fox", "dog", "tree", "river", "house", "garden", "station", "market", "bridge", "school"]
    names = ["Brown", "Green", "White", "Black", "Grey"]
    return " ".join(f"The {a} is near the {b}. {('Dr.', 'Mrs.')[i % 2]} {names[i % 5]} saw the {b} by the "
                    f"{a}! Was it late?" for i, (a, b) in enumerate(itertools.combinations(nouns, 2)))


@pytest.fixture
def nltk_data(tmp_path, monkeypatch) -> Path:
    """An NLTK data directory holding an english punkt model trained here, in the punkt_tab layout."""
    from nltk.tokenize.punkt import PunktTrainer, save_punkt_params

    root = tmp_path / "nltk_data"
    model = root / "tokenizers" / "punkt_tab" / "english"
    model.mkdir(parents=True)
    trainer = PunktTrainer()
    trainer.train(_training_text(), finalize=True)
    assert {"dr", "mrs"} <= trainer.get_params().abbrev_types
    monkeypatch.setenv("NLTK_DATA", str(root))  # NLTK writes only under its data path
    save_punkt_params(trainer.get_params(), dir=str(model))
    return root


def _preprocess(tmp_path: Path, *flags: str, nltk_data: Path | None = None,
                hide_nltk: bool = False) -> subprocess.CompletedProcess:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS), encoding="utf-8")
    env = launch.env()
    # The model is looked up on NLTK_DATA first, then in HOME/nltk_data and the system's directories.
    env["NLTK_DATA"] = str(nltk_data or tmp_path / "empty_nltk_data")
    env["HOME"] = str(tmp_path)
    tool = ["-c", WITHOUT_NLTK] if hide_nltk else ["-m", "megatron_resil.tools.preprocess_data"]
    return subprocess.run([sys.executable, *tool, "--input", str(corpus),
                           "--output-prefix", str(tmp_path / "corpus"), "--append-eod", *flags],
                          env=env, cwd=launch.REPO, capture_output=True, text=True, timeout=120)


def _one_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_without_nltk_split_sentences_stops_with_one_line_naming_it(tmp_path, nltk_data):
    line = _one_line(_preprocess(tmp_path, "--split-sentences", nltk_data=nltk_data, hide_nltk=True))
    assert "--split-sentences needs the nltk package" in line and "pip install nltk" in line, line
    assert not list(tmp_path.glob("corpus_text_*"))


def test_without_punkt_data_split_sentences_stops_with_one_line_naming_it(tmp_path):
    installed = [p for p in nltk.data.path if Path(p, "tokenizers", "punkt_tab", "english").is_dir()
                 and not str(p).startswith(str(Path.home()))]
    if installed:
        pytest.skip(f"an english punkt model is installed outside NLTK_DATA and HOME: {installed}")
    line = _one_line(_preprocess(tmp_path, "--split-sentences"))
    assert "--split-sentences --lang english: no punkt model for english on NLTK's data path" in line, line
    assert "nltk.downloader punkt_tab" in line and "NLTK_DATA" in line, line
    assert not list(tmp_path.glob("corpus_text_*"))


def test_each_sentence_is_a_sequence_of_its_document(tmp_path, nltk_data):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    result = _preprocess(tmp_path, "--split-sentences", nltk_data=nltk_data)
    assert result.returncode == 0, result.stderr
    dataset = IndexedDataset(str(tmp_path / "corpus_text_sentence"))
    # Three sentences, then one, then two; the document boundaries index the sentences.
    assert dataset.document_indices.tolist() == [0, 3, 4, 6]

    def text(i: int) -> str:  # without the EOD (256, the ByteTokenizer's) that ends a document's last one
        tokens = dataset[i].tolist()
        return bytes(tokens[:-1] if tokens[-1] == 256 else tokens).decode()

    assert [text(i) for i in range(6)] == ["The fox jumps.", "The dog sleeps!", "Is it late?",
                                           "One sentence only", "Dr. Watson came home.", "He slept."]
    assert [dataset[i][-1] == 256 for i in range(6)] == [False, False, True, True, False, True]


def test_keep_newlines_keeps_the_whitespace_after_each_sentence(nltk_data, monkeypatch):
    from megatron_resil.tools.sentence_splitter import sentence_splitter

    monkeypatch.setattr(nltk.data, "path", [str(nltk_data)])  # NLTK read NLTK_DATA when it was imported
    text = "The fox jumps.\nThe dog sleeps!  Is it late?"
    assert sentence_splitter("english", keep_newlines=False)(text) == [
        "The fox jumps.", "The dog sleeps!", "Is it late?"]
    # Megatron-LM's --keep-newlines: the newline (any whitespace) after a sentence stays in it.
    assert sentence_splitter("english", keep_newlines=True)(text) == [
        "The fox jumps.\n", "The dog sleeps!  ", "Is it late?"]
