"""A process that hands itself to a standby as pretrain.py's first lines do, without torch: the standby
tests' cheapest rank. It prints `forked PID` or `cold PID` (its pid after the hand-over: the worker's, or
its own); with `frozen`, then `frozen N` (the objects out of its garbage collector's sight); with `wait` it
then waits until its stdin closes. `--prefer-node N` first sets its NUMA memory
policy to MPOL_PREFERRED node N, as `numactl --preferred N` would (x86_64 and aarch64)."""

import ctypes
import os
import sys

from megatron_resil import rank_process
from megatron_resil.launch import standby

MPOL_PREFERRED = 1
SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}

if "--prefer-node" in sys.argv and not rank_process.in_standby_worker():  # the worker runs this file again
    node = int(sys.argv[sys.argv.index("--prefer-node") + 1])
    mask = (ctypes.c_ulong * 1)(1 << node)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(ctypes.c_long(SET_MEMPOLICY[os.uname().machine]), ctypes.c_long(MPOL_PREFERRED), mask,
                    ctypes.c_ulong(65)) != 0:
        sys.exit(f"set_mempolicy: {os.strerror(ctypes.get_errno())}")

standby.hand_over()
print(f"{'forked' if rank_process.in_standby_worker() else 'cold'} {os.getpid()}", flush=True)
if "frozen" in sys.argv[1:]:  # how many objects are out of its garbage collector's sight
    import gc

    print(f"frozen {gc.get_freeze_count()}", flush=True)
if "wait" in sys.argv[1:]:
    sys.stdin.read()
