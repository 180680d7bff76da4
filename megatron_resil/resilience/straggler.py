"""Straggler detection (--log-straggler): which ranks are slow, by how much, and, on request, a stop.

One slow rank slows every rank, since all of them wait for it in the gradient all-reduce. So each rank
times only its OWN work per iteration: from the start of the iteration (where an injected `slow` fault
sleeps) to megatron-core's gradient finalisation, where it first waits for its data-parallel peers;
waiting for them is not counted. (Pipeline stages and expert all-to-alls wait for peers inside the
forward and backward passes, so there a slow rank slows its peers' timing too; NVRx's GPU kernel
timing, below, does not have that blind spot.) Every report interval one all-gather shares each rank's
median time, and every rank computes the same NVRx-style scores from it: relative (fastest rank's time /
this rank's) and individual (this rank's best time so far / its current one). Rank 0 prints the report,
ranks below the thresholds are `straggler` events, and with --straggler-stop-if-detected all ranks save
and stop together. Where NVRx's CUPTI-based Detector works (CUDA), its GPU kernel scores are reported and
judged too.
"""

from __future__ import annotations

import argparse
import math
import socket
import statistics
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

import torch

from megatron_resil import events, exit_codes, parallel
from megatron_resil.optimizer import before_grad_finalize
from megatron_resil.resilience.stop_conditions import Stop


@dataclass(frozen=True)
class RankTiming:
    """What one rank shares at a report: its median own-work time per iteration over the interval
    (NaN when it measured nothing; the median, so one slow iteration, a GC or a page fault, does not
    make a straggler) and its best such median so far."""
    node: str
    time_s: float
    best_s: float


@dataclass(frozen=True)
class Scores:
    """Per-rank scores in (0, 1], 1 = as fast as the reference (NaN: not measured), as NVRx's Report
    holds them. `measure`: what was timed, "Rank" (own work, wall clock) or "GPU" (NVRx, CUDA kernels)."""
    measure: str
    relative: Mapping[int, float]
    individual: Mapping[int, float]
    nodes: Mapping[int, str]


@dataclass(frozen=True)
class Straggler:
    """A rank with a score below its threshold, by one measure."""
    rank: int
    node: str
    measure: str
    relative: float
    individual: float


def score(timings: Sequence[RankTiming]) -> Scores:
    """NVRx's scoring on each rank's median time: the fastest rank's (relative) or this rank's own best
    (individual) divided by this rank's. A rank that measured nothing scores NaN, which never flags."""
    fastest = min((t.time_s for t in timings if math.isfinite(t.time_s)), default=math.nan)
    return Scores(measure="Rank",
                  relative={r: fastest / t.time_s for r, t in enumerate(timings)},
                  individual={r: t.best_s / t.time_s for r, t in enumerate(timings)},
                  nodes={r: t.node for r, t in enumerate(timings)})


def identify(scores: Scores, relative_threshold: float, individual_threshold: float) -> list[Straggler]:
    """NVRx's rule (Report.identify_stragglers): a score strictly below its threshold."""
    ranks = sorted(r for r in scores.nodes
                   if scores.relative.get(r, math.nan) < relative_threshold
                   or scores.individual.get(r, math.nan) < individual_threshold)
    return [Straggler(r, scores.nodes[r], scores.measure, scores.relative.get(r, math.nan),
                      scores.individual.get(r, math.nan)) for r in ranks]


def format_scores(title: str, rank_to_score: Mapping[int, float], nodes: Mapping[int, str],
                  count: int) -> str:
    """NVRx's listing (StragglerDetectionCallback): every rank, worst first, when there are at most
    2 x `count`; otherwise the worst and the best `count`."""
    best_first = sorted(((s, r) for r, s in rank_to_score.items() if math.isfinite(s)), reverse=True)

    def line(s: float, r: int) -> str:
        return f"  Rank={r} Node={nodes.get(r, '<unk>')} Score={s:.2f}"

    n = len(best_first)
    if n <= 2 * count:
        lines = [line(s, r) for s, r in reversed(best_first)]
    else:
        lines = [f" Worst performing {count}/{n} ranks:",
                 *(line(s, r) for s, r in reversed(best_first[-count:])),
                 f" Best performing {count}/{n} ranks:",
                 *(line(s, r) for s, r in best_first[:count])]
    return "\n".join([f"{title}:", *lines])


def scores_from_nvrx_report(report) -> Scores:
    """NVRx's Report (nvidia_resiliency_ext.straggler.Report, gathered on rank 0) as our Scores."""
    return Scores(measure="GPU", relative=dict(report.gpu_relative_perf_scores),
                  individual=dict(report.gpu_individual_perf_scores), nodes=dict(report.rank_to_node))


class ToggleServer:
    """Megatron's straggler controller: rank 0 listens on --straggler-ctrlr-port, and a connection
    (e.g. `curl HOST:PORT`) asks to switch detection on or off at the next report. One per process and
    port, so the attempts of an in-process restart share it."""

    _by_port: dict[int, ToggleServer] = {}

    def __init__(self, port: int) -> None:
        self.port = port
        self.enabled = False  # as of the last report, for the reply
        self._requested = False
        self._lock = threading.Lock()
        self._sock = socket.create_server(("0.0.0.0", port))  # all interfaces, as Megatron
        threading.Thread(target=self._serve, name="straggler-ctrlr", daemon=True).start()

    @classmethod
    def on_port(cls, port: int) -> ToggleServer:
        if port not in cls._by_port:
            cls._by_port[port] = cls(port)
        return cls._by_port[port]

    def take_request(self) -> bool:
        """Whether a switch was asked for since the last call."""
        with self._lock:
            requested, self._requested = self._requested, False
        return requested

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                with self._lock:
                    self._requested = True
                msg = f"Will turn straggler detection {'OFF' if self.enabled else 'ON'} at the next report"
                try:
                    conn.recv(1024)
                    conn.sendall(f"HTTP/1.0 200 OK\r\nConnection: Close\r\nContent-length: {len(msg)}"
                                 f"\r\n\r\n{msg}".encode())
                except OSError:
                    pass  # the client went away; the request stands


class _NvrxKernels:
    """NVRx's Detector on the same window: CUPTI times every CUDA kernel the rank launches there
    (NCCL kernels excluded) and scores ranks per kernel. Needs CUDA and libcupti."""

    def __init__(self, node: str) -> None:
        with warnings.catch_warnings():  # NVRx's pynvml deprecation warning
            warnings.simplefilter("ignore")
            try:  # NVRx 0.4
                from nvidia_resiliency_ext.straggler import Detector
            except ModuleNotFoundError:  # NVRx 0.7 moved it under attribution/
                from nvidia_resiliency_ext.attribution.straggler import Detector
        if Detector.initialized:  # left by an earlier attempt of an in-process restart
            Detector.shutdown()
        Detector.initialize(scores_to_compute="all", gather_on_rank0=True, node_name=node)
        self.detector = Detector
        self.section = None

    def start(self) -> None:
        self.section = self.detector.detection_section("iteration", profile_cuda=True)
        self.section.__enter__()

    def stop(self) -> None:
        if self.section is not None:
            self.section.__exit__(None, None, None)
            self.section = None

    def scores(self) -> Scores:
        """All ranks call this together; the report exists on rank 0, the scores reach every rank."""
        report = self.detector.generate_report()
        return parallel.broadcast_object(scores_from_nvrx_report(report) if report is not None else None)

    def close(self) -> None:
        self.stop()
        self.detector.shutdown()


class StragglerDetection:
    """Without --log-straggler: nothing timed, nothing gathered."""

    @staticmethod
    def from_args(args: argparse.Namespace, model: list) -> StragglerDetection:
        """`model`: the rank's model chunks (megatron-core DDP modules)."""
        return TimedRanks(args, model) if args.log_straggler else StragglerDetection()

    def iteration_started(self) -> None:
        """At the very start of an iteration, before anything of it runs."""

    def report(self, iteration: int) -> Stop | None:
        """After every iteration, on every rank; a Stop when stragglers should end the run."""
        return None

    def close(self) -> None:
        """End of training."""


class TimedRanks(StragglerDetection):
    def __init__(self, args: argparse.Namespace, model: list) -> None:
        self.interval = args.straggler_report_interval
        self.count = args.straggler_minmax_count
        self.relative_threshold = args.straggler_relative_threshold
        self.individual_threshold = args.straggler_individual_threshold
        self.stop_if_detected = args.straggler_stop_if_detected
        self.enabled = not args.disable_straggler_on_startup
        self.node = socket.gethostname()
        self.samples: list[float] = []
        self.best_s = math.inf
        self._started: float | None = None
        before_grad_finalize(model, self._work_done)
        self.toggle, self.nvrx, notes = None, None, []
        if parallel.is_rank0():
            try:
                self.toggle = ToggleServer.on_port(args.straggler_ctrlr_port)
                self.toggle.enabled = self.enabled
                notes.append(f"switch on/off: connect to port {args.straggler_ctrlr_port}")
            except OSError as err:
                notes.append(f"cannot listen on --straggler-ctrlr-port {args.straggler_ctrlr_port} ({err}): "
                             "no switching on/off")
        if torch.cuda.is_available():
            try:
                self.nvrx = _NvrxKernels(self.node)
                notes.append("NVRx GPU kernel scores too")
            except Exception as err:  # noqa: BLE001 - any failure leaves our own timing in place
                notes.append(f"NVRx Detector unavailable ({type(err).__name__}: {err})")
        events.print_rank_0(
            f"straggler detection {'ON' if self.enabled else 'OFF'}: own work per iteration (start of "
            f"the iteration to the gradient reduction), report every {self.interval} iterations, thresholds "
            f"relative {self.relative_threshold:g} individual {self.individual_threshold:g}"
            + "".join(f"; {n}" for n in notes))

    def iteration_started(self) -> None:
        if self.enabled:
            self._started = time.perf_counter()
            if self.nvrx is not None:
                self.nvrx.start()

    def _work_done(self) -> None:
        """Before the gradients are reduced (the first wait for peers without pipeline or expert
        parallelism): this rank's own work for the iteration ends. A rerun's second pass is not timed."""
        if self._started is not None:
            self.samples.append(time.perf_counter() - self._started)
            self._started = None
            if self.nvrx is not None:
                self.nvrx.stop()

    def report(self, iteration: int) -> Stop | None:
        if iteration % self.interval:
            return None
        began = time.perf_counter()
        median = statistics.median(self.samples) if self.samples else math.nan
        self.samples.clear()
        if math.isfinite(median):
            self.best_s = min(self.best_s, median)
        toggle_asked = self.toggle is not None and self.toggle.take_request()
        shared = parallel.all_gather_object((RankTiming(self.node, median, self.best_s), toggle_asked))
        was_enabled = self.enabled
        if shared[0][1]:  # rank 0 heard the request; every rank switches at this same iteration
            self._switch()
        if not was_enabled:
            return None
        timings = [timing for timing, _ in shared]
        all_scores = [score(timings)]
        if self.nvrx is not None:
            all_scores.append(self.nvrx.scores())
        stragglers = [s for scores in all_scores
                      for s in identify(scores, self.relative_threshold, self.individual_threshold)]
        if parallel.is_rank0():
            print(self._text(iteration, timings, all_scores, time.perf_counter() - began), flush=True)
        if stragglers:
            return self._decide(iteration, timings, stragglers)
        return None

    def _switch(self) -> None:
        self.enabled = not self.enabled
        self.samples.clear()
        self._started = None
        if self.toggle is not None:
            self.toggle.enabled = self.enabled
        events.print_rank_0(f"Toggling straggler detection {'ON' if self.enabled else 'OFF'}")

    def _text(self, iteration: int, timings: Sequence[RankTiming], all_scores: Sequence[Scores],
              elapsed_s: float) -> str:
        """Megatron's min/max line, then NVRx's warnings and listings (StragglerDetectionCallback)."""
        now = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        head = f" [{now}] straggler report at iteration {iteration} |"
        measured = sorted((t.time_s, r) for r, t in enumerate(timings) if math.isfinite(t.time_s))
        if measured:
            (low, low_rank), (high, high_rank) = measured[0], measured[-1]
            head += f" MnRtt/Rnk: {low * 1e3:.2f}ms/{low_rank} | MxRtt/Rnk: {high * 1e3:.2f}ms/{high_rank} |"
        lines = [head]
        for scores in all_scores:
            who = "GPUs" if scores.measure == "GPU" else "ranks"
            if slow := sorted(r for r, v in scores.relative.items() if v < self.relative_threshold):
                lines.append(f"STRAGGLER DETECTION WARNING: Some {who} have worse relative performance. "
                             f"Affected ranks: {slow}")
            if slow := sorted(r for r, v in scores.individual.items() if v < self.individual_threshold):
                lines.append(f"STRAGGLER DETECTION WARNING: Some {who} performance dropped. "
                             f"Affected ranks: {slow}")
        for scores in all_scores:
            for kind, rank_to_score in (("relative", scores.relative), ("individual", scores.individual)):
                title = f"{scores.measure} {kind} performance"
                lines += ["", format_scores(title, rank_to_score, scores.nodes, self.count)]
        lines += ["", f"Straggler report processing time: {elapsed_s:.3f} sec."]
        return "\n".join(lines)

    def _decide(self, iteration: int, timings: Sequence[RankTiming],
                stragglers: Sequence[Straggler]) -> Stop | None:
        """Every rank decides the same from the same gathered timings; rank 0 records and says it."""
        fastest = min((t.time_s for t in timings if math.isfinite(t.time_s)), default=math.nan)
        described = []
        for s in stragglers:
            own_ms = 1000 * timings[s.rank].time_s if s.measure == "Rank" else math.nan
            events.record("straggler", iteration=iteration, rank=s.rank, node=s.node, measure=s.measure,
                          relative_score=round(s.relative, 4), individual_score=round(s.individual, 4),
                          own_work_ms=round(own_ms, 3) if math.isfinite(own_ms) else None)
            scores = "scores" if s.measure == "Rank" else "GPU kernel scores"
            described.append(f"rank {s.rank} on {s.node}: {scores} relative {s.relative:.2f}, "
                             f"individual {s.individual:.2f}"
                             + (f" ({own_ms:.1f} ms of own work per iteration, fastest rank "
                                f"{1000 * fastest:.1f} ms)" if math.isfinite(own_ms) else ""))
        action = ("saving and stopping (--straggler-stop-if-detected)" if self.stop_if_detected else
                  "training goes on (--straggler-stop-if-detected would save and stop)")
        events.decision("straggler", f"{'; '.join(described)} at iteration {iteration} (thresholds relative "
                        f"{self.relative_threshold:g}, individual {self.individual_threshold:g}); {action}",
                        iteration=iteration, ranks=sorted({s.rank for s in stragglers}))
        if not self.stop_if_detected:
            return None
        nodes = ", ".join(sorted({s.node for s in stragglers}))
        return Stop(f"straggler(s) on {nodes} at iteration {iteration} (--straggler-stop-if-detected); to be "
                    "requeued, preferably without those nodes", exit_codes.FINISHED, requeue=True)

    def close(self) -> None:
        if self.nvrx is not None:
            self.nvrx.close()
