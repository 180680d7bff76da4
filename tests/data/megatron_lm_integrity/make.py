"""Writes checkpoint/ here: two torch_dist checkpoints in Megatron-LM's layout whose integrity manifests
(`integrity.json`) Megatron-LM's own code wrote, and made_by.json, what its own code said of ours.

1. pretrain.py (this interpreter, megatron-core 0.16.1) trains a tiny GPT on 1 rank and saves iterations
   1 and 2 with --verify-integrity.
2. tests/megatron_lm_layout.py (Megatron-LM's load and save paths, core_v0.16.1) loads each and writes it
   back as Megatron-LM does: in place, no manifest of ours, the tracker overwritten.
3. Megatron-LM at the given commit (extracted from a git directory, on the path of a second Python that
   has torch) runs `megatron.core.dist_checkpointing.validation.save_integrity_manifest` on those two,
   then `verify_integrity_manifest` on them and on our two checkpoints of step 1, and writes its own
   manifest for a copy of ours (our two manifests removed) to compare with the bytes we wrote. Any
   failure stops the script.

    python tests/data/megatron_lm_integrity/make.py --megatron-lm-git DIR [--commit REV] \\
        --megatron-lm-python /path/to/python3.12
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
MODEL = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
         "--max-position-embeddings", "8", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32",
         "--make-vocab-size-divisible-by", "8", "--micro-batch-size", "1", "--lr", "1e-3", "--mock-data",
         "--log-interval", "1", "--train-iters", "2"]
TRACKER = "latest_checkpointed_iteration.txt"

# Run by Megatron-LM's Python: argv = Megatron-LM's checkpoints, ours, a scratch directory.
MEGATRON_SIDE = r"""
import json, os, shutil, sys
import torch
from megatron.core import package_info
from megatron.core.dist_checkpointing.validation import save_integrity_manifest, verify_integrity_manifest

theirs, ours, scratch = sys.argv[1:4]
verdicts = {}
def verify(name, path):
    try:
        verify_integrity_manifest(path)
        verdicts[name] = "verify_integrity_manifest: accepted"
    except Exception as err:
        verdicts[name] = f"verify_integrity_manifest: {type(err).__name__}: {err}"
for it in ("iter_0000001", "iter_0000002"):
    save_integrity_manifest(os.path.join(theirs, it))
    verify(f"Megatron-LM's checkpoint {it}, its manifest", os.path.join(theirs, it))
    verify(f"our checkpoint {it} (--verify-integrity)", os.path.join(ours, it))
copy = os.path.join(scratch, "copy")
shutil.copytree(os.path.join(ours, "iter_0000002"), copy,
                ignore=shutil.ignore_patterns("integrity.json", "resil_manifest.json"))
save_integrity_manifest(copy)
same = open(os.path.join(copy, "integrity.json"), "rb").read() == \
    open(os.path.join(ours, "iter_0000002", "integrity.json"), "rb").read()
verdicts["our iter_0000002's integrity.json against save_integrity_manifest's for its files"] = \
    "byte-identical" if same else "differs"
print(json.dumps({"megatron_core": package_info.__version__, "torch": torch.__version__,
                  "python": sys.version.split()[0], "verdicts": verdicts}))
"""


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               MASTER_ADDR="127.0.0.1")
    env.pop("PYTHONPATH", None)
    return env


def _torchrun(script: str, args: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", "1", script, *args]
    result = subprocess.run(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    if result.returncode != 0:
        sys.exit(f"make.py: {' '.join(cmd)} failed:\n{result.stdout[-4000:]}")


def _commit_and_tree(git_dir: str, rev: str, into: Path) -> str:
    commit = subprocess.run(["git", "--git-dir", git_dir, "rev-parse", f"{rev}^{{commit}}"], check=True,
                            capture_output=True, text=True).stdout.strip()
    archive = subprocess.run(["git", "--git-dir", git_dir, "archive", commit, "megatron"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return commit


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-lm-git", required=True, help="a git directory of NVIDIA/Megatron-LM")
    parser.add_argument("--commit", default="HEAD")
    parser.add_argument("--megatron-lm-python", required=True,
                        help="a Python with torch and numpy (Megatron-LM's megatron.core needs them)")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        ours, theirs, snapshot = tmp / "ours", tmp / "theirs", tmp / "megatron-lm"
        snapshot.mkdir()
        commit = _commit_and_tree(opts.megatron_lm_git, opts.commit, snapshot)
        _torchrun("pretrain.py", [*MODEL, "--save", str(ours), "--save-interval", "1", "--verify-integrity"])
        for iteration in (1, 2):
            one = tmp / f"ours_{iteration}"
            shutil.copytree(ours / f"iter_{iteration:07d}", one / f"iter_{iteration:07d}")
            (one / TRACKER).write_text(f"{iteration}\n")
            _torchrun("tests/megatron_lm_layout.py",
                      ["--megatron-load", str(one), "--megatron-save", str(theirs), *MODEL])
        result = subprocess.run([opts.megatron_lm_python, "-c", MEGATRON_SIDE, str(theirs), str(ours),
                                 tmp_name], env={**_env(), "PYTHONPATH": str(snapshot)}, capture_output=True,
                                text=True)
        if result.returncode != 0:
            sys.exit(f"make.py: Megatron-LM's side failed:\n{result.stderr[-4000:]}")
        made = json.loads(result.stdout.strip().splitlines()[-1])
        bad = {k: v for k, v in made["verdicts"].items() if v not in ("verify_integrity_manifest: accepted",
                                                                      "byte-identical")}
        if bad:
            sys.exit(f"make.py: Megatron-LM's code disagrees: {bad}")
        target = HERE / "checkpoint"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(theirs, target)
    record = {"megatron_lm": "https://github.com/NVIDIA/Megatron-LM", "commit": commit,
              "integrity_manifest_written_by":
                  "megatron.core.dist_checkpointing.validation.save_integrity_manifest",
              "checkpoint_written_by": "tests/megatron_lm_layout.py (Megatron-LM core_v0.16.1's save path, "
                                       "megatron-core 0.16.1)",
              **made}
    (HERE / "made_by.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(json.dumps(record, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
