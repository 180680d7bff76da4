"""NVRx (nvidia-resiliency-ext): the private methods of its local checkpoint manager and replication group
that the local tier's subclasses override (checkpointing/local_tier.py, checkpointing/replication.py).
Nothing of NVRx is replaced there; a renamed method would leave our override uncalled, silently, so each is
checked, with the call in NVRx that reaches it.

One record replaces a method of NVRx's in-process restart Wrapper, on a host without CUDA: NVRx 0.5 and
later run GPU health checks of their own before every restart, which cannot run there. Another, under
in-process restart, raises the restart again when NVRx's signal to the training thread was lost.

One record replaces something, in ft_launcher's process only (`python -m megatron_resil.launch.ft_launcher`
installs it by name; pretrain.py never does): NVRx 0.4.1's rendezvous hard-codes torch's keep-alive (a
heartbeat every 5 s, a node dropped after 3 missed), where torch's own c10d rendezvous reads
`--rdzv-conf keep_alive_interval=S,keep_alive_max_attempt=N`. The record makes NVRx read the same keys.
Another, in ft_launcher's process too, under in-process restart: a rank killed while the others run does not
make the agent end them (a warm reserve takes its place)."""

from __future__ import annotations

import argparse
import functools
import sys

from megatron_resil.patches.registry import AnyOf, Has, Patch, Says, Takes, _source_on_disk

PACKAGE = "nvidia-resiliency-ext"
WRITTEN_FOR = ">=0.4.1,<0.8"
_LOCAL = "nvidia_resiliency_ext.checkpointing.local"
_BASE = f"{_LOCAL}.ckpt_managers.base_manager:BaseCheckpointManager"
_MANAGER = f"{_LOCAL}.ckpt_managers.local_manager:LocalCheckpointManager"
_GROUP = f"{_LOCAL}.replication.group_utils:GroupWrapper"
_STATE = f"{_LOCAL}.base_state_dict:TensorAwareStateDict"


_FT = "nvidia_resiliency_ext.fault_tolerance"
_RDZV = f"{_FT}._ft_rendezvous"
_HANDLER = f"{_RDZV}:FtRendezvousHandler"
KEEP_ALIVE = "NVRx rendezvous keep-alive from --rdzv-conf"
KEEP_ALIVE_KEYS = ("keep_alive_interval", "keep_alive_max_attempt")  # torch's names, whole numbers


def _launcher_only(args: argparse.Namespace | None) -> bool:
    # ft_launcher's process installs it by name (megatron_resil/launch/ft_launcher.py); a run's own install
    # never does. With no arguments (every record, as the patch tests check them): yes.
    return args is None


def _read(module_name: str) -> str | None:
    try:
        return _source_on_disk(module_name)
    except LookupError:  # not in this NVRx
        return None


def keep_alive_not_needed() -> str | None:
    """Why the keep-alive keys have nothing to change in the installed NVRx, or None: NVRx 0.5+ replaced
    the heartbeat rendezvous with a barrier one, which keeps `keep_alive_*` in its settings but drops no
    node by heartbeat (a lost node is just not in the next round). Read from the files, not imported."""
    if _read(_RDZV) is not None:
        return None
    barrier = _read(f"{_FT}.ft_rendezvous_barrier")
    if barrier is None or "settings.keep_alive" in barrier or "last_heartbeats" in barrier:
        return None  # neither form we know: the checks below say what is missing
    return ("its barrier rendezvous (ft_rendezvous_barrier.py) drops no node by heartbeat: a lost node is "
            "simply not in the next round, so keep_alive_interval and keep_alive_max_attempt change nothing")


def _keep_alive_from_rdzv_conf() -> None:
    from datetime import timedelta

    from nvidia_resiliency_ext.fault_tolerance import _ft_rendezvous as rdzv

    create_handler = rdzv.create_handler

    @functools.wraps(create_handler)
    def create_handler_with_keep_alive(store, backend, params):
        handler = create_handler(store, backend, params)
        # One settings object is shared by the handler (its heartbeat timer), its state holder (which drops
        # the nodes whose last heartbeat is older than interval x attempts) and its op executor; it is a
        # frozen dataclass, so it is changed in place, before the first round starts the heartbeats.
        settings = handler._settings
        interval = params.get_as_int("keep_alive_interval", None)
        attempts = params.get_as_int("keep_alive_max_attempt", None)
        for key, value in zip(KEEP_ALIVE_KEYS, (interval, attempts), strict=True):
            if value is not None and value < 1:
                raise ValueError(f"The rendezvous configuration option '{key}' must be at least 1, "
                                 f"not {value}.")
        wanted = (timedelta(seconds=interval) if interval is not None else settings.keep_alive_interval,
                  attempts if attempts is not None else settings.keep_alive_max_attempt)
        if wanted != (settings.keep_alive_interval, settings.keep_alive_max_attempt):
            object.__setattr__(settings, "keep_alive_interval", wanted[0])
            object.__setattr__(settings, "keep_alive_max_attempt", wanted[1])
            seconds = wanted[0].total_seconds()
            print(f"[resil] rendezvous: a heartbeat every {seconds:g} s, a node dropped after {wanted[1]} "
                  f"missed ({seconds * wanted[1]:g} s without one; NVRx's default: 5 s x 3 = 15 s), from "
                  "--rdzv-conf", file=sys.stderr, flush=True)
        return handler

    rdzv.create_handler = create_handler_with_keep_alive


# ---- ft_launcher under in-process restart: a lost rank's survivors go on ------------------------------

KEEP_SURVIVORS = "ft_launcher leaves a lost rank's survivors to in-process restart"
_AGENT = f"{_FT}.launcher:LocalElasticAgent"
_SUBPROCESSES = "torch.distributed.elastic.multiprocessing.api:SubprocessContext"
_ELASTIC_COPY = f"{_FT}._torch_elastic_compat"


def _keep_survivors_of_a_lost_rank() -> None:
    from nvidia_resiliency_ext.fault_tolerance import launcher

    RunResult, WorkerState = launcher.RunResult, launcher.WorkerState  # noqa: N806 - 0.4.1 has its own copy
    monitor_workers = launcher.LocalElasticAgent._monitor_workers

    @functools.wraps(monitor_workers)
    def monitor_leaving_survivors(self, worker_group):
        result = monitor_workers(self, worker_group)
        if result.state is not WorkerState.UNHEALTHY:  # all well, all done, or all failed: NVRx decides
            return result
        context = self._pcontext
        running = [h.proc.pid for h in context.subprocess_handlers.values() if h.proc.poll() is None]
        killed = {rank: failure for rank, failure in context._failures.items() if failure.exitcode < 0}
        if not running or len(killed) < len(context._failures):
            return result  # a rank that failed otherwise, or nobody left: the agent's own decision
        # Killed by a signal while the others train: in-process restart puts a warm reserve in its place,
        # or ends every rank (and the agent restarts them). Forgotten here, it is said once, and the
        # group's end is the others' (all exit 0: SUCCEEDED).
        for local_rank, failure in killed.items():
            del context._failures[local_rank]
            rank = worker_group.workers[local_rank].global_rank
            print(f"[resil] ft_launcher: rank {rank} (pid {failure.pid}) was killed (exit code "
                  f"{failure.exitcode}); --inprocess-restart: the other {len(running)} rank "
                  f"{'process goes' if len(running) == 1 else 'processes go'} on, and a warm reserve takes "
                  "its place or the in-process restarts end", file=sys.stderr, flush=True)
        return RunResult(state=WorkerState.HEALTHY)

    launcher.LocalElasticAgent._monitor_workers = monitor_leaving_survivors


# ---- NVRx's own GPU health checks before an in-process restart, on a host without CUDA -----------------

_INPROCESS = "nvidia_resiliency_ext.inprocess"
NO_GPU_HEALTH_CHECKS = "NVRx's GPU health checks left out of in-process restarts without CUDA"
_CONSTRUCT = f"{_INPROCESS}:Wrapper._construct_restart_health_check"
# NVRx 0.5 and later chain checks of their own after the Wrapper's health_check and run them before every
# restart (the Wrapper's `restart_health_check`; 0.4.1 has neither): one each for the GPU, its NVLinks and
# its InfiniBand NIC, the GPU being LOCAL_RANK's. All three read the GPU through NVML.
GPU_HEALTH_CHECKS = ("ChainedGPUHealthCheck", "ChainedNVLHealthCheck", "ChainedNicHealthCheck")


def _inprocess_restart(args: argparse.Namespace | None) -> bool:
    return args is None or bool(getattr(args, "inprocess_restart", False))


def _inprocess_restart_without_cuda(args: argparse.Namespace | None) -> bool:
    import torch

    return not torch.cuda.is_available() and _inprocess_restart(args)


def _no_restart_health_checks() -> str | None:
    from nvidia_resiliency_ext import inprocess

    if not hasattr(inprocess.Wrapper, "_construct_restart_health_check"):
        return "its Wrapper runs no health checks of its own before a restart"
    return None


def _gpu_health_checks_left_out_without_cuda() -> None:
    from nvidia_resiliency_ext import inprocess

    construct = inprocess.Wrapper._construct_restart_health_check
    gpu_checks = tuple(getattr(inprocess.health_check, name) for name in GPU_HEALTH_CHECKS
                       if hasattr(inprocess.health_check, name))

    @functools.wraps(construct)
    def construct_without_gpu_checks(self) -> None:
        from megatron_resil.resilience import inprocess_restart  # its set-up line names what is left out

        construct(self)
        chained = self.restart_health_check
        checks = () if chained is None else getattr(chained, "instances", (chained,))  # a Compose, or one
        if chained is not None:
            kept = [check for check in checks if not isinstance(check, gpu_checks)]
            self.restart_health_check = inprocess.Compose(*kept) if kept else None
        inprocess_restart.gpu_health_checks_left_out = tuple(
            type(check).__name__ for check in checks if isinstance(check, gpu_checks))

    inprocess.Wrapper._construct_restart_health_check = construct_without_gpu_checks


# ---- NVRx's restart signal to the training thread, when it never arrives ---------------------------------

_MONITOR = f"{_INPROCESS}.monitor_thread:MonitorThread"
RESTART_LOST = "a restart NVRx raised into the training thread and lost is raised again"


def _raise_the_restart_a_join_lost() -> None:
    import ctypes
    import threading

    from nvidia_resiliency_ext.inprocess import monitor_thread

    maybe_join = monitor_thread.MonitorThread.maybe_join
    # its own handle on the C function, called with the GIL held: None passes NULL (which clears)
    clear_async_exc = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)(
        ("PyThreadState_SetAsyncExc", ctypes.pythonapi))

    @functools.wraps(maybe_join)
    def maybe_join_or_restart(self, timeout=None):
        maybe_join(self, timeout)  # RankShouldRestart, raised into this thread by the monitor, arrives here
        from megatron_resil.resilience import inprocess_restart

        if self not in inprocess_restart.aborted_by:
            return  # it never aborted: NVRx's own InternalError follows, as it would
        # The monitor thread ran our abort, then raised RankShouldRestart into this thread, and it ended
        # (joined): the exception was consumed somewhere without reaching the Wrapper (CI, stop 43: once,
        # rank 0 of three, a peer's abort having broken its gradient all-reduce). Without it NVRx ends the
        # process with InternalError, and every other rank's restart with it. Nothing may stay pending.
        clear_async_exc(threading.main_thread().ident, None)
        print(f"[resil] inprocess: rank {self.state.rank}: NVRx's restart signal to the training thread "
              "never arrived after its abort; raised again, so this rank restarts with the others",
              file=sys.stderr, flush=True)
        raise monitor_thread.RankShouldRestart("the restart the monitor thread raised was lost")

    monitor_thread.MonitorThread.maybe_join = maybe_join_or_restart


def _uses_local_tier(args: argparse.Namespace | None) -> bool:
    return args is None or getattr(args, "non_persistent_ckpt_type", None) == "local"


def _uses_replication(args: argparse.Namespace | None) -> bool:
    return _uses_local_tier(args) and (args is None or bool(getattr(args, "replication", False)))


def _async_replication(args: argparse.Namespace | None) -> bool:
    return _uses_replication(args) and (args is None or bool(getattr(args, "async_save", False)))


PATCHES = (
    Patch(
        name=NO_GPU_HEALTH_CHECKS,
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=_CONSTRUCT,
        why="NVRx 0.5 and later chain GPU, NVLink and NIC checks (each reading LOCAL_RANK's GPU through "
            "NVML) after the Wrapper's own health_check and run them before every restart; on a host without "
            "a GPU there is no NVML: the NVLink check raises NVMLError and the GPU check reports the GPU "
            "unhealthy, so every rank ends with HealthCheckError at the first restart. The Wrapper builds "
            "the chain without them (with CUDA, on a GPU host, they all stay: the record is not installed)",
        checks=(
            Takes(_CONSTRUCT, ("self",)),
            Says(f"{_INPROCESS}:Wrapper.__init__", "self._construct_restart_health_check()"),
            Says(_CONSTRUCT, "self.restart_health_check = Compose(*health_checks)"),
            Says(_CONSTRUCT, "ChainedGPUHealthCheck("),
            Has(f"{_INPROCESS}.health_check:ChainedGPUHealthCheck"),
            Has(f"{_INPROCESS}:Compose"),
            # read at each restart, so the chain as the constructor leaves it is the one that runs
            Says(f"{_INPROCESS}.wrap", "wrapper.restart_health_check(state.freeze())"),
        ),
        apply=_gpu_health_checks_left_out_without_cuda,
        not_needed=_no_restart_health_checks, not_needed_on="<0.5",
        when=_inprocess_restart_without_cuda,
    ),
    Patch(
        name=RESTART_LOST,
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=f"{_MONITOR}.maybe_join",
        why="when the wrapped function raised, NVRx's Wrapper records the interruption and joins its monitor "
            "thread, which aborts and raises RankShouldRestart into the training thread; if that exception "
            "is consumed on its way (seen once in CI: the join returned, nothing raised), the Wrapper ends "
            "the process with InternalError and the job with it. After our abort ran in the monitor thread, "
            "the join raises RankShouldRestart itself, with nothing left pending",
        checks=(
            Takes(f"{_MONITOR}.maybe_join", ("self", "timeout")),
            Says(f"{_MONITOR}.maybe_join", "self.stop_raising.set()"),
            Says(f"{_MONITOR}.run", "self.abort(state)"),
            Says(f"{_MONITOR}.run", "async_abort_main_thread(msg)"),
            Has(f"{_INPROCESS}.monitor_thread:RankShouldRestart"),
            Says(f"{_INPROCESS}.wrap", "monitor_thread.maybe_join()"),
            Says(f"{_INPROCESS}.wrap", "except RankShouldRestart as async_ex:"),
            Says(f"{_MONITOR}.__init__", "self.state = state"),
        ),
        apply=_raise_the_restart_a_join_lost,
        when=_inprocess_restart,
    ),
    Patch(
        name="NVRx local checkpointing modules",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=_MANAGER,
        why="the local tier's modules import NVRx's local checkpoint manager, replication strategy and group "
            "wrapper from these paths; every run imports them",
        checks=(
            Has(_MANAGER), Has(f"{_LOCAL}.ckpt_managers.base_manager:CheckpointingException"), Has(_GROUP),
            Has(f"{_LOCAL}.replication.group_utils:parse_group_sequence"),
            Has(f"{_LOCAL}.replication.strategies:CliqueReplicationStrategy"), Has(_STATE),
        ),
    ),
    Patch(
        name="local tier's LocalCheckpointManager subclass",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=_MANAGER,
        why="_VerifiableLocalManager overrides the private _save, _save_fn, _my_ckpt_ids, _cleanup and "
            "_cleanup_failed_save and calls _ensure_dir and _local_ckpt_path_from_id: sealed shards with "
            "manifests, write failures reported collectively, manifests cleaned with their shards",
        checks=(
            Takes(f"{_MANAGER}.__init__", ("self", "root_local_ckpt_dir", "session_id", "repl_strategy")),
            Takes(f"{_MANAGER}._save", ("self", "state_dict", "ckpt_id")),
            Takes(f"{_MANAGER}._save_fn", ("self", "id_to_state_dict")),
            Takes(f"{_MANAGER}._my_ckpt_ids", ("self",)),
            Takes(f"{_MANAGER}._cleanup", ("self", "iteration")),
            Takes(f"{_MANAGER}._cleanup_failed_save", ("self", "iteration")),
            Takes(f"{_MANAGER}._ensure_dir", ("self",)),
            Takes(f"{_MANAGER}._local_ckpt_path_from_id", ("self", "ckpt_id", "is_dirty")),
            Has(f"{_MANAGER}.local_ckpt_dir"),
            Takes(f"{_BASE}.save", ("self", "state_dict", "iteration", "is_async")),
            Says(f"{_BASE}.save", "self._save_fn"),
            Says(f"{_BASE}.save", "self._cleanup(iteration)"),
            Says(f"{_BASE}.save", "self._cleanup_failed_save"),
            Says(f"{_BASE}._save_fn", "self._save(state_dict, ckpt_id)"),
            Says(f"{_BASE}.find_latest", "self._my_ckpt_ids()"),
            Says(f"{_BASE}.__init__", "self.latest_iteration = -1"),
        ),
        when=_uses_local_tier,
    ),
    Patch(
        name="replication group wrapper on gloo",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=f"{_GROUP}.isend_state_dict",
        why="NVRx 0.4.1 sends and receives replicas through .cuda() tensors; _PointToPointGroup overrides "
            "isend_state_dict and irecv_state_dict to send on the process group's device",
        checks=(
            Takes(f"{_GROUP}.isend_state_dict", ("self", "state_dict", "dst")),
            Takes(f"{_GROUP}.irecv_state_dict", ("self", "src")),
            Takes(f"{_GROUP}.send_object", ("self", "obj", "dst")),
            Takes(f"{_GROUP}.recv_object", ("self", "src")),
            Says(_GROUP, "self.isend_state_dict("),
            Says(_GROUP, "self.irecv_state_dict("),
            *(Has(f"{_STATE}.{name}") for name in ("pop_tensors", "insert_tensors", "init_tensors",
                                                   "copy_tensors_to_cpu", "tensors")),
        ),
        when=_uses_replication,
    ),
    Patch(
        name="replication in the async workers",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=f"{_LOCAL}.replication.strategies:CliqueReplicationStrategy.replicate",
        why="with --async-save each rank's background worker calls replicate on its sealed shard, over the "
            "workers' own gloo group, and writes the copies it gets back (checkpointing/local_tier.py)",
        checks=(Takes(f"{_LOCAL}.replication.strategies:CliqueReplicationStrategy.replicate",
                      ("self", "local_ckpt", "id_")),),
        when=_async_replication,
    ),
    Patch(
        name=KEEP_SURVIVORS,
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=f"{_AGENT}._monitor_workers",
        why="ft_launcher's agent ends every worker of its node when one has died (any-failed, and "
            "min-healthy with one agent), so under in-process restart a warm reserve never gets to take a "
            "lost rank's place: its survivors are gone with it. With --inprocess-restart among the script's "
            "arguments, megatron_resil.launch.ft_launcher installs this in its own process: a worker killed "
            "by a signal while others run is left to the in-process layer, which replaces it or ends every "
            "rank",
        checks=(
            Takes(f"{_AGENT}._monitor_workers", ("self", "worker_group")),
            # NVRx leaves the survivors running when it reports a failure; the agent's loop stops them
            Says(f"{_AGENT}._monitor_workers", "patched_method(self._pcontext, 'close'"),
            Says(f"{_AGENT}._monitor_workers", "state=WorkerState.UNHEALTHY"),
            # NVRx 0.4.1 carries its own copy of torch's elastic agent; 0.5 and later use torch's
            Has(f"{_FT}.launcher:RunResult"), Has(f"{_FT}.launcher:WorkerState.UNHEALTHY"),
            Says(f"{_AGENT}._start_workers", "self._pcontext = start_processes("),
            AnyOf((Says(f"{_ELASTIC_COPY}.multiprocessing.api:SubprocessContext", "self.subprocess_handlers"),
                   Says(_SUBPROCESSES, "self.subprocess_handlers"))),
            # the failures a poll reports, by local rank; one dropped there is not reported again
            AnyOf((Says(f"{_ELASTIC_COPY}.multiprocessing.api:SubprocessContext._poll",
                        "self._failures[local_rank] = ProcessFailure("),
                   Says(f"{_SUBPROCESSES}._capture_process_failures",
                        "self._failures[local_rank] = ProcessFailure("))),
            AnyOf((Says(f"{_ELASTIC_COPY}.multiprocessing.errors:ProcessFailure", "exitcode: int"),
                   Says("torch.distributed.elastic.multiprocessing.errors:ProcessFailure", "exitcode: int"))),
        ),
        apply=_keep_survivors_of_a_lost_rank,
        when=_launcher_only,
    ),
    Patch(
        name=KEEP_ALIVE,
        package=PACKAGE, written_for=">=0.4.1,<0.5",
        target=f"{_RDZV}:create_handler",
        why="NVRx 0.4.1's rendezvous hard-codes a heartbeat every 5 s and 3 missed before a node is dropped "
            "(FtRendezvousHandler.from_backend), where torch's c10d rendezvous reads keep_alive_interval and "
            "keep_alive_max_attempt from --rdzv-conf: after a node loss the survivors cannot form the next "
            "round with its replacement for 10-15 s (issue 26's drill). Installed in ft_launcher's process "
            "by megatron_resil.launch.ft_launcher when --rdzv-conf names a key; NVRx's defaults otherwise",
        checks=(
            Takes(f"{_RDZV}:create_handler", ("store", "backend", "params")),
            # NVRx's launcher imports create_handler from the module when it registers the handler, so the
            # module's attribute is what it calls.
            Says(f"{_FT}.launcher", "from ._ft_rendezvous import FtRendezvousHandler, create_handler",
                 on_disk=True),
            # from_backend's (a classmethod: checked in its class, whose identity the patch tests follow).
            Says(_HANDLER, "keep_alive_interval=timedelta(seconds=5)", count=1),
            Says(_HANDLER, "_BackendRendezvousStateHolder(backend, settings)", count=1),
            Says(f"{_HANDLER}.__init__", "self._settings = settings"),
            Says(f"{_HANDLER}.__init__", "self._settings,"),  # the op executor's
            Says(f"{_HANDLER}._start_heartbeats", "self._settings.keep_alive_interval"),
            Says(f"{_RDZV}:_BackendRendezvousStateHolder.__init__", "self._settings = settings"),
            Says(f"{_RDZV}:_BackendRendezvousStateHolder._sanitize",
                 "self._settings.keep_alive_interval * self._settings.keep_alive_max_attempt"),
            Says(f"{_RDZV}:RendezvousSettings", "keep_alive_max_attempt: int"),
        ),
        apply=_keep_alive_from_rdzv_conf,
        not_needed=keep_alive_not_needed, not_needed_on=">=0.5",
        when=_launcher_only,
    ),
)
