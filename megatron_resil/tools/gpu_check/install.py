"""The install step of the GPU check: the cp312 wheels that scripts/fetch_gpu_wheels.sh downloaded, installed
with `pip install --no-deps --no-index --target` into a folder of their own that the runs put first on
PYTHONPATH, so pip never touches the machine's torch; afterwards torch must still be the same build from the
same place. A wheel tagged for a newer glibc than this machine's (NVRx ships manylinux_2_39 only) goes in
under the generic linux tag: its one native module is NVRx's CUPTI extension, which needs CUDA's libraries."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

# What the runs need from the wheels, and what the machine must keep as it was.
PROBE = """
import importlib, importlib.metadata as md, json, sys
found = {"python": sys.version.split()[0]}
try:
    import torch
    found.update(torch=torch.__version__, torch_file=torch.__file__, cuda=torch.cuda.is_available(),
                 device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
except Exception as err:
    found["torch_error"] = f"{type(err).__name__}: {err}"
for dist, module in (("megatron-core", "megatron.core"), ("nvidia-resiliency-ext", "nvidia_resiliency_ext"),
                     ("isal", "isal"), ("google-crc32c", "google_crc32c"),
                     ("transformer-engine", "transformer_engine.pytorch")):
    try:
        importlib.import_module(module)
        found[dist] = md.version(dist)
    except Exception as err:
        found[dist] = None
        found[dist + "_error"] = f"{type(err).__name__}: {err}"[:300]
print(json.dumps(found))
"""

_PLATFORM_TAG = re.compile(r"manylinux_(\d+)_(\d+)_x86_64")


def glibc_minor() -> int | None:
    """This machine's glibc 2.x minor version (None when it is not glibc)."""
    version = os.confstr("CS_GNU_LIBC_VERSION") if "CS_GNU_LIBC_VERSION" in os.confstr_names else ""
    match = re.fullmatch(r"glibc 2\.(\d+)", version or "")
    return int(match.group(1)) if match else None


def installable(wheel: Path, glibc: int | None, staging: Path) -> tuple[Path, str | None]:
    """The wheel as pip will take it here: itself, or a copy under the generic linux tag when its only
    manylinux tags ask for a newer glibc than this one (with a note saying so)."""
    tags = [(int(major), int(minor)) for major, minor in _PLATFORM_TAG.findall(wheel.name) if major == "2"]
    if glibc is None or not tags or min(minor for _, minor in tags) <= glibc:
        return wheel, None
    name, _, _ = wheel.name.rpartition("-")  # the last field is the platform tag
    copy = staging / f"{name}-linux_x86_64.whl"
    shutil.copyfile(wheel, copy)
    return copy, (f"{wheel.name} asks for glibc 2.{min(minor for _, minor in tags)}, this machine has "
                  f"2.{glibc}: installed under the generic linux tag")


def install(wheels: Path, target: Path, timeout: float) -> tuple[list[str], list[str]]:
    """pip-install every wheel in `wheels` into `target` without dependencies or an index. Returns (the
    wheels installed, notes); raises RuntimeError with pip's last line when pip fails."""
    found = sorted(wheels.glob("*.whl"))
    if not found:
        raise RuntimeError(f"no wheels in {wheels}: run scripts/fetch_gpu_wheels.sh on the CPU machine and "
                           "send that folder along")
    staging = target.parent / "retagged_wheels"
    staging.mkdir(parents=True, exist_ok=True)
    glibc = glibc_minor()
    chosen, notes = [], []
    for wheel in found:
        path, note = installable(wheel, glibc, staging)
        chosen.append(path)
        notes += [note] if note else []
    # --isolated: no pip configuration or environment of this machine (an index, constraints) applies.
    cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--no-deps", "--no-index",
           "--disable-pip-version-check", "--no-warn-script-location", "--no-compile", "--upgrade",
           "--target", str(target), *map(str, chosen)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 and "No module named pip" in done.stderr:
        unpack(chosen, target)
        notes.append(f"no pip for {sys.executable}: the wheels were unpacked (none has a .data folder)")
    elif done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip()).splitlines() or [f"exit code {done.returncode}"]
        raise RuntimeError(f"pip install failed: {last[-1]}")
    return [w.name for w in found], notes


def unpack(wheels: list[Path], target: Path) -> None:
    """What pip does for a wheel without a .data folder (scripts, headers, data): unzip it into `target`."""
    target.mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            if any(".data/" in name for name in archive.namelist()):
                raise RuntimeError(f"{wheel.name} has a .data folder: install pip to install it")
            archive.extractall(target)
