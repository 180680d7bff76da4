"""What the standby's clients cost while their workers train (megatron_resil/launch/standby.py, `_mirror`).

Each rank started with a standby is two processes: the client the launcher started, which stays the rank to
the launcher, and the worker forked from the standby, which trains. A client should cost nothing while its
worker trains. Measured in one run: a standby, torchrun with N ranks of the tiny model forked from it, and
the CPU time of the clients and of the workers (with everything they start), read from /proc every 0.1 s
past the start-up (the first fifth of the run) to its end; the clients' share of it, and the clients' CPU
per second of wall; and the standby's own CPU (it looks at its clients every 20 ms for a stop).

    python benchmarks/bench_standby_clients.py [--nproc 4] [--iters 150]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import harness

from megatron_resil.launch import standby
from megatron_resil.rank_process import children_of, descendants_of

ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
        "--micro-batch-size", "2", "--lr", "1e-3", "--mock-data", "--log-interval", "1"]
_TICK = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--iters", type=int, default=150)
    opts = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench_standby_clients_"))
    name = f"bench-clients-{os.getpid()}"
    env = harness.child_env()
    server = subprocess.Popen([sys.executable, "-m", "megatron_resil.launch.standby", "--name", name,
                               "--import-megatron-core"], env=env, cwd=harness.REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in server.stdout:  # its ready line
            if "are forked from it" in line:
                break
        else:
            raise SystemExit("the standby did not start")
        env[standby.ENV] = f"{name}@{server.pid}"
        log = scratch / "run.log"
        run = subprocess.Popen([*harness.torchrun(opts.nproc), str(harness.REPO / "pretrain.py"), *ARGS,
                                "--train-iters", str(opts.iters)], env=env, cwd=harness.REPO,
                               stdout=open(log, "w"), stderr=subprocess.STDOUT)
        last: dict[str, dict[int, float]] = {"client": {}, "worker": {}}
        marks: list[tuple[float, float, float, float]] = []  # (time, clients', workers', standby's CPU)
        done = threading.Event()

        def look() -> None:
            while not done.is_set():
                for pid in children_of(run.pid):
                    last["client"][pid] = _cpu(pid)
                for pid in descendants_of(server.pid):
                    last["worker"][pid] = _cpu(pid)
                marks.append((time.time(), sum(last["client"].values()), sum(last["worker"].values()),
                              _cpu(server.pid)))
                time.sleep(0.1)

        looker = threading.Thread(target=look, daemon=True)
        looker.start()
        run.wait()
        done.set()
        looker.join()
        if run.returncode != 0:
            raise SystemExit(f"the run failed ({run.returncode}):\n{log.read_text()[-3000:]}")
    finally:
        server.terminate()
        server.wait(timeout=60)
    window = [m for m in marks if m[2] > 0]  # once workers exist
    (t0, c0, w0, s0), (t1, c1, w1, s1) = window[len(window) // 5], window[-2]  # past start-up, before the end
    clients, workers, own, wall = c1 - c0, w1 - w0, s1 - s0, t1 - t0
    print(json.dumps({"nproc": opts.nproc, "wall_s": round(wall, 2), "clients_cpu_s": round(clients, 2),
                      "workers_cpu_s": round(workers, 2), "standby_cpu_s": round(own, 2)}))
    print(f"{opts.nproc} clients while their workers trained ({wall:.1f} s): {clients:.2f} s of CPU "
          f"({clients / wall:.3f} s per second), workers {workers:.2f} s; clients / workers: "
          f"{clients / workers:.3f}; the standby itself (it watches the clients for stops): {own:.2f} s "
          f"({own / wall:.3f} s per second)")
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
