"""preprocess_data --split-sentences, Megatron-LM's: NLTK's punkt model splits each document into sentences,
each a sequence of the document, written as PREFIX_KEY_sentence. NLTK and its punkt data are downloads, so
without them the flag stops with one line (tested here); with them (where installed) the split is checked."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_resil.tools.sentence_splitter import SplitterUnavailable, sentence_splitter
from tests import launch

TEXTS = ["The fox jumps. The dog sleeps!  Is it late?", "One sentence only"]


def _preprocess(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS), encoding="utf-8")
    return subprocess.run([sys.executable, "-m", "megatron_resil.tools.preprocess_data",
                           "--input", str(corpus), "--output-prefix", str(tmp_path / "corpus"),
                           "--append-eod", *flags],
                          env=launch.env(), cwd=launch.REPO, capture_output=True, text=True, timeout=120)


def _punkt_available() -> bool:
    try:
        sentence_splitter("english", keep_newlines=False)
    except SplitterUnavailable:
        return False
    return True


@pytest.mark.skipif(importlib.util.find_spec("nltk") is not None, reason="nltk is installed here")
def test_without_nltk_split_sentences_stops_with_one_line_naming_it(tmp_path):
    result = _preprocess(tmp_path, "--split-sentences")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--split-sentences needs the nltk package" in lines[0], result.stderr
    assert not list(tmp_path.glob("corpus_text_*"))


@pytest.mark.skipif(not _punkt_available(), reason="nltk or its punkt data is not installed")
def test_each_sentence_is_a_sequence_of_its_document(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    result = _preprocess(tmp_path, "--split-sentences")
    assert result.returncode == 0, result.stderr
    dataset = IndexedDataset(str(tmp_path / "corpus_text_sentence"))
    # Three sentences, then one; the document boundaries index the sentences.
    assert dataset.document_indices.tolist() == [0, 3, 4]
    first = [bytes(dataset[i].tolist()[:-1] if i == 2 else dataset[i].tolist()).decode() for i in range(3)]
    assert first == ["The fox jumps.", "The dog sleeps!", "Is it late?"]
    assert dataset[2][-1] == 256  # the ByteTokenizer's EOD ends the document's last sentence
