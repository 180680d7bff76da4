#!/usr/bin/env python3
"""The node-loss drill: Megatron-LM #5281 on one machine, with the failures injected for real.

4 ranks as 2 simulated nodes (two ft_launcher agents on loopback, 2 ranks each, every node with its own
local checkpoint directory), a tiny megatron-core GPT on CPU, local checkpoints every 2 iterations with
replication factor 2 (each shard's copy on the other node), global ones every 6. Mid-run node 1 is lost:
its launcher and ranks are killed with SIGKILL and its local directory is deleted; a replacement node
joins, as Slurm would give one, and ft_launcher restarts the workers. Variants:

  a  replicas intact: node 1's shards come from their replicas on node 0; the run completes.
  b  a replica corrupted at rest (one flipped byte): its checksum rejects it; the global checkpoint is
     loaded; the run completes.
  c  a replica rewritten with a NaN weight and consistent checksums: it loads, the loss turns NaN, the
     canary quarantines it and loads the global checkpoint; the run completes.
  d  a NaN that reproduces on the same device from every checkpoint (iteration 17, every pass): exit 16
     with a diagnostic checkpoint, one same-device retry (--rerun-max-same-device-retries 1), the fallback
     to an older global checkpoint, the NaN again, and a stop with exit code 8 (do not requeue).

    python scripts/node_loss_drill.py --variant a [--layout dp] [--workdir DIR] [--timeout SECS] [--standby]
                                      [--keep-alive SxN]

--layout picks the parallel layout of the 4 ranks (always on megatron-core's distributed optimizer, so
each rank's shard holds the only copy of its part of the Adam state): dp (DP=4, the default), tp2-sp
(TP=2 with sequence parallelism within a node), pp2 (two pipeline stages, one per node), pp2-interleaved,
ep2-moe (4 experts, EP=2), tp2-pp2 (no data parallelism at all: the replicas are the only other copy).

--keep-alive SxN: each launcher's rendezvous heartbeat every S seconds, a node dropped after N missed
(`--rdzv-conf keep_alive_interval=S,keep_alive_max_attempt=N`, read by `python -m
megatron_resil.launch.ft_launcher`; docs/drills.md). The drill's default, 1x3, drops the lost node 2-3 s
after its last heartbeat; NVRx's own, 5x3, 10-15 s after (NVRx 0.4.1; NVRx 0.7's barrier rendezvous drops
no node by heartbeat).

Everything goes under --workdir (default: a new directory under the system's temp dir): the checkpoints,
each node's launcher log, the event log, the ledger and timeline.png. The drill prints a summary (exit
code, restarts, iterations recomputed, wall time lost, recovery time from the node loss to the first
completed iteration after it) and exits 0 if the variant ended as it should, 1 if not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout, installed or not

from megatron_resil import rank_process  # noqa: E402 - after the path above
from megatron_resil.launch.ports import free_loopback_port  # noqa: E402
from megatron_resil.tools import timeline  # noqa: E402

VARIANTS = {
    "a": "replicas intact",
    "b": "a replica corrupted at rest",
    "c": "a replica with a NaN weight and consistent checksums",
    "d": "a NaN that reproduces on the same device from every checkpoint",
}
LAYOUTS = {
    "dp": [],
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "pp2-interleaved": ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                        "--num-layers-per-virtual-pipeline-stage", "1"],
    "ep2-moe": ["--num-experts", "4", "--expert-model-parallel-size", "2", "--disable-bias-linear",
                "--moe-token-dispatcher-type", "alltoall"],
    "tp2-pp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
}
NODES, RANKS_PER_NODE = 2, 2
LOST_NODE = 1  # not node 0: its launcher hosts the rendezvous store, and a job dies with its store
LOSS_ITERATION = 9  # a/b/c: node 1's ranks stop before it (its local checkpoint of 8 is complete)
NAN_ITERATION = 17  # d
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
# The distributed optimizer: each rank's local shard holds the only copy of its part of the Adam state,
# which is what the replicas protect.
TRAINING = ["--use-distributed-optimizer", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
            "--mock-data", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1"]
# The rendezvous keep-alive (seconds between heartbeats, missed ones before a node is dropped). NVRx's 5 s x 3
# keeps the lost node in the round for 10-15 s after its last heartbeat, the survivors unable to start the
# next round with the replacement: 13 of the drill's 15.7 s recovery (issue 26). 1 s x 3 drops it in 2-3 s.
# The risk: a live launcher that cannot send a heartbeat for 3 s (a host loaded far beyond its cores, the
# drill's two launchers sharing two cores with the ranks) is dropped too, which restarts the job.
KEEP_ALIVE = (1, 3)
FT = ["--ft-rank-section-timeouts", "setup:180,step:30,checkpointing:90", "--ft-rank-out-of-section-timeout",
      "120", "--ft-workload-check-interval", "1"]


class DrillError(RuntimeError):
    """The drill could not run as planned (not the run's outcome): one line for the operator."""



def _signal_tree(pid: int, sig: int, include_root: bool = True) -> None:
    for target in [*rank_process.descendants_of(pid), *([pid] if include_root else [])]:
        try:
            os.kill(target, sig)
        except ProcessLookupError:
            pass


class Drill:
    def __init__(self, variant: str, work: Path, timeout: float, layout: str = "dp",
                 standby: str | None = None, keep_alive: tuple[int, int] = KEEP_ALIVE,
                 replacement_first: bool = False) -> None:
        self.standby, self.keep_alive = standby, keep_alive
        self.replacement_first = replacement_first
        self.variant, self.work, self.deadline = variant, work, time.monotonic() + timeout
        self.layout = layout
        self.save = work / "checkpoints"
        self.port = free_loopback_port()
        self.nodes: dict[int, subprocess.Popen] = {}
        self.loss_unix: float | None = None

    # ---- the job -------------------------------------------------------------------------------
    def local_dir(self, node: int) -> Path:
        return self.work / f"node{node}" / "local"

    def pretrain_args(self, node: int) -> list[str]:
        iters = 18 if self.variant == "d" else 14
        args = [*MODEL, *TRAINING, *LAYOUTS[self.layout], "--train-iters", str(iters),
                "--save", str(self.save),
                "--load", str(self.save), "--save-interval", "6", "--non-persistent-ckpt-type", "local",
                "--non-persistent-local-ckpt-dir", str(self.local_dir(node)),
                "--non-persistent-save-interval", "2", "--replication", "--replication-jump", "2",
                "--replication-factor", "2", "--enable-ft-package"]
        if self.variant == "d":
            # A rank of the last pipeline stage, where the loss is computed (rank 0 without pipelining).
            poisoned = NODES * RANKS_PER_NODE - 1 if "pp2" in self.layout else 0
            return [*args, "--inject-fault", "nan-loss", "--inject-fault-iteration", str(NAN_ITERATION),
                    "--inject-fault-ranks", str(poisoned), "--inject-fault-repeat",
                    "--rerun-max-same-device-retries", "1"]
        lost = ",".join(str(LOST_NODE * RANKS_PER_NODE + r) for r in range(RANKS_PER_NODE))
        return [*args, "--inject-fault", "hang", "--inject-fault-iteration", str(LOSS_ITERATION),
                "--inject-fault-ranks", lost]

    def start_node(self, node: int, log_name: str, replacement: bool = False) -> subprocess.Popen:
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
               "MASTER_ADDR": "127.0.0.1", "PYTHONUNBUFFERED": "1", "TORCH_CPP_LOG_LEVEL": "error",
               # Two "nodes" on one host: NVRx 0.7 closes a rendezvous that has two launchers on one
               # address unless told that this is a simulation.
               "NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE": "1"}
        env.pop("MEGATRON_RESIL_STANDBY", None)  # --standby decides, not the caller's environment
        # --standby: each node's launcher starts with a standby of its own (docs/standby.md).
        wrapper = ([sys.executable, "-m", "megatron_resil.launch.standby",
                    *(["--torch-only"] if self.standby == "torch" else []), "--"] if self.standby else [])
        # ft_launcher, with torch's keep-alive keys read from --rdzv-conf (launch/ft_launcher.py).
        interval, attempts = self.keep_alive
        cmd = [*wrapper, sys.executable, "-m", "megatron_resil.launch.ft_launcher",
               "--nnodes", str(NODES), "--nproc-per-node", str(RANKS_PER_NODE), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", f"drill-{self.variant}",
               "--rdzv-conf", f"keep_alive_interval={interval},keep_alive_max_attempt={attempts}",
               "--local-addr", self.local_addr(node, replacement), "--max-restarts", "4",
               "--ft-enable-nic-monitor", "false", *FT,
               str(REPO / "pretrain.py"), *self.pretrain_args(node)]
        log = open(self.work / log_name, "w")
        print(f"[drill] starting node {node} (log: {self.work / log_name})", flush=True)
        return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)

    def local_addr(self, node: int, replacement: bool = False) -> str:
        """Each node's own loopback address. The rendezvous numbers the nodes in the order of their
        (address, launcher pid): on one address, a pid that wrapped around gave node 1 the group ranks 0-1,
        and the drill's hang, meant for node 1's ranks 2-3, struck node 0 (CI, stop 44). With
        --replacement-first the nodes start on 127.0.0.2 and .3 and the replacement comes on 127.0.0.1, so
        it sorts first when every launcher starts again (see run): it gets ranks 0-1, and node 0 ranks 2-3,
        whose directories are on the node lost."""
        if self.replacement_first:
            return "127.0.0.1" if replacement else f"127.0.0.{node + 2}"
        return f"127.0.0.{node + 1}"

    def wait_for(self, what: str, ready) -> None:
        while not ready():
            if time.monotonic() > self.deadline:
                raise DrillError(f"timed out waiting for {what}")
            if any(p.poll() is not None for p in self.nodes.values()):
                raise DrillError(f"a launcher ended while waiting for {what}")
            time.sleep(0.1)

    def log_has(self, name: str, text: str) -> bool:
        path = self.work / name
        return path.exists() and text in path.read_text(errors="replace")

    def store_up(self) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    # ---- the drill -----------------------------------------------------------------------------
    def run(self) -> int:
        self.nodes[0] = self.start_node(0, "node0.log")
        self.wait_for("node 0's rendezvous store", self.store_up)  # node 0 hosts it, node 1 joins
        self.nodes[1] = self.start_node(1, "node1.log")
        if self.variant == "d":  # the node loss at any time after local iteration 8: freeze node 1 then
            self.wait_for("local iteration 8", lambda: self.log_has(
                "node0.log", "successfully saved local checkpoint from iteration       8"))
            _signal_tree(self.nodes[1].pid, signal.SIGSTOP, include_root=False)
        else:  # node 1's ranks hang before iteration 9: the loss strikes at a known point
            self.wait_for("node 1's ranks to stop", lambda: all(
                self.log_has("node1.log", f"injecting hang on rank {r}")
                for r in range(LOST_NODE * RANKS_PER_NODE, (LOST_NODE + 1) * RANKS_PER_NODE)))
        # Node 1 first: its frozen ranks are within the FT step timeout, and rewriting a replica takes time
        # (on a loaded host, longer than that timeout: node 1's launcher then restarted its own ranks). The
        # survivors cannot load before the replacement joins their rendezvous, so the damage is still done
        # before anything reads it.
        self.lose_node(LOST_NODE)
        self.damage_replicas()
        if self.replacement_first:
            # NVRx 0.4.1's rendezvous keeps each node's rank of the round before when the node that
            # completes the next round knew it: node 0 kept ranks 0-1 whenever its launcher joined after
            # the replacement's (a race). The job starts again instead, as a requeue onto another set of
            # nodes does: every launcher new, so the nodes are numbered by address, the replacement first.
            _signal_tree(self.nodes[0].pid, signal.SIGKILL)
            self.nodes[0].wait()
            del self.nodes[LOST_NODE]  # gone: waiting below is for node 0 alone
            self.note("node 0's launcher and ranks killed (SIGKILL; its local directory kept): the job "
                      "starts again on node 0 and the replacement")
            self.nodes[0] = self.start_node(0, "node0-restarted.log")
            self.wait_for("node 0's rendezvous store", self.store_up)
        self.nodes[LOST_NODE] = self.start_node(LOST_NODE, f"node{LOST_NODE}-replacement.log",
                                                replacement=True)
        codes = {}
        for node, proc in self.nodes.items():
            try:
                codes[node] = proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise DrillError("timed out waiting for the job to end") from None
        return self.report(codes)

    def newest_replica(self) -> Path:
        """Node 0's copy of rank 2's shard (ranks 0 and 2 are a clique across nodes), newest iteration."""
        copies = sorted((self.local_dir(0) / "0").glob("iter_*_2_local.pt"))
        if not copies:
            raise DrillError(f"no replica of rank 2's shard under {self.local_dir(0) / '0'}")
        return copies[-1]

    def damage_replicas(self) -> None:
        if self.variant == "b":
            path = self.newest_replica()
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x10
            path.write_bytes(bytes(data))
            self.note(f"flipped one byte of {path} (the only copy of rank 2's shard once node 1 is gone)")
        elif self.variant == "c":
            path = self.newest_replica()
            poison_shard(path)
            self.note(f"rewrote {path} with a NaN weight and a manifest that matches it (NVRx #349)")

    def lose_node(self, node: int) -> None:
        agent = self.nodes[node]
        _signal_tree(agent.pid, signal.SIGKILL)
        agent.wait()
        shutil.rmtree(self.local_dir(node), ignore_errors=True)
        self.loss_unix = time.time()
        self.note(f"node {node} lost: its launcher and ranks killed (SIGKILL), {self.local_dir(node)} "
                  "deleted", event=True)

    def note(self, message: str, event: bool = False) -> None:
        print(f"[drill] {message}", flush=True)
        if event:  # into the run's event log, so the timeline marks it
            events, _ = timeline.read_events(str(self.save / "events.jsonl"))
            reached = max((e["iteration"] for e in events if e["event"] == "progress"), default=0)
            entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "unix": round(time.time(), 3),
                     "event": "fault_injected", "kind": "node-loss", "iteration": reached + 1,
                     "host": socket.gethostname(), "pid": os.getpid(), "message": message}
            with open(self.save / "events.jsonl", "a") as f:
                f.write(json.dumps(entry, sort_keys=True) + "\n")

    # ---- the verdict ---------------------------------------------------------------------------
    def report(self, launcher_codes: dict[int, int]) -> int:
        events, skipped = timeline.read_events(str(self.save / "events.jsonl"))
        line = timeline.analyse(events, skipped)
        ends = [e for e in events if e["event"] in ("finished", "exit") and "exit_code" in e]
        code = ends[-1]["exit_code"] if ends else None
        # The first iteration completed after the loss with a finite loss (a NaN one, as in variant c, is
        # the canary's to reject, not a recovery).
        after = [e for e in events if e["event"] == "progress" and e["unix"] > (self.loss_unix or 0)
                 and isinstance(e.get("loss"), (int, float)) and math.isfinite(e["loss"])]
        recovery = after[0]["unix"] - self.loss_unix if after and self.loss_unix else None
        checks = self.expectations(events, code)
        picture = self.work / "timeline.png"
        try:
            timeline.draw(line, str(self.work)).savefig(picture, dpi=110)
        except Exception as err:  # noqa: BLE001 - the picture is a convenience; the verdict stands
            picture = f"not drawn ({type(err).__name__}: {err})"
        failed = [what for what, ok in checks if not ok]
        print(f"\n[drill] variant {self.variant}: node loss with {VARIANTS[self.variant]} "
              f"(layout {self.layout})")
        print(timeline.summary(line, str(self.save / "events.jsonl")))
        print(f"[drill] launchers exited {launcher_codes}; the run's last exit code: {code}")
        print(f"[drill] restarts: {len(line.attempts) - 1}; iterations recomputed: {line.recomputed}; "
              f"wall time lost: {line.lost_s:.1f} s; recovery (node loss to the first completed iteration "
              f"after it): {'-' if recovery is None else f'{recovery:.1f} s'}")
        print(f"[drill] timeline: {picture}")
        for what, ok in checks:
            print(f"[drill] {'ok  ' if ok else 'FAIL'} {what}")
        print(f"[drill] {'PASSED' if not failed else 'FAILED'} ({self.work})")
        summary = {"variant": self.variant, "exit_code": code, "restarts": len(line.attempts) - 1,
                   "recomputed": line.recomputed, "lost_s": round(line.lost_s, 1),
                   "recovery_s": None if recovery is None else round(recovery, 1), "passed": not failed}
        (self.work / "drill_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        return 0 if not failed else 1

    def expectations(self, events: list[dict], code) -> list[tuple[str, bool]]:
        def has(name: str, **match) -> bool:
            return any(e["event"] == name and all(e.get(k) == v for k, v in match.items()) for e in events)

        loaded = [e for e in events if e["event"] == "loaded"]
        restarts = sum(1 for e in events if e["event"] == "start") - 1
        checks = [("the restarts stayed bounded (at most 4)", 0 < restarts <= 4)]
        if self.variant == "a":
            checks += [("resumed from the local tier, node 1's shards from their replicas"
                        + (", every rank's from the node it was moved off" if self.replacement_first else ""),
                        any(e["tier"] == "local" for e in loaded)),
                       ("no checkpoint rejected", not has("load", verdict="rejected")),
                       ("training finished (exit code 0)", code == 0 and has("finished"))]
        elif self.variant == "b":
            checks += [("the corrupted local checkpoint was rejected", has("load", verdict="rejected",
                                                                          tier="local")),
                       ("resumed from the global (persistent) checkpoint",
                        bool(loaded) and loaded[-1]["tier"] == "persistent"),
                       ("training finished (exit code 0)", code == 0 and has("finished"))]
        elif self.variant == "c":
            checks += [("the NaN local checkpoint verified and loaded",
                        any(e["tier"] == "local" for e in loaded)),
                       ("the canary tripped on it", has("canary", tier="local")),
                       ("then resumed from the global (persistent) checkpoint",
                        bool(loaded) and loaded[-1]["tier"] == "persistent"),
                       ("training finished (exit code 0)", code == 0 and has("finished"))]
        else:
            verdicts = [e.get("verdict") for e in events if e["event"] == "rerun"]
            checks += [("exit 16 with a diagnostic checkpoint first", "reproduced" in verdicts),
                       ("fell back to an older persistent checkpoint", "fell-back" in verdicts),
                       ("stopped as unrecoverable", "unrecoverable" in verdicts),
                       ("the run's last exit code is 8 (do not requeue)", code == 8)]
        return checks


def poison_shard(path: Path) -> None:
    """Rewrite a local shard with NaN in one weight and a manifest that matches it, as NVRx #349 saw."""
    import torch
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_resil.checkpointing.sealed_shard import SealedShard

    manifest = Path(str(path) + ".manifest.json")
    meta = json.loads(manifest.read_text())
    state = SealedShard(torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8), meta).unseal()
    tensors = [t for t in nested_values(state.sharded_state_dict)
               if isinstance(t, ShardedTensor) and t.data is not None and t.data.numel()]
    weight = next(t for t in tensors if "weight" in t.key and "optimizer" not in t.key)
    # The distributed optimizer keeps its own fp32 copy of the weights (`...param`), which a load copies
    # over the model's: the bad write hits both, as a bad device writing the shard would.
    main_params = [t for t in tensors if "optimizer" in t.key and t.key.endswith(".param")]
    with torch.no_grad():
        for tensor in [weight, *main_params]:
            tensor.data.view(-1)[0] = float("nan")
    resealed = SealedShard.seal(state, iteration=meta["iteration"], owner=meta["owner"])
    path.write_bytes(resealed.payload.numpy().tobytes())
    manifest.write_text(json.dumps({**resealed.meta, "format": "sealed-v1"}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=sorted(VARIANTS), required=True)
    parser.add_argument("--workdir", default=None, help="an empty or new directory for everything the drill "
                                                        "writes (default: a new temp directory)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before the drill gives up")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="dp",
                        help="the parallel layout of the 4 ranks (default: dp, data parallel)")
    parser.add_argument("--standby", nargs="?", const="megatron-core", choices=("megatron-core", "torch"),
                        help="each node's launcher starts with a standby that has torch and megatron-core "
                             "(with the run's patches) imported, and the ranks are forked from it "
                             "(docs/standby.md); --standby torch: torch only")
    parser.add_argument("--keep-alive", default="x".join(map(str, KEEP_ALIVE)), metavar="SxN",
                        help="the launchers' rendezvous heartbeat every S seconds, a node dropped after N "
                             "missed (default: %(default)s; NVRx's own: 5x3)")
    parser.add_argument("--replacement-first", action="store_true",
                        help="after the loss the job starts again on node 0 and a replacement whose "
                             "address sorts first, so the ranks change nodes (node 0 runs ranks 2-3, the "
                             "replacement 0-1): the local tier must follow them (docs/drills.md)")
    args = parser.parse_args(argv)
    interval, _, attempts = args.keep_alive.partition("x")
    if not (interval.isdigit() and attempts.isdigit() and int(interval) >= 1 and int(attempts) >= 1):
        parser.error(f"--keep-alive {args.keep_alive}: give SxN, whole numbers of at least 1 (e.g. 1x3)")
    if args.workdir is None:
        work = Path(tempfile.mkdtemp(prefix=f"node-loss-drill-{args.variant}-"))
    else:
        work = Path(args.workdir).resolve()
        if work.exists() and (not work.is_dir() or any(work.iterdir())):
            parser.error(f"--workdir {work} exists and is not an empty directory; name a new one")
        work.mkdir(parents=True, exist_ok=True)
    drill = Drill(args.variant, work, args.timeout, args.layout, args.standby, (int(interval), int(attempts)),
                  args.replacement_first)
    try:
        return drill.run()
    except DrillError as err:
        print(f"[drill] FAILED: {err} (logs under {work})", file=sys.stderr, flush=True)
        return 1
    finally:
        for proc in drill.nodes.values():  # nothing is left running, whatever happened
            if proc.poll() is None:
                _signal_tree(proc.pid, signal.SIGCONT)
                _signal_tree(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
