"""Someone else's code is patched in one place, at start-up only, and only where it is the code each patch was
written for: every record's checks pass on the installed stack; importing megatron_resil patches nothing;
and an upstream attribute renamed or removed under pretrain.py stops it with one line naming the package,
its version and the attribute (exit 2), never a traceback, while a problem upstream no longer has makes its
patch stand down with one line."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest

from tests import launch


def _python(code: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """A fresh interpreter (nothing imported yet, as at a real start-up), in the repository; a pretrain.py
    it runs after changing a module runs here, not in the tests' standby."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=launch.env(standby=False),
                          cwd=launch.REPO, timeout=timeout, capture_output=True, text=True)


def _lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]


def test_every_patch_is_checked_against_the_installed_code_and_fits_it():
    decided = _python("""
        import json
        from megatron_resil import patches
        from megatron_resil.patches import registry
        patches.install()
        print(json.dumps([{"name": p.name, "verdict": registry._decided[p.name].verdict,
                           "line": registry._decided[p.name].line, "checks": len(p.checks)}
                          for p in patches.records()]))
    """)
    assert decided.returncode == 0, decided.stdout + decided.stderr
    records = json.loads(decided.stdout.splitlines()[-1])
    assert len(records) >= 20
    # Each names what it relies on; on the versions CI runs, every one fits as expected, silently (a patch
    # of another release's code is "not needed" here, by a check of that code, not of a version number).
    assert all(r["checks"] for r in records), [r["name"] for r in records if not r["checks"]]
    expected = ("applied", "relied on", "not needed")
    unexpected = [r for r in records if r["verdict"] not in expected or r["line"]]
    assert not unexpected, unexpected
    assert sum(r["verdict"] == "applied" for r in records) >= 12


def test_every_patch_is_listed_in_the_docs():
    from megatron_resil import patches

    listed = (launch.REPO / "docs" / "patches.md").read_text()
    assert [p.name for p in patches.records() if f"| {p.name} " not in listed] == []


# What a patch can change: every target and checked attribute of every record, the import machinery, the
# safe-globals registry, and whether a fork hook was registered.
_SNAPSHOT = """
    import importlib, os, sys
    forks = []
    os.register_at_fork = lambda **hooks: forks.append(hooks)  # the test's own recorder
    import torch, torch.distributed.checkpoint.default_planner, torch.distributed.checkpoint.filesystem
    import megatron.core  # upstream's own import-time registrations happen here, before ours
    from megatron_resil.patches.registry import _resolve, records

    def paths():
        for patch in records():
            yield patch.target
            for check in patch.checks:
                for inner in getattr(check, "checks", (check,)):
                    if hasattr(inner, "path"):
                        yield inner.path

    def identity(path):
        try:
            return id(_resolve(path))
        except LookupError:  # another release's target (0.16's or 0.19's)
            return None

    def snapshot():
        seen = {path: identity(path) for path in sorted(set(paths()))}
        seen["sys.meta_path"] = [type(finder).__name__ for finder in sys.meta_path]
        seen["safe globals"] = sorted(map(repr, torch.serialization.get_safe_globals()))
        seen["fork hooks"] = len(forks)
        return seen

    before = snapshot()
"""


def test_importing_megatron_resil_patches_nothing_and_what_it_builds_replaces_nothing():
    """Only install() changes upstream code: importing every module changes no target, and the objects our
    code builds from upstream classes (megatron-core's rerun state machine, NVRx's in-process Wrapper) hold
    nothing of ours in place of their methods or their restart checks: those changes are records."""
    result = _python(textwrap.dedent(_SNAPSHOT) + textwrap.dedent("""
        import json, pkgutil, megatron_resil
        for module in pkgutil.walk_packages(megatron_resil.__path__, "megatron_resil."):
            importlib.import_module(module.name)
        after_imports = snapshot()
        from megatron_resil import patches
        patches.install()
        after_install = snapshot()
        print("changed by imports:", sorted(k for k in before if before[k] != after_imports[k]))
        print("changed by install:", len([k for k in before if before[k] != after_install[k]]))

        from megatron.core.rerun_state_machine import RerunStateMachine, get_rerun_state_machine
        from megatron_resil.resilience import rerun
        rerun.initialize(rerun.RerunConfig(mode="report_determinism_stats"))
        machine = get_rerun_state_machine()
        os.environ["LOCAL_RANK"] = "0"  # NVRx >= 0.5 chains its GPU checks for this rank's device
        from nvidia_resiliency_ext import inprocess
        from megatron_resil.patches import nvrx
        from megatron_resil.resilience import inprocess_restart
        chain = getattr(inprocess.Wrapper(), "restart_health_check", None)
        checks = getattr(chain, "instances", [chain] if chain else [])
        print("built:", json.dumps({
            "machine's own methods": [name for name in vars(machine)
                                      if callable(getattr(RerunStateMachine, name, None))],
            "restart checks": [type(check).__name__ for check in checks],
            "left out": list(inprocess_restart.gpu_health_checks_left_out),
            "NVRx's GPU checks": [name for name in nvrx.GPU_HEALTH_CHECKS
                                  if hasattr(inprocess.health_check, name)]}))
    """))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "changed by imports: []" in result.stdout
    changed = int(result.stdout.split("changed by install:")[1].split()[0])
    assert changed >= 10  # the snapshot sees patches: install() changes what imports left alone
    built = json.loads(result.stdout.split("built:")[1].splitlines()[0])
    assert built["machine's own methods"] == []
    # On a host without CUDA, NVRx's GPU checks are not in the chain run before a restart (0.4.1 has none).
    assert built["restart checks"] == [] and built["left out"] == built["NVRx's GPU checks"], built


_RENAME_ON_IMPORT = """
    import importlib.machinery, runpy, sys
    MODULE, OWNER, NAME, REPLACEMENT = {spec!r}

    class Rename:
        '''After MODULE is imported: OWNER.NAME removed (REPLACEMENT None), replaced by a function
        (REPLACEMENT "lambda ..."), or renamed to REPLACEMENT.'''
        def find_spec(self, name, path, target=None):
            if name != MODULE:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                owner = module
                for part in filter(None, OWNER.split(".")):
                    owner = getattr(owner, part)
                value = owner.__dict__[NAME]
                delattr(owner, NAME)
                if REPLACEMENT is None:
                    return
                if REPLACEMENT.startswith("lambda"):
                    setattr(owner, NAME, eval(REPLACEMENT))
                else:
                    setattr(owner, REPLACEMENT, value)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Rename())
    sys.argv = ["pretrain.py", *{argv!r}]
    runpy.run_path("pretrain.py", run_name="__main__")
"""
_LOCAL_TIER = ["--non-persistent-ckpt-type", "local", "--non-persistent-save-interval", "2"]


_OPTIMIZER = ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer",
              "_set_main_param_and_optimizer_states", "_set_main_param_and_optimizer_states_v2")
_NVRX_MANAGER = ("nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager",
                 "LocalCheckpointManager", "_local_ckpt_path_from_id", "_ckpt_path_from_id")


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "package", "said"), [
    pytest.param(_OPTIMIZER, "megatron-core",
                 "DistributedOptimizer has no attribute '_set_main_param_and_optimizer_states'",
                 id="megatron_core_method_renamed"),
    pytest.param(("megatron.core.parallel_state", "", "destroy_model_parallel", "lambda force: None"),
                 "megatron-core", "destroy_model_parallel takes (force), not ()",
                 id="megatron_core_signature"),
    pytest.param(("torch.distributed.checkpoint.filesystem", "", "_metadata_fn", None),
                 "torch", "filesystem has no attribute '_metadata_fn'", id="torch_private_name_removed"),
    pytest.param(_NVRX_MANAGER, "nvidia-resiliency-ext",
                 "LocalCheckpointManager has no attribute '_local_ckpt_path_from_id'",
                 id="nvrx_overridden_method_renamed_under_the_local_tier"),
])
def test_an_upstream_attribute_renamed_under_pretrain_stops_it_with_one_line_and_exit_2(
        tmp_path, spec, package, said):
    argv = [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", "4", "--save", str(tmp_path / "ckpt")]
    if package == "nvidia-resiliency-ext":
        argv += [*_LOCAL_TIER, "--non-persistent-local-ckpt-dir", str(tmp_path / "local")]
    result = _python(_RENAME_ON_IMPORT.format(spec=spec, argv=argv))

    version = importlib.metadata.version(package)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert _lines(result) == [next(line for line in _lines(result) if line.startswith("[resil] patch:"))], \
        _lines(result)
    (line,) = _lines(result)
    assert line.startswith(f"[resil] patch: {package} {version}: ") and said in line, line
    assert line.endswith("exiting with code 2")
    assert "Traceback" not in result.stdout + result.stderr
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").glob("iter_*"))  # nothing ran


def test_a_problem_upstream_no_longer_has_makes_its_patch_stand_down_with_one_line():
    """megatron-core without the dp_reshardable format (as a release that dropped it would be): its padding
    fix is not needed, which install() says once, and the start-up goes on."""
    result = _python("""
        import megatron_resil  # first, as in every entry point: the dependencies' import noise is filtered
        import megatron.core.optimizer.distrib_optimizer as d
        del d.DistributedOptimizer.sharded_param_state_dp_reshardable
        from megatron_resil import patches
        patches.install()
        print("installed")
    """)
    assert result.returncode == 0, result.stdout + result.stderr
    version = importlib.metadata.version("megatron-core")
    from megatron_resil.patches.registry import _source_on_disk

    router_compiles = "@torch.compile" in _source_on_disk("megatron.core.transformer.moe.router")  # 0.19
    # Imported before install(): the import hooks stand down too, each saying so.
    assert _lines(result) == [
        f"[resil] patch: megatron-core {version}: 'torch.compile deferred in megatron.core.jit' stood down: "
        "megatron.core.jit was imported before patches.install(); every process imports TorchInductor at "
        "start-up (about 2 s)",
        *([f"[resil] patch: megatron-core {version}: 'torch.compile deferred in megatron.core's MoE router' "
           "stood down: megatron.core.transformer.moe.router was imported before patches.install(); every "
           "process imports dynamo at start-up (about 0.5 s)"] if router_compiles else []),
        f"[resil] patch: megatron-core {version}: 'TensorBoard not imported by megatron.core.timers without "
        "--tensorboard-dir' stood down: megatron.core.timers was imported before patches.install(); every "
        "process imports TensorBoard at start-up (about 0.15 s)",
        f"[resil] patch: megatron-core {version}: 'W&B not imported by megatron-core without "
        "--wandb-project' stood down: megatron.core.timers was imported before patches.install(); every "
        "process imports wandb at start-up (about 0.5-1 s)",
        f"[resil] patch: megatron-core {version}: 'dp_reshardable padding saved as zeros' stood down: "
        "DistributedOptimizer has no sharded_param_state_dp_reshardable (no dp_reshardable format)",
        "installed"]


_OPTIMIZER_STEPS = """
    import sys
    import torch
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)  # add_param_group: torch's dynamo wrapper
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    print("dynamo imported:", "torch._dynamo" in sys.modules)
"""


def test_an_optimizer_built_and_stepped_imports_no_dynamo_until_something_else_does():
    """Without the patch, building an optimizer imports torch._dynamo (the control); with it, nothing
    does until dynamo is imported for its own sake, and from then on torch's own disabled method runs."""
    control = _python("import megatron_resil\n" + textwrap.dedent(_OPTIMIZER_STEPS))
    assert control.returncode == 0, control.stdout + control.stderr
    assert "dynamo imported: True" in control.stdout

    # This record alone: megatron-core 0.19 itself imports dynamo where an MoE router is decorated with
    # torch.compile at import, which installing every record (args None) imports for its checks.
    install = ("import megatron_resil\nfrom megatron_resil import patches\n"
               "patches.install(only=('optimizers skip importing dynamo until something does',))\n")
    after = textwrap.dedent("""
        import torch._dynamo  # as torch.compile would
        optimizer.load_state_dict(optimizer.state_dict())
        from megatron_resil.patches import torch_startup
        ours = [fn.__qualname__ for fn, _ in torch_startup.wrapped_by_disable_dynamo()
                if "_until_dynamo_is_imported" in getattr(fn, "__dynamo_disable").__qualname__]
        print("ours still cached on:", sorted(ours))
    """)
    patched = _python(install + textwrap.dedent(_OPTIMIZER_STEPS) + after)
    assert patched.returncode == 0, patched.stdout + patched.stderr
    assert "dynamo imported: False" in patched.stdout
    cached = patched.stdout.split("ours still cached on:")[1]
    # Called since dynamo came in: torch's own disabled function replaced ours on each.
    assert "Optimizer.state_dict'" not in cached and "Optimizer.load_state_dict'" not in cached, cached
    assert "Optimizer.add_param_group'" in cached  # not called since: still ours, harmless


def test_tensorboard_and_wandb_are_imported_only_by_runs_that_write_to_them():
    """Without --tensorboard-dir (--wandb-project) megatron-core's timers take their ImportError fallback and
    nothing imports TensorBoard (wandb, where it is installed); with it, the timers get the real
    SummaryWriter (wandb module) their write() checks against."""
    code = textwrap.dedent("""
        import sys
        import megatron_resil
        from megatron_resil import patches
        from megatron_resil.arguments import parse_args
        sys.argv = ["pretrain.py", *sys.argv[1:]]
        patches.install(parse_args())
        import megatron.core
        from megatron.core import timers
        print("imported:", "torch.utils.tensorboard" in sys.modules, "class:", timers.SummaryWriter)
        print("wandb:", "wandb" in sys.modules, timers.wandb is not None)
    """)
    tiny = [*launch.TINY_MODEL, "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
            "--mock-data"]
    wandb = importlib.util.find_spec("wandb") is not None
    for extra, imported in (([], False), (["--tensorboard-dir", "/nonexistent/tb", "--wandb-project", "p",
                                           "--save", "/nonexistent/ckpt"] if wandb else
                                          ["--tensorboard-dir", "/nonexistent/tb"], True)):
        result = subprocess.run([sys.executable, "-c", code, *tiny, *extra], env=launch.env(),
                                cwd=launch.REPO, timeout=180, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
        shown, wandb_shown = result.stdout.splitlines()[-2:]
        assert shown.startswith(f"imported: {imported} "), shown
        assert ("SummaryWriter'>" in shown) == imported, shown
        assert wandb_shown == f"wandb: {imported and wandb} {imported and wandb}", wandb_shown
