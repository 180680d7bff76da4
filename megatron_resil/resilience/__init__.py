"""The failure modes a run survives, one module each, and what each does about its failure:

- signal_handler: preemption (a SIGTERM from Slurm, say): save and exit, never a partial checkpoint;
- stop_conditions: requested stops that save first (--exit-interval, --exit-duration-in-mins, a signal);
- fault_tolerance: a hung rank under NVRx's ft_launcher: its rank monitor ends it, the launcher restarts;
- launcher_watch: an orphaned rank (its launcher killed) stops at once instead of training on beside the
  restarted job;
- inprocess_restart: a failure on any rank restarts training inside the same processes (NVRx's Wrapper);
- rerun: a bad result (NaN, Inf, a spiky loss) judged by megatron-core's rerun state machine;
- rerun_escape: that machine's restart loop bounded, with a fall back to an older checkpoint;
- weight_hashes: data-parallel replicas whose weights drifted apart;
- straggler: slow ranks, named, and on request a stop;
- fault_injection: deterministic faults for tests and drills (--inject-fault);
- restart_phases: where a restart's time went, from the fault to the first iteration.

docs/failures.md says how each behaves; the map from each failure to its code is in README.md ("Where the
code is"). Importing this package imports none of them.
"""
