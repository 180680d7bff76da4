"""Run the longest test files first.

N at a time (`--dist loadfile`, what scripts/test.sh does by default) hands whole files to the
workers in collection order. A long file handed out last leaves one worker busy while the others
idle, so the heaviest files are collected first: longest-first is the usual way to keep the queues
even. The weights are seconds per file from a three-at-a-time run (tests/README.md); a file not
listed keeps its place after them. Only the order changes,
never what runs.
"""

from __future__ import annotations

SECONDS_PER_FILE = {  # seconds per file, three at a time on a quiet machine, 2026-11-26 (stop 31's
    # profile, `--durations=0`; test_tokenizers and test_resume as after that stop's cuts)
    "test_node_loss_drill.py": 238, "test_slurm.py": 231, "test_resume.py": 220, "test_async_save.py": 216,
    "test_integrity.py": 149, "test_engine.py": 121, "test_megatron_lm_checkpoints.py": 106,
    "test_gpu_check.py": 104, "test_megatron_flags.py": 103, "test_exit_signal.py": 103,
    "test_tokenizers.py": 100, "test_rerun.py": 88, "test_disk_full.py": 86, "test_fault_injection.py": 83,
    "test_crash_consistency.py": 83, "test_resume_semantics.py": 82, "test_elastic.py": 82,
    "test_megatron_lm_layout.py": 76, "test_ft_launcher.py": 63, "test_untrusted_checkpoint.py": 58,
    "test_zarr_format.py": 56, "test_patches.py": 54, "test_megatron_integrity.py": 52,
    "test_local_tier.py": 52, "test_dist_ckpt_strictness.py": 52, "test_launcher_watch.py": 51,
    "test_load_io_errors.py": 47, "test_use_checkpoint_args.py": 45, "test_bf16.py": 43,
    "test_inprocess_restart.py": 38, "test_dir_lock.py": 37, "test_weight_hashes.py": 31,
    "test_non_persistent.py": 28, "test_launch_scripts.py": 27, "test_sample_based.py": 26,
    "test_safe_load.py": 21, "test_restart_phases.py": 15, "test_straggler.py": 14,
    "test_failing_fs_steps.py": 14, "test_data.py": 12, "test_gpu_path.py": 9, "test_zarr_strategy.py": 8,
    "test_real_data.py": 8, "test_install.py": 7,
}


def pytest_collection_modifyitems(session, config, items):
    # sort() is stable: within a file, and among unlisted files, the collected order stays.
    items.sort(key=lambda item: -SECONDS_PER_FILE.get(item.path.name, 0))
