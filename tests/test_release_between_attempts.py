"""Between in-process attempts a failed attempt's engine must go, and its process groups with it: on gloo,
which has no abort, only a group no longer referenced closes its connections, and that is what releases a
peer blocked in a collective with this rank (megatron_resil/parallel.py, release_process_groups)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

try:
    from tests import launch  # tests/ is a package
except ImportError:  # pragma: no cover - tests/ on sys.path instead
    import launch

# One process builds the engine as a rank does (pretrain.py's patches, the groups, DDP and the
# distributed optimizer with two instances' groups), drops its own references as a failed attempt's frames
# are cleared, and asks whether anything still holds the DDP chunk.
_SCRIPT = textwrap.dedent("""
    import gc, sys, weakref
    from megatron_resil.arguments import parse_args
    from megatron_resil import patches
    args = parse_args(sys.argv[1:])
    patches.install(args)
    from megatron_resil import parallel, training
    parallel.initialize(args)
    model, optimizer, scheduler = training.build_engine(args, 128)
    chunk = weakref.ref(model[0])
    layers = weakref.ref(model[0].module)
    del model, optimizer, scheduler
    gc.collect()
    print("kept before the release:", chunk() is not None)
    parallel.release_process_groups()
    print("kept after the release:", chunk() is not None)
    print("layers kept after the release:", layers() is not None)
""")


def test_a_failed_attempts_engine_is_let_go_with_its_process_groups():
    flags = [*launch.TINY_MODEL, "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
             "--mock-data", "--use-distributed-optimizer"]
    env = {k: v for k, v in launch.env(standby=False).items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, *flags], cwd=launch.REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # Under the distributed optimizer, the engine outlived its attempt while the config its layers share
    # held DDP's and the optimizer's bound methods.
    assert "kept before the release: True" in done.stdout, done.stdout
    assert "kept after the release: False" in done.stdout, done.stdout
    assert "layers kept after the release: False" in done.stdout, done.stdout
