"""Run the longest test files first.

Two at a time (`--dist loadfile`, what scripts/test.sh does by default) hands whole files to the two
workers in collection order. A long file handed out last leaves one worker idle while the other
finishes it, so the heaviest files are collected first: longest-first is the usual way to keep two
queues even. The weights are seconds per file from a two-at-a-time run
(tests/README.md); a file not listed keeps its place after them. Only the order changes,
never what runs.
"""

from __future__ import annotations

SECONDS_PER_FILE = {  # the slowest 90 tests' seconds summed per file, 2026-11-26 (a loaded machine;
    # only the order matters), files added that day estimated
    "test_resume.py": 502, "test_slurm.py": 390, "test_node_loss_drill.py": 302, "test_async_save.py": 235,
    "test_engine.py": 229, "test_integrity.py": 190, "test_rerun.py": 190, "test_megatron_flags.py": 180,
    "test_exit_signal.py": 173, "test_crash_consistency.py": 161, "test_gpu_check.py": 150,
    "test_elastic.py": 135, "test_inprocess_restart.py": 130, "test_disk_full.py": 123,
    "test_ft_launcher.py": 115, "test_bf16.py": 109, "test_local_tier.py": 108, "test_cross_lane.py": 100,
    "test_megatron_lm_layout.py": 94, "test_megatron_integrity.py": 90, "test_zarr_format.py": 87,
    "test_fault_injection.py": 85, "test_patches.py": 80, "test_sample_based.py": 70, "test_dir_lock.py": 70,
    "test_tokenizers.py": 60, "test_restart_phases.py": 60, "test_safe_load.py": 52,
    "test_load_io_errors.py": 51, "test_failing_fs_steps.py": 39, "test_launcher_watch.py": 38,
    "test_non_persistent.py": 33, "test_untrusted_checkpoint.py": 29, "test_launch_scripts.py": 28,
    "test_real_data.py": 27, "test_gpu_path.py": 26, "test_straggler.py": 20, "test_zarr_strategy.py": 19,
    "test_install.py": 16, "test_resume_semantics.py": 95, "test_weight_hashes.py": 45,
    "test_megatron_lm_checkpoints.py": 55,
}


def pytest_collection_modifyitems(session, config, items):
    # sort() is stable: within a file, and among unlisted files, the collected order stays.
    items.sort(key=lambda item: -SECONDS_PER_FILE.get(item.path.name, 0))
