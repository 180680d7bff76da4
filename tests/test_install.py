"""We install into the user's stack without replacing anything in it: setup.py states ranges, never pins,
and pip, asked to install the project into an environment that already holds torch, megatron-core and
NVRx within those ranges, installs the project alone."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

from tests import launch


def _install_requires() -> list[Requirement]:
    tree = ast.parse((launch.REPO / "setup.py").read_text())
    call = next(node for node in ast.walk(tree) if isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "setup")
    listed = next(k.value for k in call.keywords if k.arg == "install_requires")
    return [Requirement(ast.literal_eval(item)) for item in listed.elts]


def test_setup_py_states_ranges_and_never_an_upper_bound_on_torch():
    requirements = {r.name: r for r in _install_requires()}
    for requirement in requirements.values():
        assert not any(s.operator in ("==", "===", "~=") for s in requirement.specifier), requirement
    for name in ("torch", "megatron-core", "nvidia-resiliency-ext"):
        assert any(s.operator == ">=" for s in requirements[name].specifier), requirements[name]
    # A container's own torch (e.g. an NGC pre-release build) must never be downgraded or replaced.
    assert all(s.operator == ">=" for s in requirements["torch"].specifier)
    assert requirements["torch"].specifier.contains("2.11.0a0+nv", prereleases=True)


@pytest.mark.slow
@pytest.mark.compat  # on the second lane too: torch 2.13.0's CUDA build, megatron-core 0.19.2, NVRx 0.7.0
def test_installing_into_an_environment_that_has_the_stack_replaces_none_of_it(tmp_path):
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-build-isolation",
                           "--quiet", "--report", str(report), "-e", str(launch.REPO)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    would_install = {item["metadata"]["name"] for item in json.loads(report.read_text())["install"]}
    assert would_install == {"megatron-resil"}, would_install


def test_a_tool_prints_its_answer_and_no_dependency_import_noise():
    """Without PYTHONWARNINGS=ignore, torch (pynvml) and megatron-core (no TE or Apex) printed ten lines
    of warnings before the answer."""
    import os
    environment = {k: v for k, v in launch.env().items() if k != "PYTHONWARNINGS"}
    done = subprocess.run([sys.executable, "-m", "megatron_resil.tools.ckpt", "list",
                           str(launch.REPO / "tests" / "data" / "checkpoint_v0_1")],
                          env=environment, cwd=os.getcwd(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr
    assert done.stdout.startswith("persistent tier"), done.stdout
