"""Where an installed module's code is, found without importing it or any of its packages: for checks that
must not import what they look at (the patch records that precede megatron-core's import, and a
checkpoint's class names, which must never make us import anything)."""

from __future__ import annotations

import importlib.util
import os


def module_path(module_name: str) -> str | None:
    """The file of `module_name` ("a.b.c": its `c.py`, or its package directory `c/`), looked up under the
    directories of its top-level package; None where there is none."""
    top, *inner = module_name.split(".")
    spec = importlib.util.find_spec(top)  # a top-level name is found, not imported
    if spec is None or not inner:
        return spec.origin if spec is not None else None
    for location in spec.submodule_search_locations or []:
        base = os.path.join(location, *inner)
        if os.path.isfile(base + ".py"):
            return base + ".py"
        if os.path.isdir(base):
            return base
    return None
