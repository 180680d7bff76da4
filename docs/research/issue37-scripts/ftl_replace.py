"""Prototype of a launcher patch (launcher process only): NVRx's ft_launcher, unchanged except that a worker
that fails is replaced alone (a new process for the same local rank, env RESIL_REPLACEMENT=1), and the agent
is told the group is healthy: the survivors are not stopped. Usage: python ftl_replace.py <ft_launcher args>"""
import os, sys, time
from nvidia_resiliency_ext.fault_tolerance import launcher as L
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.multiprocessing.subprocess_handler import get_subprocess_handler
MAX = int(os.environ.get("RESIL_MAX_REPLACEMENTS", "3"))
_done = {"n": 0}
_orig = L.LocalElasticAgent._monitor_workers


def _monitor_workers(self, worker_group):
    result = _orig(self, worker_group)
    if result.state not in (WorkerState.FAILED, WorkerState.UNHEALTHY) or not result.failures or _done["n"] >= MAX:
        return result
    pc = self._pcontext
    for global_rank, failure in result.failures.items():
        lr = failure.local_rank
        env = dict(pc.envs[lr], RESIL_REPLACEMENT="1")
        h = get_subprocess_handler(entrypoint=pc.entrypoint, args=pc.args[lr], env=env, stdout=pc.stdouts[lr],
                                   stderr=pc.stderrs[lr], local_rank_id=lr)
        pc.subprocess_handlers[lr] = h
        pc._running_local_ranks.add(lr)
        pc._failures.pop(lr, None)
        worker_group.workers[lr].id = h.proc.pid
        _done["n"] += 1
        print(f"[ftl_replace] {time.time():.3f} rank {global_rank} (local {lr}) exited {failure.exitcode}: "
              f"replaced alone by pid {h.proc.pid}; survivors untouched", file=sys.stderr, flush=True)
    return RunResult(state=WorkerState.HEALTHY)


L.LocalElasticAgent._monitor_workers = _monitor_workers
sys.exit(L.main())
