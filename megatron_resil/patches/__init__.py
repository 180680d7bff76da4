"""Every change we make to someone else's code (megatron-core, torch, NVRx, the interpreter), and every
private name of theirs we build on: one file per upstream (megatron_core.py, megatron_core_cpu.py,
torch_dcp.py, torch_startup.py, nvrx.py, stdlib.py) declares its records, and registry.py checks and
installs them at start-up: `patches.install(args)`, once, after the arguments are checked and before
megatron-core is imported. docs/patches.md lists every record and what happens where one does not fit.

Importing this package imports the registry only, not the records' files.
"""

from megatron_resil.patches.registry import (
    STAND_DOWN,
    STOP,
    AnyOf,
    Has,
    NotImported,
    Patch,
    Says,
    Takes,
    UpstreamMismatch,
    applied,
    call_installed,
    decisions,
    imported_ahead,
    install,
    install_ahead,
    install_import_speedups,
    installed_version,
    records,
    wanted_ahead,
)

__all__ = ["STAND_DOWN", "STOP", "AnyOf", "Has", "NotImported", "Patch", "Says", "Takes", "UpstreamMismatch",
           "applied", "call_installed", "decisions", "imported_ahead", "install", "install_ahead",
           "install_import_speedups", "installed_version", "records", "wanted_ahead"]
