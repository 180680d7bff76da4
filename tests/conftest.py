"""Run the longest test files first.

Two at a time (`--dist loadfile`, what scripts/test.sh does by default) hands whole files to the two
workers in collection order. A long file handed out last leaves one worker idle while the other
finishes it, so the heaviest files are collected first: longest-first is the usual way to keep two
queues even. The weights are seconds per file from a two-at-a-time run from a fresh clone
(tests/README.md); a file not listed keeps its place after them. Only the order changes,
never what runs.
"""

from __future__ import annotations

SECONDS_PER_FILE = {  # the slowest 80 tests' seconds summed per file, 2026-11-26
    "test_node_loss_drill.py": 250,
    "test_slurm.py": 248,
    "test_resume.py": 222,
    "test_async_save.py": 196,
    "test_engine.py": 112,
    "test_integrity.py": 81,
    "test_disk_full.py": 78,
    "test_elastic.py": 77,
    "test_megatron_lm_layout.py": 76,
    "test_crash_consistency.py": 68,
    "test_rerun.py": 66,
    "test_fault_injection.py": 65,
    "test_ft_launcher.py": 56,
    "test_exit_signal.py": 54,
    "test_inprocess_restart.py": 52,
    "test_bf16.py": 51,
    "test_zarr_format.py": 50,
    "test_load_io_errors.py": 44,
    "test_local_tier.py": 36,
    "test_dir_lock.py": 35,
    "test_launcher_watch.py": 27,
    "test_launch_scripts.py": 25,
    "test_untrusted_checkpoint.py": 20,
    "test_safe_load.py": 20,
    "test_failing_fs_steps.py": 15,
    "test_gpu_path.py": 15,
    "test_real_data.py": 14,
    "test_straggler.py": 11,
    "test_non_persistent.py": 10,
}


def pytest_collection_modifyitems(session, config, items):
    # sort() is stable: within a file, and among unlisted files, the collected order stays.
    items.sort(key=lambda item: -SECONDS_PER_FILE.get(item.path.name, 0))
