"""What a save costs the trainer, with and without --async-save, for both checkpoint tiers (issue 38).

    python benchmarks/bench_async.py                    # 2 ranks, 6x1024 GPT, 1.1 GB of state a save, ~12 min
    python benchmarks/bench_async.py --quick            # smoke run, numbers not meaningful
    python benchmarks/bench_async.py --repo CHECKOUT    # the same runs of another checkout (a baseline)
    python benchmarks/bench_async.py --idle-ranks 4     # ranks sleep 4 s an iteration: the write alone

Each variant is a real `pretrain.py` run under torchrun on loopback (gloo), timed from its own event log. The
model is 6 layers x 1024 hidden with a 16384-token vocabulary, DDP without the distributed optimizer: each
rank holds 94M fp32 parameters and Adam's two moments, 1.1 GB of checkpointed state, of which it writes
half. Variants, in one run (interleaved; order reversed every other repeat):

    none          no save inside the window
    sync          --save-interval K                                     (persistent tier, synchronous)
    async         --save-interval K --async-save
    local-sync    --non-persistent-ckpt-type local --non-persistent-save-interval K
    local-async   the same with --async-save

Five interval saves per variant fall inside the window (iterations 1 to 18, a save every 3), each far
enough from the next that the background write finishes first (checked: a save that found its predecessor
still writing is counted, from the event log's `save_busy`). The first async save also allocates the
staging arena and plans from scratch; its blocking time is printed apart, and the median of five is the
steady state a long run sees.

The figure per tier, the trainer-blocked ratio: the median per-save time the trainer was blocked by an
async save (`save_published`'s `blocking_seconds`: building the state, staging, waiting, finalising) over
the median time of a synchronous save of the same tier (its `seconds`). Goal <= 0.1. Beside it the
extra-loop-time ratio: (loop time with async saves - without saves) / (with synchronous saves - without),
which also counts what the background write takes from training (the cores it shares with the ranks).
Per save the blocking parts and the worker's phases (serialise, checksum, replicate, write) are printed.

The background write competes with training for the host's cores here (two ranks keep both busy), so its
wall time (`worker_seconds`) is not the write's own speed. With --idle-ranks S every rank sleeps S seconds
before each iteration (an injected `slow` fault), leaving the cores to the worker as a GPU node's idle host
cores would: then the background write's wall time compares with a synchronous save's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
from megatron_resil.launch.ports import free_loopback_port  # noqa: E402 - after the path above

FULL = {"shape": (6, 1024, 16), "seq": 64, "vocab": 16384, "iters": 18, "interval": 3, "repeats": 1}
QUICK = {"shape": (2, 64, 4), "seq": 64, "vocab": 1024, "iters": 8, "interval": 2, "repeats": 1}
VARIANTS = ("none", "sync", "async", "local-sync", "local-async")
TIERS = (("persistent", "sync", "async"), ("local", "local-sync", "local-async"))
GOAL = 0.1


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def run_variant(variant: str, workdir: str, cfg: dict, nproc: int, repo: str, extra: list[str]) -> dict:
    layers, hidden, heads = cfg["shape"]
    save = tempfile.mkdtemp(prefix=f"{variant}-", dir=workdir)
    never = str(10 * cfg["iters"])  # an interval past the end: no save inside the window
    argv = ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--seq-length", str(cfg["seq"]), "--max-position-embeddings", str(cfg["seq"]),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(cfg["vocab"]), "--micro-batch-size", "1",
            "--global-batch-size", str(nproc), "--train-iters", str(cfg["iters"]), "--lr", "1e-4",
            "--min-lr", "1e-5", "--mock-data", "--eval-iters", "0", "--log-interval", "1", "--save", save,
            "--save-interval", never, *extra]
    interval = str(cfg["interval"])
    if variant in ("sync", "async"):
        argv[argv.index("--save-interval") + 1] = interval
    if variant.startswith("local"):
        argv += ["--non-persistent-ckpt-type", "local", "--non-persistent-save-interval", interval,
                 "--non-persistent-local-ckpt-dir", os.path.join(save, "local")]
    if variant.endswith("async"):
        argv += ["--async-save"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_loopback_port()}",
           "--local-addr", "127.0.0.1",
           os.path.join(repo, "pretrain.py"), *argv]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p),
           "GLOO_SOCKET_IFNAME": "lo", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(cmd, cwd=repo, env=env, timeout=1800, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    try:
        with open(os.path.join(save, "events.jsonl")) as f:
            log = [json.loads(line) for line in f if line.strip()]
        progress = {e["iteration"]: e["unix"] for e in log if e["event"] == "progress"}
        saves = [e for e in log if e["event"] == "save_published" and e["iteration"] < cfg["iters"]]
        started = sorted(e["unix"] for e in log
                         if e["event"] == "save_started" and e["iteration"] < cfg["iters"])
        blocking = [e["blocking_seconds"] if e.get("asynchronous") else e["seconds"] for e in saves]
        parts: dict[str, list[float]] = {}
        for e in saves:
            for part, seconds in (e.get("blocking_parts") or {"save": e["seconds"]}).items():
                parts.setdefault(part, []).append(seconds)
            for key, seconds in e.items():
                if key.startswith("worker_") and isinstance(seconds, (int, float)):
                    parts.setdefault(key, []).append(seconds)
        if done.returncode != 0:
            raise ValueError(f"exit code {done.returncode}")
        return {"window_s": progress[cfg["iters"]] - progress[1], "saves": len(saves),
                "per_save_blocking_s": _median(blocking), "blocking_s": sum(blocking),
                "first_blocking_s": blocking[0] if blocking else None,
                "per_save_total_s": _median([e["seconds"] for e in saves]),
                "parts": {part: statistics.median(v) for part, v in sorted(parts.items())},
                "interval_s": _median([b - a for a, b in zip(started, started[1:], strict=False)]),
                "busy": sum(e["event"] == "save_busy" for e in log),
                "checkpoint_bytes": _tree_bytes(save, variant)}
    except (OSError, KeyError, ValueError) as err:
        raise SystemExit(f"{variant}: no timing ({err}), exit code {done.returncode}; output tail:\n"
                         f"{done.stdout[-3000:]}") from None
    finally:
        shutil.rmtree(save, ignore_errors=True)


def _tree_bytes(save: str, variant: str) -> int:
    """The bytes of one save: the local tier's (it keeps one iteration), or the first persistent one's."""
    if variant.startswith("local"):
        top = os.path.join(save, "local")
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(top) for f in files
                   if f.endswith("_local.pt"))
    published = sorted(n for n in os.listdir(save) if n.startswith("iter_"))
    if not published:
        return 0
    top = os.path.join(save, published[0])
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(top) for f in files)


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repo", default=REPO, help="the checkout whose pretrain.py runs (default: this)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated subset (none is implied)")
    parser.add_argument("--idle-ranks", type=float, default=None, metavar="S",
                        help="every rank sleeps S seconds before each iteration (cores left to the worker)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None, help="also write the raw measurements here")
    parser.add_argument("extra", nargs="*", help="more pretrain.py arguments for every variant (after --)")
    opts = parser.parse_args()
    cfg = dict(QUICK if opts.quick else FULL)
    cfg["repeats"] = opts.repeats or cfg["repeats"]
    extra = list(opts.extra)
    if opts.idle_ranks is not None:
        extra += ["--inject-fault", "slow", "--inject-fault-iteration", "1", "--inject-fault-repeat",
                  "--inject-fault-ranks", ",".join(str(r) for r in range(opts.nproc)),
                  "--inject-fault-slow-secs", str(opts.idle_ranks)]
    repo = os.path.abspath(opts.repo)
    if not os.path.isfile(os.path.join(repo, "pretrain.py")):
        parser.error(f"--repo {opts.repo}: no pretrain.py there")
    variants = ["none"] + [v for v in opts.variants.split(",") if v and v != "none"]
    workdir = tempfile.mkdtemp(prefix="bench_async_", dir=opts.workdir)
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    try:
        for r in range(cfg["repeats"]):
            for variant in (variants if r % 2 == 0 else variants[::-1]):
                got = run_variant(variant, workdir, cfg, opts.nproc, repo, extra)
                runs[variant].append(got)
                parts = ", ".join(f"{p} {v:.3f}" for p, v in got["parts"].items())
                per_save = "" if not got["saves"] else (
                    f", per save {got['per_save_blocking_s']:.3f} s blocking of "
                    f"{got['per_save_total_s']:.3f} s, the first {got['first_blocking_s']:.3f} s ({parts}); "
                    f"{got['checkpoint_bytes'] / 2**20:.0f} MiB; "
                    f"saves {got['interval_s'] or 0:.1f} s apart, {got['busy']} found the last one writing")
                print(f"  repeat {r + 1} {variant:12s} loop {got['window_s']:7.2f} s, {got['saves']} "
                      f"saves{per_save}", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    layers, hidden, _ = cfg["shape"]
    print(f"\n{opts.nproc} rank(s), {layers}x{hidden} GPT, vocabulary {cfg['vocab']}, {cfg['iters']} "
          f"iterations, a save every {cfg['interval']}, {cfg['repeats']} repeat(s), {repo}; seconds, median "
          "(min-max)")
    ratios: dict[str, dict] = {}
    for tier, sync, asynchronous in TIERS:
        if sync not in runs or asynchronous not in runs:
            continue
        blocked = [a["per_save_blocking_s"] / s["per_save_total_s"]
                   for a, s in zip(runs[asynchronous], runs[sync], strict=True)]
        loops = [(a["window_s"] - n["window_s"]) / (s["window_s"] - n["window_s"])
                 for a, s, n in zip(runs[asynchronous], runs[sync], runs["none"], strict=True)
                 if s["window_s"] > n["window_s"]]
        ratios[tier] = {"blocked": blocked, "extra_loop": loops}
        sync_s = [s["per_save_total_s"] for s in runs[sync]]
        async_s = [a["per_save_blocking_s"] for a in runs[asynchronous]]
        written = [a["parts"].get("worker_seconds") for a in runs[asynchronous]]
        print(f"{tier} tier: trainer blocked per async save / synchronous save = {_fmt(blocked)} "
              f"({_fmt(async_s)} s / {_fmt(sync_s)} s; goal <= {GOAL}); extra loop time, async / sync = "
              + (_fmt(loops) if loops else "n/a")
              + (f"; the background write {_fmt(written)} s" if None not in written else ""))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"config": cfg, "nproc": opts.nproc, "repo": repo, "runs": runs, "ratios": ratios}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
