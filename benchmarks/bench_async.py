"""What a save costs the training loop, with and without --async-save, for both checkpoint tiers.

    python benchmarks/bench_async.py              # full run: 2 ranks, 4x768 GPT (~337 MiB a save), ~10 min
    python benchmarks/bench_async.py --quick      # smoke run, numbers not meaningful
    python benchmarks/bench_async.py --nproc 1    # one rank: a core left free for the writer

Each variant is a real `pretrain.py` run under torchrun on loopback (gloo), timed from its own event log:
the loop's wall time from the end of iteration 1 to the end of the last iteration, which holds every
interval save (the final save comes after it). Variants, interleaved within each repeat (order reversed
every other repeat):

    none          no save inside the window
    sync          --save-interval K                                     (persistent tier, synchronous)
    async         --save-interval K --async-save
    local-sync    --non-persistent-ckpt-type local --non-persistent-save-interval K
    local-async   the same with --async-save

extra(v) = window(v) - window(none) of the same repeat: what saving cost the loop. Reported per tier:
async extra / sync extra (issue 15's goal: <= 0.1) and the median per-save blocking time the trainer
itself spent (`save_published` seconds of a synchronous save, `blocking_seconds` of an async one:
preparing, staging, finalising, waiting for the worker). What an async variant lost beyond its blocking
time is contention: the writer and the ranks sharing the cores. Per save, the blocking parts (prepare:
building the sharded state; stage: snapshot, planning, common.pt, hand-over; wait: for the worker;
finalize: global metadata, manifest, rename, tracker) and the worker's CPU seconds are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN = os.path.join(REPO, "pretrain.py")
FULL = {"shape": (4, 768, 12), "iters": 45, "interval": 5, "repeats": 3}
QUICK = {"shape": (2, 64, 4), "iters": 12, "interval": 4, "repeats": 1}
VARIANTS = ("none", "sync", "async", "local-sync", "local-async")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_variant(variant: str, workdir: str, cfg: dict, nproc: int, extra: list[str]) -> dict:
    layers, hidden, heads = cfg["shape"]
    save = tempfile.mkdtemp(prefix=f"{variant}-", dir=workdir)
    never = str(10 * cfg["iters"])  # an interval past the end: no save inside the window
    argv = ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--seq-length", "256", "--max-position-embeddings", "256", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "1024", "--micro-batch-size", "1", "--global-batch-size", str(nproc),
            "--train-iters", str(cfg["iters"]), "--lr", "1e-4", "--min-lr", "1e-5", "--mock-data",
            "--eval-iters", "0", "--log-interval", "1", "--save", save, "--save-interval", never, *extra]
    interval = str(cfg["interval"])
    if variant in ("sync", "async"):
        argv[argv.index("--save-interval") + 1] = interval
    if variant.startswith("local"):
        argv += ["--non-persistent-ckpt-type", "local", "--non-persistent-save-interval", interval,
                 "--non-persistent-local-ckpt-dir", os.path.join(save, "local")]
    if variant.endswith("async"):
        argv += ["--async-save"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_port()}", "--local-addr", "127.0.0.1",
           PRETRAIN, *argv]
    done = subprocess.run(cmd, cwd=REPO, timeout=900, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    try:
        with open(os.path.join(save, "events.jsonl")) as f:
            log = [json.loads(line) for line in f if line.strip()]
        progress = {e["iteration"]: e["unix"] for e in log if e["event"] == "progress"}
        saves = [e for e in log if e["event"] == "save_published" and e["iteration"] < cfg["iters"]]
        blocking = [e["blocking_seconds"] if e.get("asynchronous") else e["seconds"] for e in saves]
        parts: dict[str, list[float]] = {}
        for e in saves:
            for part, seconds in (e.get("blocking_parts") or {"save": e["seconds"]}).items():
                parts.setdefault(part, []).append(seconds)
        worker_cpu = [e["worker_cpu_seconds"] for e in saves if "worker_cpu_seconds" in e]
        return {"window_s": progress[cfg["iters"]] - progress[1], "saves": len(saves),
                "blocking_parts": {part: statistics.median(v) for part, v in parts.items()},
                "worker_cpu_s": statistics.median(worker_cpu) if worker_cpu else None,
                "blocking_s": sum(blocking),
                "per_save_blocking_s": statistics.median(blocking) if blocking else 0.0,
                "per_save_total_s": statistics.median(e["seconds"] for e in saves) if saves else 0.0}
    except (OSError, KeyError, ValueError) as err:
        raise SystemExit(f"{variant}: no timing ({err}), exit code {done.returncode}; output tail:\n"
                         f"{done.stdout[-3000:]}") from None
    finally:
        shutil.rmtree(save, ignore_errors=True)


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated subset (none is implied)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None, help="also write the raw measurements here")
    parser.add_argument("extra", nargs="*", help="more pretrain.py arguments for every variant (after --)")
    opts = parser.parse_args()
    cfg = dict(QUICK if opts.quick else FULL)
    cfg["repeats"] = opts.repeats or cfg["repeats"]
    variants = ["none"] + [v for v in opts.variants.split(",") if v and v != "none"]
    workdir = tempfile.mkdtemp(prefix="bench_async_", dir=opts.workdir)
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    try:
        for r in range(cfg["repeats"]):
            for variant in (variants if r % 2 == 0 else variants[::-1]):
                got = run_variant(variant, workdir, cfg, opts.nproc, opts.extra)
                runs[variant].append(got)
                parts = ", ".join(f"{p} {v:.3f}" for p, v in got["blocking_parts"].items())
                cpu = f"; worker CPU {got['worker_cpu_s']:.3f} s" if got["worker_cpu_s"] is not None else ""
                print(f"  repeat {r + 1} {variant:12s} loop {got['window_s']:7.2f} s, {got['saves']} saves, "
                      f"blocking {got['blocking_s']:6.2f} s (per save {got['per_save_blocking_s']:.3f} s of "
                      f"{got['per_save_total_s']:.3f} s: {parts}{cpu})", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    extra = {v: [run["window_s"] - base["window_s"] for run, base in zip(runs[v], runs["none"], strict=True)]
             for v in variants if v != "none"}
    layers, hidden, _ = cfg["shape"]
    print(f"\n{opts.nproc} rank(s), {layers}x{hidden} GPT, {cfg['iters']} iterations, a save every "
          f"{cfg['interval']}, {cfg['repeats']} repeat(s); seconds, median (min-max)")
    print(f"{'variant':12s} {'loop':>22s} {'extra over none':>22s} {'blocking, all saves':>22s} "
          f"{'contention':>22s}")
    for v in variants:
        loop = _fmt([run["window_s"] for run in runs[v]])
        if v == "none":
            print(f"{v:12s} {loop:>22s}")
            continue
        blocking = [run["blocking_s"] for run in runs[v]]
        contention = [e - b for e, b in zip(extra[v], blocking, strict=True)]
        print(f"{v:12s} {loop:>22s} {_fmt(extra[v]):>22s} {_fmt(blocking):>22s} {_fmt(contention):>22s}")
    ratios = {}
    for tier, sync, asynchronous in (("persistent", "sync", "async"), ("local", "local-sync", "local-async")):
        if sync in extra and asynchronous in extra:
            per_repeat = [a / s for a, s in zip(extra[asynchronous], extra[sync], strict=True) if s > 0]
            if per_repeat:
                ratios[tier] = per_repeat
                loops = [a["window_s"] / s["window_s"]
                         for a, s in zip(runs[asynchronous], runs[sync], strict=True)]
                print(f"{tier} tier: async extra / sync extra = {_fmt(per_repeat)} (goal <= 0.1); "
                      f"async loop / sync loop = {_fmt(loops)}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"config": cfg, "nproc": opts.nproc, "runs": runs, "ratios": ratios}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
