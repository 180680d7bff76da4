"""What a rank forked from a standby keeps from its own start (standby.py, issue 35).

A fork has its standby's resource limits, nice value, CPU affinity and NUMA memory policy, not what the
launcher gave the rank (srun --cpu-bind, taskset, nice, prlimit, numactl). So the client sends its own
(`current`) and the worker takes them before anything runs (`take`): all of them, or the worker says
which one it cannot have here (raising a hard limit without CAP_SYS_RESOURCE, a CPU outside the
standby's cpuset), and the client, refused, imports for itself. docs/standby.md lists what is not kept.
"""

from __future__ import annotations

import os
import resource

# Each resource limit once (RLIMIT_OFILE is RLIMIT_NOFILE's other name).
RLIMITS = {name: getattr(resource, name) for name in sorted(dir(resource))
           if name.startswith("RLIMIT_") and name != "RLIMIT_OFILE"}
MAX_NUMA_NODES = 1024  # the kernel's MAX_NUMNODES at most (NODES_SHIFT 10)
# get_mempolicy(2) and set_mempolicy(2), which the C library does not wrap (libnuma does); elsewhere a
# NUMA policy is not carried (docs/standby.md).
_MEMPOLICY_SYSCALLS = {"x86_64": (239, 238), "aarch64": (236, 237), "ppc64le": (260, 261)}


def current() -> dict:
    """This process's settings, as a request carries them."""
    return {"affinity": sorted(os.sched_getaffinity(0)), "nice": os.getpriority(os.PRIO_PROCESS, 0),
            "rlimits": {name: list(resource.getrlimit(which)) for name, which in RLIMITS.items()},
            "mempolicy": mempolicy()}


def take(request: dict) -> str | None:
    """The settings of `request` (current()'s) for this process, a worker before anything runs; None, or
    why one of them cannot be had here. The limits come first: they bound the nice value a process may
    set (RLIMIT_NICE), as they bounded the client's."""
    for name, (soft, hard) in request["rlimits"].items():
        which = RLIMITS[name]
        own = resource.getrlimit(which)
        if own != (soft, hard):
            try:
                resource.setrlimit(which, (soft, hard))
            except (ValueError, OSError) as err:
                return (f"its {name} {_limit(soft)}:{_limit(hard)} cannot be given here (the standby has "
                        f"{_limit(own[0])}:{_limit(own[1])}; {err})")
    nice = request["nice"]
    own_nice = os.getpriority(os.PRIO_PROCESS, 0)
    if own_nice != nice:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
        except OSError as err:
            return f"its nice value {nice} cannot be given here (the standby's is {own_nice}; {err.strerror})"
    cpus = set(request["affinity"])
    if os.sched_getaffinity(0) != cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as err:
            return f"its CPU affinity {_list(cpus)} cannot be given here ({err.strerror})"
        if os.sched_getaffinity(0) != cpus:  # the standby's cpuset lacks some of them
            return (f"its CPU affinity {_list(cpus)} cannot be given here (the standby's cpuset allows "
                    f"{_list(os.sched_getaffinity(0))} of them)")
    wanted = request["mempolicy"]
    if wanted is not None and wanted != mempolicy():
        why = _set_mempolicy(wanted["mode"], wanted["nodes"])
        if why is not None:
            return (f"its NUMA memory policy (mode {wanted['mode']:#x}, nodes {_list(wanted['nodes'])}) "
                    f"cannot be given here ({why})")
    return None


def _limit(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else str(value)


def _list(numbers) -> str:
    return ",".join(map(str, sorted(numbers))) or "none"


def mempolicy() -> dict | None:
    """This thread's NUMA memory policy, {"mode": ..., "nodes": [...]} as get_mempolicy(2) gives it (the
    mode with its MPOL_F_* flags); None where the kernel tells none (built without NUMA: ENOSYS; a seccomp
    filter: EPERM) or this architecture's system call number is not known here: then nothing is carried,
    and the worker keeps the standby's policy."""
    numbers = _MEMPOLICY_SYSCALLS.get(os.uname().machine)
    if numbers is None:
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    mode, mask = ctypes.c_int(), (ctypes.c_ulong * (MAX_NUMA_NODES // bits))()
    if libc.syscall(ctypes.c_long(numbers[0]), ctypes.byref(mode), mask, ctypes.c_ulong(MAX_NUMA_NODES),
                    ctypes.c_void_p(None), ctypes.c_ulong(0)) != 0:
        return None
    return {"mode": mode.value,
            "nodes": [i * bits + b for i, word in enumerate(mask) for b in range(bits) if word >> b & 1]}


def _set_mempolicy(mode: int, nodes: list[int]) -> str | None:
    """set_mempolicy(2) for this thread (and the threads it starts); None, or why it failed."""
    numbers = _MEMPOLICY_SYSCALLS.get(os.uname().machine)
    if numbers is None:
        return f"set_mempolicy's number on {os.uname().machine} is not known here"
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    mask = (ctypes.c_ulong * (MAX_NUMA_NODES // bits))()
    for node in nodes:
        mask[node // bits] |= 1 << node % bits
    # maxnode is one past the bits the kernel reads (it reads maxnode - 1), as libnuma passes it
    if libc.syscall(ctypes.c_long(numbers[1]), ctypes.c_long(mode), mask,
                    ctypes.c_ulong(MAX_NUMA_NODES + 1)) != 0:
        return os.strerror(ctypes.get_errno())
    return None
