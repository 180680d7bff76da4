"""In-process restart (--inprocess-restart): a failure on any rank (an exception, or no progress for the soft
timeout) restarts training on every rank inside the same processes, through NVRx's inprocess.Wrapper. Each
attempt is a whole `training.pretrain(args)` from scratch: process groups on a fresh store namespace, the
model built, the newest checkpoint loaded by the usual loader.

Warm reserves (--inprocess-active-world-size below the world size) wait in NVRx's Wrapper with their
imports done; when a rank's process is lost, one takes its place at the next attempt. For that loss not to
end the job, no rank hosts the stores: under our ft_launcher (launch/ft_launcher.py, which the launch
scripts run) both live in the launcher's rendezvous store, in a namespace of this worker group's own.

What NVRx leaves to the application is done here: the store each attempt starts torch.distributed from,
the teardown between attempts (on gloo, which has no abort, the failed attempt's process groups must be
dropped for a peer blocked in a collective to be released), stopping the failed attempt's checkpoint
writers, and one `[resil] restart:` line from rank 0 naming the rank that failed and why.
"""

# No `from __future__ import annotations` here: NVRx hands its CallWrapper to the parameter annotated with
# that class, comparing annotation objects with issubclass (a string annotation raises TypeError).

import argparse
import contextlib
import copy
import datetime
import gc
import json
import multiprocessing
import os
import socket
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_resil import data, events, exit_codes, group_connections, parallel
from megatron_resil.rank_process import AGENT_STORE_ENV
from megatron_resil.resilience import launcher_watch, replica_recovery, restart_phases, signal_handler
from megatron_resil.tokenizer import build_tokenizer

with warnings.catch_warnings():  # NVRx's pynvml deprecation warning is noise on every rank
    warnings.simplefilter("ignore")
    from nvidia_resiliency_ext import inprocess
    from nvidia_resiliency_ext.inprocess.attribution import Interruption
    from nvidia_resiliency_ext.inprocess.exception import RestartAbort
    from nvidia_resiliency_ext.inprocess.rank_assignment import RankDiscarded
    from nvidia_resiliency_ext.inprocess.store import PrefixStore as WrapperPrefixStore

# Without it, Megatron's ports, hosted by rank 0: torch.distributed's store on MASTER_PORT + 1, the
# wrapper's own on MASTER_PORT + 2. MASTER_PORT itself is the launcher's.
_DIST_STORE_PORT_OFFSET = 1
_WRAPPER_STORE_PORT_OFFSET = 2
_WRAPPER_STORE_TIMEOUT = datetime.timedelta(seconds=300)
_CUDA_STEP_TIMEOUT = datetime.timedelta(seconds=10)
_MESSAGE_CHARS = 500  # of an exception's message, in the restart line
_EXIT_RECORDED = "exit_recorded"
_EXIT_WRITER = "exit_writer"
# NVRx's GPU health checks the Wrapper built in this process runs no more before a restart: on a host
# without CUDA the patch that leaves them out (patches/nvrx.py) names them here as the Wrapper is built;
# none with CUDA, or with an NVRx that has none.
gpu_health_checks_left_out: tuple[str, ...] = ()
_EXIT_RECORD_TIMEOUT = datetime.timedelta(seconds=60)
# The NVRx monitor threads that ran our abort: each then raises RankShouldRestart into the training thread
# (patches/nvrx.py raises it again if it was lost on its way).
aborted_by: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()


def run(pretrain: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """`pretrain(args)` under in-process restart; returns the process's exit code."""
    addr, port, rank, world_size = _launcher_env()
    timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
    stores = _stores(addr, port, rank, world_size, timeout)
    attempts = Attempts(pretrain, args, stores, world_size)
    wrapper = _wrapper(args, stores, attempts)
    attempts.health_checks_left_out = gpu_health_checks_left_out
    wrapped = wrapper(attempts.run)
    # Every process, reserves too, so that no attempt builds them: the datasets are the same in each.
    data.build_ahead(args, build_tokenizer(args))
    # What the imports made lives as long as the process: out of the collector's sight, a restart's
    # collection takes milliseconds, not the second or more that pauses every thread (NVRx collects
    # after each rank assignment; a long pause can make a healthy rank miss its heartbeats).
    gc.collect()
    gc.freeze()
    try:
        return wrapped()
    except (RestartAbort, RankDiscarded) as err:  # NVRx's "no more attempts", or too few ranks left
        return attempts.give_up(err)


def _launcher_env() -> tuple[str, int, int, int]:
    try:
        return (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["RANK"]),
                int(os.environ["WORLD_SIZE"]))
    except (KeyError, ValueError):
        sys.stderr.write("pretrain.py: error: --inprocess-restart needs a launcher that sets MASTER_ADDR, "
                         "MASTER_PORT, RANK and WORLD_SIZE (torchrun, or srun with those exported); it also "
                         "uses ports MASTER_PORT+1 and MASTER_PORT+2\n")
        sys.exit(exit_codes.BAD_ARGUMENTS)


@dataclass(frozen=True)
class Stores:
    """Where every attempt's torch.distributed store and NVRx's own store live."""
    dist: dist.Store  # one for every attempt; each attempt works in a namespace of its own
    wrapper_factory: type
    wrapper_kwargs: dict
    hosted: str  # by whom, said in the setup line


class LauncherHostedStore(WrapperPrefixStore):
    """NVRx's store for the Wrapper, in a namespace of the launcher's store: no rank is critical to it.
    NVRx's own TCPStore is hosted by rank 0, whose loss then ends every rank (its monitor threads lose
    the connection). Built by NVRx in each rank and in each rank's monitor process (a fork)."""

    def __init__(self, host_name: str, port: int, prefix: str, timeout: datetime.timedelta) -> None:
        client = dist.TCPStore(host_name, port, is_master=False, timeout=timeout, wait_for_workers=False)
        self.base_store = client
        dist.PrefixStore.__init__(self, prefix, client)

    @property
    def critical_ranks(self) -> tuple[int, ...]:
        return ()


def _stores(addr: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta) -> Stores:
    agent = os.environ.get(AGENT_STORE_ENV, "")
    host, _, agent_port = agent.rpartition(":")
    if host and agent_port.isdigit():
        client = dist.TCPStore(host, int(agent_port), is_master=False, timeout=timeout,
                               wait_for_workers=False)
        # The launcher picks MASTER_PORT afresh for each worker group, and every rank of the group has
        # the same: a namespace no earlier group used, unless the port came round again, which the count
        # of processes that joined it shows to every rank alike.
        space = f"megatron_resil/inprocess/{addr}:{port}"
        if client.add(f"{space}/joined", 1) <= world_size:
            return Stores(dist.PrefixStore(f"{space}/dist", client), LauncherHostedStore,
                          {"host_name": host, "port": int(agent_port), "prefix": f"{space}/wrapper",
                           "timeout": _WRAPPER_STORE_TIMEOUT},
                          f"by the launcher ({agent}), so the loss of any rank's process, rank 0's included, "
                          "leaves them up")
        why = f"an earlier worker group of this launcher used the namespace {space}"
    else:
        why = f"{AGENT_STORE_ENV} is not set: not launched by megatron_resil.launch.ft_launcher"
    store = dist.TCPStore(addr, port + _DIST_STORE_PORT_OFFSET, world_size, is_master=rank == 0,
                          timeout=timeout, wait_for_workers=True)
    return Stores(store, inprocess.store.TCPStore,
                  {"port": port + _WRAPPER_STORE_PORT_OFFSET, "timeout": _WRAPPER_STORE_TIMEOUT},
                  f"by rank 0 ({why}), so the loss of rank 0's process ends the job")


def _wrapper(args: argparse.Namespace, stores: Stores, attempts: "Attempts") -> inprocess.Wrapper:
    """NVRx's Wrapper as Megatron builds it, with what CPU needs: our abort and finalize (NVRx's
    ThreadedFinalize refuses to run without CUDA), and ranks per node from the launcher (Megatron counts
    GPUs, which is 0 on CPU and would activate no rank at all)."""
    layers = [inprocess.rank_assignment.Layer(min_ranks=args.inprocess_active_world_size,
                                              max_ranks=args.inprocess_active_world_size,
                                              flag=inprocess.rank_assignment.LayerFlag.RESERVE)]
    if args.inprocess_granularity == "node":
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", max(torch.cuda.device_count(), 1)))
        layers.append(inprocess.rank_assignment.Layer(min_ranks=per_node, max_ranks=per_node,
                                                      key_or_fn=lambda _: socket.gethostname(),
                                                      flag=inprocess.rank_assignment.LayerFlag.RESERVE))

    def secs(name: str) -> datetime.timedelta:
        return datetime.timedelta(seconds=getattr(args, f"inprocess_{name}"))

    return inprocess.Wrapper(
        store_factory=stores.wrapper_factory, store_kwargs=stores.wrapper_kwargs,
        initialize=inprocess.Compose(
            inprocess.initialize.RetryController(max_iterations=args.inprocess_max_iterations,
                                                 min_world_size=args.inprocess_active_world_size),
            ReservesToo(args)),
        abort=ReleaseProcessGroups(),
        finalize=BetweenAttempts(args.inprocess_empty_cuda_cache),
        health_check=(inprocess.health_check.CudaHealthCheck(timeout=_CUDA_STEP_TIMEOUT)
                      if torch.cuda.is_available() else None),
        rank_assignment=inprocess.rank_assignment.Tree(layers=layers),
        monitor_thread_interval=secs("monitor_thread_interval"),
        monitor_process_interval=secs("monitor_process_interval"),
        progress_watchdog_interval=secs("progress_watchdog_interval"),
        heartbeat_interval=secs("heartbeat_interval"),
        heartbeat_timeout=secs("heartbeat_timeout"),
        soft_timeout=secs("soft_timeout"),
        hard_timeout=secs("hard_timeout"),
        barrier_timeout=secs("barrier_timeout"),
        completion_timeout=secs("completion_timeout"),
        last_call_wait=secs("last_call_wait"),
        termination_grace_time=secs("termination_grace_time"),
    )


@dataclass(frozen=True)
class Failure:
    """Why an attempt ended, as rank 0 reports it."""
    text: str
    ranks: tuple[int, ...]
    unix: float | None  # when the first failing rank raised, if one did


class Attempts:
    """The function NVRx restarts, and what this rank carries from one attempt to the next."""

    def __init__(self, pretrain: Callable[[argparse.Namespace], int], args: argparse.Namespace,
                 stores: Stores, launcher_world_size: int) -> None:
        self.pretrain = pretrain
        self.args = args
        self.store = stores.dist
        self.stores_hosted = stores.hosted  # said in the setup line
        self.launcher_world_size = launcher_world_size  # reserves included
        self.wrapper_store = None  # NVRx's own store: its record of which ranks failed, and how
        self.started = 0  # attempts begun
        self.health_checks_left_out: tuple[str, ...] = ()  # NVRx's GPU checks, on a host without CUDA

    def run(self, call_wrapper: inprocess.CallWrapper | None = None) -> int:
        """One attempt. NVRx fills in the parameter annotated with its CallWrapper and checks every
        parameter's annotation with issubclass (a subscripted generic raises): keep it the only one."""
        attempt = call_wrapper.iteration
        self.wrapper_store = call_wrapper.base_store
        self.started = attempt + 1
        events.configure(self.args.save)  # the log lines below come before pretrain() configures it
        pids = self._pids(attempt)
        # NVRx numbers the live processes afresh after a loss; its records of a failure name that number
        self.store.set(f"rank_of/{attempt}/{call_wrapper.state.rank}", str(parallel.rank()))
        if attempt == 0:
            self._log_setup(pids)
        else:
            self._log_restart(attempt, pids)
        replica_recovery.generation = attempt  # from the second attempt on, what the ranks kept may serve
        restart_phases.inprocess_attempt(attempt)
        with parallel.attempt_store(dist.PrefixStore(f"attempt{attempt}", self.store)):
            try:
                return self.pretrain(copy.deepcopy(self.args))  # nothing an attempt changes reaches the next
            except BaseException as err:
                try:
                    if isinstance(err, Exception):  # not NVRx's own interruption (a BaseException)
                        self._publish_failure(attempt, err)
                finally:
                    # The traceback holds every frame of the attempt, so its model and process groups,
                    # until NVRx drops the exception after the restart barrier. Freed now, dropping the
                    # groups in the abort really closes them, and the blocked peer is released.
                    traceback.clear_frames(err.__traceback__)
                raise

    def _pids(self, attempt: int) -> list[int] | None:
        """Every rank's process id in this attempt (on rank 0; None elsewhere)."""
        self.store.set(f"pid/{attempt}/{parallel.rank()}", str(os.getpid()))
        return self._pids_of(attempt) if parallel.is_rank0() else None

    def _pids_of(self, attempt: int) -> list[int]:
        """Rank 0: each rank's process in `attempt`, which every rank of it has published (the number of
        ranks is the same in every attempt: a lost one's place is taken, or the restarts end)."""
        keys = [f"pid/{attempt}/{r}" for r in range(int(os.environ["WORLD_SIZE"]))]
        return [int(p) for p in self.store.multi_get(keys)]

    def _publish_failure(self, attempt: int, err: Exception) -> None:
        """Leave this rank's exception where rank 0 reads it when it reports the restart."""
        record = {"type": type(err).__name__, "message": str(err)[:_MESSAGE_CHARS], "unix": time.time()}
        with contextlib.suppress(Exception):  # the failure itself matters more than its report
            self.store.set(f"failure/{attempt}/{parallel.rank()}", json.dumps(record))

    def collect_failure(self, attempt: int) -> Failure:
        """Which ranks ended `attempt` and why (read by rank 0 of the next attempt, or by the process that
        reports the last one). NVRx's interruption records name the ranks that failed first (others fail
        in turn once their peers are gone, within its last-call wait); the messages are those the failing
        ranks published."""
        records = WrapperPrefixStore(attempt, self.wrapper_store).get_interruption_records()
        parts, ranks, first = [], [], None
        # In order, once each; a lost process first: its peers' errors (a connection reset) follow from it.
        for record in sorted(dict.fromkeys(records), key=lambda r: r.interruption != Interruption.TERMINATED):
            numbered = f"rank_of/{attempt}/{record.rank}"
            if not self.store.check([numbered]):  # a reserve, or a process lost before it took its rank
                parts.append(f"a process not training (NVRx's rank {record.rank}) "
                             f"{self._describe(record.interruption)}")
                continue
            rank = int(self.store.get(numbered))
            ranks.append(rank)
            key = f"failure/{attempt}/{rank}"
            if record.interruption == Interruption.EXCEPTION and self.store.check([key]):
                published = json.loads(self.store.get(key))
                first = published["unix"] if first is None else min(first, published["unix"])
                parts.append(f"rank {rank} raised {published['type']}: {published['message']}")
            else:
                parts.append(f"rank {rank} {self._describe(record.interruption)}")
        return Failure("; ".join(parts) or "no rank recorded a reason", tuple(sorted(set(ranks))), first)

    def _describe(self, interruption: Interruption) -> str:
        a = self.args
        return {
            Interruption.EXCEPTION: "raised an exception",
            Interruption.SOFT_TIMEOUT: f"made no progress for --inprocess-soft-timeout "
                                       f"{a.inprocess_soft_timeout:g} s",
            Interruption.HARD_TIMEOUT: f"made no progress for --inprocess-hard-timeout "
                                       f"{a.inprocess_hard_timeout:g} s and was terminated",
            Interruption.TERMINATED: "ended (its process is gone)",
            Interruption.UNRESPONSIVE: f"sent no heartbeat for --inprocess-heartbeat-timeout "
                                       f"{a.inprocess_heartbeat_timeout:g} s",
        }.get(interruption, f"was interrupted ({interruption.name})")

    def _nesting(self) -> str:
        if not self.args.enable_ft_package:
            return ""
        return ("; nested inside ft_launcher's in-job restart (--enable-ft-package): when the in-process "
                "restarts end, the launcher starts every rank again, and its rank monitors time each attempt "
                "afresh, so keep --inprocess-soft-timeout below their section and heartbeat timeouts")

    def _from_where(self) -> str:
        if self.args.recover_from_replicas:
            return ("at the interrupted iteration where replicas hold every rank's state "
                    "(--recover-from-replicas), else from the newest checkpoint")
        return "from the newest checkpoint"

    def _limit_text(self) -> str:
        limit = self.args.inprocess_max_iterations
        return (f"at most {limit} attempts in all (--inprocess-max-iterations)" if limit is not None else
                "attempts unbounded (--inprocess-max-iterations not set)")

    def _log_setup(self, pids: list[int] | None) -> None:
        a = self.args
        left_out = self.health_checks_left_out
        checks = (f"; NVRx's health checks {', '.join(left_out)} left out of the checks before a restart: "
                  "no CUDA here, and they read the GPU through NVML" if left_out else "")
        reserves = self.launcher_world_size - a.world_size
        spare = (f"; {reserves} warm reserve rank{'s' if reserves != 1 else ''} "
                 "(--inprocess-active-world-size "
                 f"{a.world_size}) to take the place of a rank whose process is lost" if reserves > 0 else
                 "; no warm reserve: a rank whose process is lost ends the in-process restarts")
        events.decision("inprocess", "in-process restart on: a failure on any rank restarts training on "
                        f"every rank in the same processes, {self._from_where()}; "
                        f"{self._limit_text()}; soft timeout {a.inprocess_soft_timeout:g} s, hard timeout "
                        f"{a.inprocess_hard_timeout:g} s{spare}; stores hosted {self.stores_hosted}{checks}"
                        f"{self._nesting()}",
                        pids=pids, max_iterations=a.inprocess_max_iterations, reserves=max(reserves, 0),
                        health_checks_left_out=list(left_out))

    def _log_restart(self, attempt: int, pids: list[int] | None) -> None:
        if not parallel.is_rank0():
            return
        # Rank 0 of this attempt reads why the last one ended: it may be a reserve that was not in it.
        failure = self.collect_failure(attempt - 1)
        limit = self.args.inprocess_max_iterations
        bound = f" of at most {limit - 1}" if limit is not None else ""
        same = "the same processes" if pids == self._pids_of(0) else f"processes {pids}"
        taken = [f"the reserve process {new} takes rank {rank}'s place (process {old} is lost)"
                 for rank, (old, new) in enumerate(zip(self._pids_of(attempt - 1), pids or [], strict=True))
                 if old != new]
        same += "".join(f"; {text}" for text in taken)
        since = f" ({time.time() - failure.unix:.1f} s after the failure)" if failure.unix else ""
        events.decision("restart", f"in-process restart {attempt}{bound}: {failure.text}; every rank trains "
                        f"again in {same}, {self._from_where()}{since}",
                        count=attempt, kind="inprocess", max_restarts=None if limit is None else limit - 1,
                        reason=failure.text, failed_ranks=list(failure.ranks), failed_unix=failure.unix,
                        pids=pids)

    def give_up(self, err: RestartAbort | RankDiscarded) -> int:
        """NVRx will not start another attempt: the bound is reached, or too few ranks are left."""
        if isinstance(err, RankDiscarded) and (caught := signal_handler.caught()) is not None:
            # NVRx terminates a rank that made no progress for --inprocess-hard-timeout (SIGCONT, SIGTERM,
            # then SIGKILL after --inprocess-termination-grace-time), and one that catches SIGTERM
            # (--exit-signal-handler) gets here, discarded, while the others go on with a reserve in its
            # place. It must end as the signal would have ended it: ft_launcher ends every rank when one
            # exits with a code, and leaves them to in-process restart when one is killed. (NVRx's records
            # cannot tell this process from one discarded because too few are left: they are locked once
            # the restart began.)
            print(f"[resil] inprocess: process {os.getpid()} was discarded by NVRx after {caught.name} (NVRx "
                  f"terminates a rank that made no progress for --inprocess-hard-timeout "
                  f"{self.args.inprocess_hard_timeout:g} s); it ends of {caught.name}, as without "
                  "--exit-signal-handler, so that the launcher leaves the other ranks to go on",
                  file=sys.stderr, flush=True)
            signal_handler.die_of(caught)
        events.configure(self.args.save)
        limit = self.args.inprocess_max_iterations
        # Too few processes is no fault of the state: the launcher may start every rank again.
        code = exit_codes.RESERVES_USED_UP if isinstance(err, RankDiscarded) else exit_codes.UNRECOVERABLE
        try:
            last = (self.collect_failure(self.started - 1).text if self.wrapper_store is not None else
                    "not seen by this process (a reserve that has not trained)")
        except Exception:  # noqa: BLE001 - the store is gone with its host
            last = "unknown"
        if isinstance(err, RankDiscarded):
            why = (f"no warm reserve left to take a lost rank's place: fewer live processes than "
                   f"--inprocess-active-world-size {self.args.world_size} (NVRx: {err})")
        elif limit is not None and self.started >= limit:
            why = f"all {limit} attempts allowed by --inprocess-max-iterations failed"
        else:
            why = f"NVRx ended in-process restarts after {self.started} attempts ({err})"
        message = f"{why}; the last failure: {last}; exiting with code {code}"
        # One process writes the exit record: the first to get here (rank 0's may be the one lost, and
        # the one left may be a reserve that never trained, which has no rank). The others wait until it
        # is on record, since the launcher ends every rank as soon as one has exited.
        try:
            writes = self.store.add(_EXIT_WRITER, 1) == 1
        except Exception:  # noqa: BLE001 - the store is gone with its host: each process says it
            writes = True
        if writes:
            with events.speaking_for_every_rank():
                events.decision("inprocess", message, exit_code=code, attempts=self.started)
                events.record("exit", message=message, exit_code=code)
            with contextlib.suppress(Exception):
                self.store.set(_EXIT_RECORDED, "1")
        else:
            with contextlib.suppress(Exception):
                self.store.wait([_EXIT_RECORDED], _EXIT_RECORD_TIMEOUT)
        return code


class ReservesToo(inprocess.initialize.Initialize):
    """At the start of every attempt, in every process, what pretrain() sets up for a training rank: the
    launcher watch and the exit signal handler (each installed once per process). A warm reserve waits in
    NVRx's Wrapper and never enters pretrain(). Without them a reserve outlived a launcher killed with
    SIGKILL, and died of the SIGTERM a preemption sends every rank: NVRx took that for a lost process and
    restarted the training ranks in the middle of the save the signal asked of them (the mixed chaos run
    under same-step recovery). With the handler a reserve notes the signal and waits on, and ends with the
    training ranks once they have saved. Not before the Wrapper: its monitor process, a fork, would share
    the handler's wakeup pipe."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def __call__(self, state: inprocess.FrozenState) -> inprocess.FrozenState:
        launcher_watch.watch()
        signal_handler.install_from_args(self.args)
        return state


class ReleaseProcessGroups(inprocess.abort.Abort):
    """Runs in NVRx's monitor thread on every rank as soon as any rank has failed, to unblock the training
    thread: the gloo groups' connections shut down (gloo has no abort of its own: group_connections.py),
    NVRx's abort (NCCL communicators and TE buffers on GPU; on gloo it only unregisters the groups), then
    every reference to the groups dropped."""

    def __call__(self, state: inprocess.FrozenState) -> inprocess.FrozenState:
        aborted_by.add(threading.current_thread())
        group_connections.end()  # first: a collective blocked with a hung peer raises now
        if torch.cuda.is_available():
            inprocess.abort.AbortTransformerEngine()(state)
        inprocess.abort.AbortTorchDistributed()(state)
        parallel.release_process_groups()
        return state


class BetweenAttempts(inprocess.finalize.Finalize):
    """Runs on every rank after the failed attempt has unwound, before the next one: nothing of it may
    survive into the next attempt."""

    def __init__(self, empty_cuda_cache: bool) -> None:
        self.empty_cuda_cache = empty_cuda_cache

    def __call__(self, state: inprocess.FrozenState) -> inprocess.FrozenState:
        parallel.release_process_groups()  # again: the abort may have stopped part way (it collects)
        if (leaked := parallel.empty_leaked_engines()):
            print(f"[resil] inprocess: rank {parallel.rank()}: {leaked} model chunk(s) of the failed attempt "
                  "were still held after it unwound (from outside Python's sight); emptied, so that their "
                  "buffers and process groups go", file=sys.stderr, flush=True)
        gc.freeze()  # what is left is kept for the process's life (see run)
        _stop_checkpoint_writers()
        if self.empty_cuda_cache and torch.cuda.is_available():
            torch.cuda.empty_cache()
        return state


def _stop_checkpoint_writers() -> None:
    """The failed attempt's checkpoint writers must not outlive it: the next attempt removes unpublished
    staging directories when it starts and may save the same iteration again. They are this process's
    children (our async-save worker, and whatever megatron-core's writer forked)."""
    for child in multiprocessing.active_children():
        child.kill()
        child.join(5)
