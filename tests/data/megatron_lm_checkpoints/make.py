"""Writes <layout>/checkpoint here: checkpoints written by Megatron-LM's own `save_checkpoint`, with
<layout>/reference (what each rank held when it saved), and made_by.json: the commands, versions, the
losses our uninterrupted run printed after the save, and what Megatron-LM's `load_checkpoint` made of
our checkpoints.

For each layout (2 ranks: TP 2 and PP 2 with the distributed optimizer, an MoE with EP 2, and the same MoE
saved by a Megatron-LM that keeps RNG states per (pipeline, tensor) rank under expert parallelism, as
every release but core_v0.16.x does):
1. pretrain.py (this interpreter) trains 4 iterations and saves iteration 2; its losses at 3 and 4 are
   recorded.
2. megatron_side.py runs under torchrun with --megatron-lm-python and Megatron-LM's tree at --commit
   (--main-commit for `ep2_moe_main`) first on its path: it loads our iteration 2 with megatron-resil's
   loader, saves it with Megatron-LM's `save_checkpoint` (the committed checkpoint), and loads ours and
   its own save with Megatron-LM's `load_checkpoint`, comparing every tensor with megatron-resil's load.
3. For each --check-commit (e.g. Megatron-LM's main), step 2 again with that tree: verdicts only, nothing
   of it is committed.
4. engine_state.py loads each Megatron-LM save with megatron-resil's loader and compares every tensor with
   what Megatron-LM held: run by this interpreter and by --our-second-python (the second lane's).

    python tests/data/megatron_lm_checkpoints/make.py --megatron-lm-git DIR \\
        --megatron-lm-python /path/to/python3.12 [--commit core_v0.16.1] [--main-commit HEAD] \\
        [--check-commit HEAD] [--our-second-python /path/to/lane2/python] [--layout NAME]

--megatron-lm-python needs torch, megatron-core's dependencies and what Megatron-LM's `megatron.training`
imports (six, regex): give extra packages through PYTHONPATH, which is kept after the tree and this checkout.
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
sys.path.insert(0, str(REPO))

from tests import launch  # noqa: E402

# Tiny, and one layer where the layout allows: a torch_dist checkpoint's size goes with its item count.
MODEL = ["--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
         "--max-position-embeddings", "8", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32",
         "--make-vocab-size-divisible-by", "8", "--disable-bias-linear"]
TRAINING = ["--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "1e-3", "--min-lr", "1e-4",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--mock-data", "--log-interval", "1",
            "--eval-interval", "1000", "--eval-iters", "1", "--train-iters", "4"]
DISTRIBUTED_OPTIMIZER = ["--use-distributed-optimizer"]
EP2_MOE = ["--num-layers", "1", "--num-experts", "2", "--moe-router-topk", "2",
           "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
           *DISTRIBUTED_OPTIMIZER]
LAYOUTS = {
    "tp2_distopt": ["--num-layers", "1", "--tensor-model-parallel-size", "2", *DISTRIBUTED_OPTIMIZER],
    "pp2_distopt": ["--num-layers", "2", "--pipeline-model-parallel-size", "2", *DISTRIBUTED_OPTIMIZER],
    "ep2_moe": EP2_MOE,
    "ep2_moe_main": EP2_MOE,
}
# Saved by --main-commit rather than --commit: core_v0.16.x keeps the RNG states per data-parallel rank too
# under expert parallelism, the Megatron-LM of the second lane's megatron-core (0.19) does not.
SAVED_BY_MAIN = {"ep2_moe_main"}
TRACKER = "latest_checkpointed_iteration.txt"
SAVED_AT = 2


def _our_env() -> dict:
    env = launch.env()
    env.pop("PYTHONPATH", None)  # what the caller gave the second Python is not for this one
    return env


def _run(cmd: list[str], env: dict, what: str) -> str:
    result = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=900)
    if result.returncode != 0:
        sys.exit(f"make.py: {what} failed ({' '.join(cmd)}):\n{result.stdout[-6000:]}")
    return result.stdout


def _torchrun(python: str, script: str, args: list[str]) -> list[str]:
    return [python, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
            script, *args]


def _tree(git_dir: str, rev: str, into: Path) -> str:
    commit = subprocess.run(["git", "--git-dir", git_dir, "rev-parse", f"{rev}^{{commit}}"], check=True,
                            capture_output=True, text=True).stdout.strip()
    archive = subprocess.run(["git", "--git-dir", git_dir, "archive", commit, "megatron"], check=True,
                             capture_output=True).stdout
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return commit


def _megatron_side(python: str, tree: Path, flags: list[str], ours: Path, out: Path) -> dict:
    """megatron_side.py with Megatron-LM's tree first on the path; its verdicts."""
    extra = os.environ.get("PYTHONPATH")
    env = {**launch.env(), "CUDA_DEVICE_MAX_CONNECTIONS": "1",
           "PYTHONPATH": os.pathsep.join([str(tree), str(REPO), *([extra] if extra else [])])}
    verdict = out / "verdict.json"
    result = subprocess.run(
        _torchrun(python, str(HERE / "megatron_side.py"),
                  [*flags, "--ours", str(ours), "--theirs", str(out / "checkpoint"),
                   "--reference", str(out / "reference"), "--verdict", str(verdict)]),
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    (out / "megatron_side.log").write_text(result.stdout)
    if not verdict.exists():
        sys.exit(f"make.py: Megatron-LM's side wrote no verdict (exit {result.returncode}):\n"
                 f"{result.stdout[-6000:]}")
    return json.loads(verdict.read_text())


def _versions(python: str, path: str | None = None) -> str:
    env = {**_our_env(), **({"PYTHONPATH": path} if path else {})}
    code = ("import platform, torch; from megatron.core import package_info as p; print(f'Python "
            "{platform.python_version()}, torch {torch.__version__}, megatron-core {p.__version__}')")
    return subprocess.run([python, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def _our_load(python: str, flags: list[str], out: Path) -> str:
    """engine_state.py (megatron-resil's loader, run by `python` with this checkout on its path) on what
    Megatron-LM saved: its verdict."""
    env = {**_our_env(), "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        _torchrun(python, str(HERE / "engine_state.py"),
                  [*flags, "--load", str(out / "checkpoint"), "--reference", str(out / "reference")]),
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    lines = [line for line in result.stdout.splitlines()
             if line.startswith("[state]") or line.startswith("[resil] load: rejected")
             or line.startswith("[resil] exit:")]
    return (f"exit {result.returncode}: " + " | ".join(lines)).replace(str(out / "checkpoint"), "<its save>")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-lm-git", required=True, help="a git directory of NVIDIA/Megatron-LM")
    parser.add_argument("--commit", default="core_v0.16.1",
                        help="the Megatron-LM whose save_checkpoint writes the committed checkpoints")
    parser.add_argument("--main-commit", default="HEAD",
                        help="the Megatron-LM whose save_checkpoint writes the layouts saved by main "
                             f"({', '.join(sorted(SAVED_BY_MAIN))})")
    parser.add_argument("--check-commit", action="append", default=[],
                        help="another Megatron-LM to run both ways against ours (verdicts only)")
    parser.add_argument("--megatron-lm-python", required=True, help="a Python with torch (see above)")
    parser.add_argument("--our-second-python",
                        help="another Python with megatron-resil's dependencies (e.g. the second lane's) "
                             "that loads each Megatron-LM save too")
    parser.add_argument("--layout", action="append", choices=sorted(LAYOUTS),
                        help="only these layouts (default: all)")
    opts = parser.parse_args()
    layouts = opts.layout or list(LAYOUTS)
    record: dict = {"megatron_lm": "https://github.com/NVIDIA/Megatron-LM", "saved_at": SAVED_AT,
                    "model_flags": MODEL, "training_flags": TRAINING, "layouts": {},
                    "ours": {"first": _versions(sys.executable)}}
    loaders = {"first": sys.executable}
    if opts.our_second_python:
        loaders["second"] = opts.our_second_python
        record["ours"]["second"] = _versions(opts.our_second_python, str(REPO))
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        revs = list(dict.fromkeys([opts.commit, opts.main_commit, *opts.check_commit]))
        commits = {rev: _tree(opts.megatron_lm_git, rev, tmp / f"tree{i}") for i, rev in enumerate(revs)}
        trees = {rev: tmp / f"tree{i}" for i, rev in enumerate(revs)}
        record["commit"] = {"ref": opts.commit, "sha": commits[opts.commit]}
        record["main_commit"] = {"ref": opts.main_commit, "sha": commits[opts.main_commit]}
        record["check_commits"] = {rev: commits[rev] for rev in opts.check_commit}
        for name in layouts:
            saving = opts.main_commit if name in SAVED_BY_MAIN else opts.commit
            flags = [*MODEL, *TRAINING, *LAYOUTS[name]]
            run = tmp / name / "run"
            out = _run(launch.torchrun_cmd([*flags, "--save", str(run), "--save-interval", str(SAVED_AT)]),
                       _our_env(), f"pretrain.py ({name})")
            losses = {str(k): v for k, v in launch.losses(out).items() if k > SAVED_AT}
            ours = tmp / name / "ours"
            shutil.copytree(run / f"iter_{SAVED_AT:07d}", ours / f"iter_{SAVED_AT:07d}")
            (ours / TRACKER).write_text(f"{SAVED_AT}\n")
            entry = {"flags": LAYOUTS[name], "losses_after_save": losses, "megatron_lm": {},
                     "saved_by": f"{saving} ({commits[saving][:12]})"}
            for i, rev in enumerate(dict.fromkeys([saving, *opts.check_commit])):
                side = tmp / name / f"megatron_{i}"
                side.mkdir()
                verdict = _megatron_side(opts.megatron_lm_python, trees[rev], flags, ours, side)
                if (side / "checkpoint" / TRACKER).exists():
                    for which, python in loaders.items():
                        verdict[f"megatron-resil's load of its save ({which} Python)"] = \
                            _our_load(python, flags, side)
                entry["megatron_lm"][f"{rev} ({commits[rev][:12]})"] = verdict
                if rev == saving and (side / "checkpoint" / TRACKER).exists():
                    target = HERE / name
                    shutil.rmtree(target, ignore_errors=True)
                    shutil.copytree(side / "checkpoint", target / "checkpoint")
                    shutil.copytree(side / "reference", target / "reference")
            record["layouts"][name] = entry
            print(json.dumps({name: entry}, indent=1), flush=True)
    made_by = HERE / "made_by.json"
    if opts.layout and made_by.exists():  # a partial run keeps the other layouts' records
        kept = json.loads(made_by.read_text())
        record["layouts"] = {**kept.get("layouts", {}), **record["layouts"]}
    made_by.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
