"""Data layer: JSONL preprocessing into indexed files, megatron-core GPT datasets, and the sampler."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import torch
import torch.distributed as dist
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_resil.data import build_datasets, get_microbatch
from megatron_resil.tokenizer import ByteTokenizer, NullTokenizer, build_tokenizer
from megatron_resil.tools import preprocess_data

REPO = Path(__file__).resolve().parents[1]
TEXTS = [f"document {i}: " + "héllo wörld ✓ " * (i + 2) for i in range(12)]


def write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def preprocess(tmp_path: Path, texts: list[str] = TEXTS, name: str = "corpus", *extra: str) -> str:
    """The dataset's prefix: Megatron-LM's name, {output_prefix}_{json_key}_document."""
    jsonl = write_jsonl(tmp_path / f"{name}.jsonl", [{"text": t} for t in texts])
    preprocess_data.main(["--input", str(jsonl), "--output-prefix", str(tmp_path / name), "--append-eod",
                          *extra])
    return str(tmp_path / f"{name}_text_document")


def data_args(tmp_path: Path, **overrides) -> argparse.Namespace:
    args = dict(tokenizer_type="ByteTokenizer", vocab_size=None, seq_length=16, seed=1234,
                split="80,20,0", train_iters=5, train_samples=None, global_batch_size=4, eval_interval=2,
                step_batch_size_schedule=None, eval_global_batch_size=4,
                eval_iters=1, data_cache_path=None, save=str(tmp_path / "ckpt"), mock_data=False,
                data_path=None)
    args.update(overrides)
    return argparse.Namespace(**args)


def assert_same_batch(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


# Tokenizers


def test_byte_tokenizer_round_trips_utf8():
    tok = build_tokenizer(argparse.Namespace(tokenizer_type="ByteTokenizer", vocab_size=None))
    assert isinstance(tok, ByteTokenizer) and (tok.vocab_size, tok.eod) == (257, 256)
    ids = tok.tokenize("héllo ✓")
    assert ids == list("héllo ✓".encode()) and max(ids) < 256
    assert tok.detokenize(ids + [tok.eod]) == "héllo ✓"


def test_null_tokenizer_follows_megatron():
    tok = build_tokenizer(argparse.Namespace(tokenizer_type="NullTokenizer", vocab_size=100))
    assert isinstance(tok, NullTokenizer)
    # --vocab-size N: data ids 0..N-1, EOD is N, so the model's vocabulary is N + 1.
    assert (tok.vocab_size, tok.eod) == (101, 100)
    assert tok.tokenize("3 1 4\t1  5\n") == [3, 1, 4, 1, 5]
    assert tok.detokenize([3, 1, 4]) == "3 1 4"
    for bad in ("1 101", "1 -1", "1 x"):
        with pytest.raises(ValueError):
            tok.tokenize(bad)


# preprocess_data


def test_preprocess_round_trips_bytes(tmp_path, capsys):
    texts = TEXTS[:3] + [""] + ["ünïcode ✓ last"]
    prefix = preprocess(tmp_path, texts)
    summary = capsys.readouterr().out.strip()
    assert summary.count("\n") == 0
    assert "4 documents (1 empty skipped)" in summary and f"{prefix}.bin" in summary
    assert f"{prefix}.idx" in summary

    ds = IndexedDataset(prefix)
    assert ds.index.dtype == numpy.uint16  # megatron-core's pick for a 257-token vocabulary
    kept = [t for t in texts if t]
    assert len(ds) == len(kept)
    for i, text in enumerate(kept):
        ids = ds[i].tolist()
        assert ids[-1] == 256
        assert bytes(ids[:-1]).decode("utf-8") == text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "corpus_text_document.bin",
                                                          "corpus_text_document.idx"]


def test_preprocess_null_tokenizer(tmp_path):
    prefix = preprocess(tmp_path, ["5 6 7", "0 99"], "ids", "--tokenizer-type", "NullTokenizer",
                        "--vocab-size", "100")
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == [[5, 6, 7, 100], [0, 99, 100]]


def test_failed_preprocess_keeps_previous_outputs(tmp_path, capsys):
    prefix = preprocess(tmp_path, ["first version"])
    before = {s: Path(prefix + s).read_bytes() for s in (".bin", ".idx")}
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "a"}, {"text": "b"}, {"txt": "c"}])
    with pytest.raises(SystemExit):
        preprocess_data.main(["--input", str(bad), "--output-prefix", prefix.removesuffix("_text_document")])
    assert {s: Path(prefix + s).read_bytes() for s in (".bin", ".idx")} == before
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]

    preprocess(tmp_path, ["second version, longer"])
    ds = IndexedDataset(prefix)  # kept referenced: its __del__ unmaps what ds[0] views
    assert bytes(ds[0].tolist()[:-1]) == b"second version, longer"


@pytest.mark.parametrize("case, expected", [
    ("missing_file", "--input {dir}/nope.jsonl: no such file"),
    ("bad_json", "{dir}/in.jsonl:2: invalid JSON"),
    ("missing_key", "{dir}/in.jsonl:3: no key 'text'"),
    ("not_a_string", "{dir}/in.jsonl:1: 'text' is not a string"),
    ("bad_utf8", "{dir}/in.jsonl:2: not valid UTF-8"),
    ("id_out_of_range", "{dir}/in.jsonl:2: token id 100 is outside [0, 11)"),
    ("null_without_vocab", "--tokenizer-type NullTokenizer needs --vocab-size"),
    ("no_output_dir", "--output-prefix {dir}/missing/out: directory"),
])
def test_preprocess_bad_input_is_one_line_exit_2(tmp_path, capsys, case, expected):
    jsonl = tmp_path / "in.jsonl"
    argv = ["--input", str(jsonl), "--output-prefix", str(tmp_path / "out")]
    lines = {
        "bad_json": b'{"text": "a"}\n{"text": "b"\n',
        "missing_key": b'{"text": "a"}\n\n{"body": "b"}\n',
        "not_a_string": b'{"text": 3}\n',
        "bad_utf8": b'{"text": "a"}\n{"text": "\xff"}\n',
        "id_out_of_range": b'{"text": "1 2"}\n{"text": "100"}\n',
    }
    jsonl.write_bytes(lines.get(case, b'{"text": "1 2"}\n'))
    if case == "missing_file":
        argv[1] = str(tmp_path / "nope.jsonl")
    if case == "id_out_of_range":
        argv += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "10"]
    if case == "null_without_vocab":
        argv += ["--tokenizer-type", "NullTokenizer"]
    if case == "no_output_dir":
        argv[3] = str(tmp_path / "missing" / "out")
    with pytest.raises(SystemExit) as exit_info:
        preprocess_data.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("preprocess_data: error: ")
    assert expected.format(dir=tmp_path) in err
    assert [p.name for p in tmp_path.iterdir()] == ["in.jsonl"]


def test_cli_bad_input_has_no_traceback(tmp_path):
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text('{"text": "a"}\nnot json\n')
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_resil.tools.preprocess_data", "--input", str(jsonl),
         "--output-prefix", str(tmp_path / "out")],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == f"preprocess_data: error: {jsonl}:2: invalid JSON (Expecting value)\n"
    assert proc.stdout == ""


# Datasets and the sampler


def test_gpt_dataset_batches(tmp_path):
    prefix = preprocess(tmp_path)
    args = data_args(tmp_path, data_path=[prefix])
    tok = build_tokenizer(args)
    train_ds, valid_ds = build_datasets(args, tok)
    assert not dist.is_initialized()
    assert len(train_ds) >= args.train_iters * args.global_batch_size
    assert valid_ds is not None and len(valid_ds) > 0
    assert any((tmp_path / "ckpt" / "data_cache").iterdir())

    batch = get_microbatch(train_ds, 8, 1, 2, 1, 2)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in batch.items()} == {
        "tokens": (torch.int64, (2, 16)), "labels": (torch.int64, (2, 16)),
        "loss_mask": (torch.float32, (2, 16)), "position_ids": (torch.int64, (2, 16))}
    assert torch.equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])
    assert torch.equal(batch["position_ids"], torch.arange(16).expand(2, 16))
    assert torch.equal(batch["loss_mask"], torch.ones(2, 16))
    assert int(batch["tokens"].max()) < tok.vocab_size
    # A sample is a window over EOD-terminated documents: every EOD-free run comes from one document.
    docs = [t.encode() for t in TEXTS]
    for row in batch["tokens"].tolist():
        # The texts hold no NUL byte, so EOD mapped to NUL splits exactly at document ends.
        pieces = bytes(0 if t == tok.eod else t for t in row).split(b"\0")
        assert all(any(piece in doc for doc in docs) for piece in pieces)

    # Exact resume: a rebuild (now from the index cache) yields the same batches.
    assert_same_batch(get_microbatch(train_ds, 8, 1, 2, 1, 2), batch)
    train_again, _ = build_datasets(args, tok)
    assert_same_batch(get_microbatch(train_again, 8, 1, 2, 1, 2), batch)


def test_microbatches_partition_the_global_batch(tmp_path):
    args = data_args(tmp_path, mock_data=True, tokenizer_type="NullTokenizer", vocab_size=127)
    train_ds, _ = build_datasets(args, build_tokenizer(args))
    consumed, mbs, dp, num_microbatches = 24, 2, 3, 2
    expected = [train_ds[consumed + j] for j in range(mbs * dp * num_microbatches)]
    seen = []
    for m in range(num_microbatches):
        for r in range(dp):
            batch = get_microbatch(train_ds, consumed, m, mbs, r, dp)
            seen += [{k: v[i] for k, v in batch.items()} for i in range(mbs)]
    # Megatron's sampler order: microbatch-major, then data-parallel rank, each sample once.
    for got, want in zip(seen, expected, strict=True):
        assert_same_batch(got, {k: want[k] for k in got})
    ranks = [get_microbatch(train_ds, consumed, 0, mbs, r, dp)["tokens"] for r in range(dp)]
    assert not torch.equal(ranks[0], ranks[1]) and not torch.equal(ranks[1], ranks[2])


def test_mock_datasets(tmp_path):
    args = data_args(tmp_path, mock_data=True, save=None, tokenizer_type="NullTokenizer", vocab_size=127)
    tok = build_tokenizer(args)
    train_ds, valid_ds = build_datasets(args, tok)
    batch = get_microbatch(train_ds, 0, 0, 4, 0, 1)
    assert tuple(batch["tokens"].shape) == (4, 16)
    assert int(batch["tokens"].max()) < tok.vocab_size and int(batch["tokens"].min()) >= 0
    assert torch.equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])
    assert_same_batch(get_microbatch(train_ds, 0, 0, 4, 0, 1), batch)
    # Evaluation wraps around the validation set.
    assert_same_batch(get_microbatch(valid_ds, len(valid_ds) + 3, 0, 2, 0, 1),
                      get_microbatch(valid_ds, 3, 0, 2, 0, 1))

    _, no_valid = build_datasets(data_args(tmp_path, mock_data=True, eval_iters=0), tok)
    assert no_valid is None


def test_weighted_blend_without_torch_distributed(tmp_path):
    first = preprocess(tmp_path, TEXTS, "first")
    second = preprocess(tmp_path, [t.upper() for t in TEXTS], "second")
    args = data_args(tmp_path, data_path=["0.3", first, "0.7", second])
    train_ds, valid_ds = build_datasets(args, build_tokenizer(args))
    assert not dist.is_initialized()
    assert len(train_ds) == args.train_iters * args.global_batch_size
    assert len(valid_ds) > 0
    batch = get_microbatch(train_ds, 0, 0, 4, 0, 1)
    assert torch.equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])


def test_split_without_documents_fails_instead_of_hanging(tmp_path):
    prefix = preprocess(tmp_path, TEXTS[:10])
    # 10 documents: the 3% validation share of "969, 30, 1" rounds to none.
    args = data_args(tmp_path, data_path=[prefix], split="969, 30, 1")
    with pytest.raises(ValueError, match="gives the valid split no tokens"):
        build_datasets(args, build_tokenizer(args))
    with pytest.raises(ValueError, match="leaves nothing for training"):
        build_datasets(data_args(tmp_path, data_path=[prefix], split="0,1,0"), build_tokenizer(args))


def _forward_step_inputs_on_cp_rank(rank: int, store_path: str, out_dir: str) -> None:
    """One of two ranks with megatron-core's groups built for context parallel 2 (gloo): runs the
    trainer's forward step over a recording model and saves what the model and the loss were given."""
    from functools import partial

    from megatron.core import parallel_state

    from megatron_resil import training
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    seen = {}

    def model(tokens, position_ids, attention_mask, labels):
        seen.update(tokens=tokens, position_ids=position_ids, labels=labels)
        return torch.zeros(labels.shape)

    sequence = torch.arange(8)  # a sample whose every field spells out its token positions
    dataset = [{"tokens": sequence + 100 * i, "labels": sequence + 100 * i + 1000,
                "loss_mask": sequence + 100 * i + 2000, "position_ids": sequence} for i in range(2)]
    args = argparse.Namespace(micro_batch_size=2, context_parallel_size=2)
    _, loss = training._forward_step(args, dataset, 0, None, iter([0]), model)
    assert isinstance(loss, partial)
    seen["loss_mask"] = loss.args[0]
    torch.save(seen, Path(out_dir) / f"{rank}.pt")
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def test_each_context_parallel_rank_gets_its_load_balanced_part_of_the_sequence(tmp_path):
    """Context parallel 2 splits a sequence of 8 into 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1
    chunks 1 and 2 (megatron-core's load balancing for causal attention), the same positions in every
    field. Before, every context-parallel rank was handed the whole sequence."""
    context = torch.multiprocessing.get_context("fork")  # the children need no imports of their own
    workers = [context.Process(target=_forward_step_inputs_on_cp_rank,
                               args=(rank, str(tmp_path / "store"), str(tmp_path))) for rank in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    assert [worker.exitcode for worker in workers] == [0, 0]
    expected = {0: [0, 1, 6, 7], 1: [2, 3, 4, 5]}
    for rank, positions in expected.items():
        seen = torch.load(tmp_path / f"{rank}.pt")
        chunk = torch.tensor(positions)
        assert torch.equal(seen["position_ids"], torch.stack([chunk, chunk]))
        for key, offset in (("tokens", 0), ("labels", 1000), ("loss_mask", 2000)):
            assert torch.equal(seen[key], torch.stack([chunk + offset, chunk + 100 + offset])), key
