"""Run the longest test files first.

Two at a time (`--dist loadfile`, what scripts/test.sh does by default) hands whole files to the two
workers in collection order. A long file handed out last leaves one worker idle while the other
finishes it, so the heaviest files are collected first: longest-first is the usual way to keep two
queues even. The weights are seconds per file from a two-at-a-time run from a fresh clone
(2026-11-25, tests/README.md); a file not listed keeps its place after them. Only the order changes,
never what runs.
"""

from __future__ import annotations

SECONDS_PER_FILE = {
    "test_node_loss_drill.py": 181,
    "test_slurm.py": 250,  # estimated after the time-limit test began waiting for events (2026-11-26)
    "test_async_save.py": 125,
    "test_resume.py": 137,
    "test_engine.py": 59,
    "test_ft_launcher.py": 53,
    "test_fault_injection.py": 50,
    "test_crash_consistency.py": 49,
    "test_elastic.py": 47,
    "test_exit_signal.py": 46,
    "test_disk_full.py": 44,
    "test_rerun.py": 44,
    "test_bf16.py": 42,
    "test_integrity.py": 41,
    "test_megatron_lm_layout.py": 40,
    "test_inprocess_restart.py": 32,
    "test_load_io_errors.py": 45,
    "test_untrusted_checkpoint.py": 45,  # estimated, new on 2026-11-26
}


def pytest_collection_modifyitems(session, config, items):
    # sort() is stable: within a file, and among unlisted files, the collected order stays.
    items.sort(key=lambda item: -SECONDS_PER_FILE.get(item.path.name, 0))
