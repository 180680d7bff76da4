"""Indexed data end to end: JSONL -> preprocess tool -> pretrain.py on 2 ranks with the byte tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests import launch


@pytest.mark.slow
def test_preprocessed_jsonl_trains_and_checkpoints(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    with open(corpus, "w") as f:
        for i in range(400):
            text = f"document {i}: " + "the quick brown fox jumps. " * (1 + i % 7)
            f.write(json.dumps({"text": text}) + "\n")
    (tmp_path / "data").mkdir()
    prefix = tmp_path / "data" / "corpus"
    prep = subprocess.run([sys.executable, "-m", "megatron_resil.tools.preprocess_data",
                           "--input", str(corpus), "--output-prefix", str(prefix), "--append-eod"],
                          env=launch.env(), cwd=launch.REPO, capture_output=True, text=True, timeout=120)
    assert prep.returncode == 0, prep.stderr
    # Megatron-LM's name: {output_prefix}_{json_key}_document
    assert (tmp_path / "data" / "corpus_text_document.bin").stat().st_size > 0

    save = tmp_path / "ckpt"
    args = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--tokenizer-type", "ByteTokenizer", "--data-path", f"{prefix}_text_document",
            "--split", "90,10,0", "--micro-batch-size", "2", "--train-iters", "6", "--lr", "1e-3",
            "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1",
            "--save", str(save), "--save-interval", "3"]
    result = launch.run(args)
    assert result.returncode == 0, result.stdout[-3000:]
    losses = launch.losses(result.stdout)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    # Byte-level text is far more predictable than uniform over 257 tokens (ln 257 = 5.55).
    assert float(losses[6][0]) < 5.5
    assert "validation loss at iteration 3" in result.stdout
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    # The dataset's index cache went under --save, not beside the data.
    assert (save / "data_cache").is_dir()
    assert not (tmp_path / "data" / "cache").exists()
