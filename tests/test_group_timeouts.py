"""--distributed-timeout-minutes reaches every process group megatron-core makes, as in Megatron-LM, not only
the default one. Left out, the data-parallel group waited 30 minutes whatever the flag said. So a survivor
blocked in a gradient reduction with a stopped peer waited until NVRx's hard timeout, and lived only when the
peer happened to be terminated first (tests/test_replica_recovery.py's stopped-rank test)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

try:
    from tests import launch  # tests/ is a package
except ImportError:  # pragma: no cover - tests/ on sys.path instead
    import launch

_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from megatron_resil import patches
    from megatron_resil.arguments import parse_args
    args = parse_args(sys.argv[1:], world_size=1)
    patches.install(args)
    from megatron.core import parallel_state
    from megatron_resil import parallel
    parallel.initialize(args)
    def minutes(group):
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds() / 60
    print(json.dumps({"default": minutes(torch.distributed.group.WORLD),
                      "data_parallel": minutes(parallel_state.get_data_parallel_group()),
                      "tensor_parallel": minutes(parallel_state.get_tensor_model_parallel_group())}))
""")


@pytest.mark.compat  # megatron-core's initialize_model_parallel on the users' version too
@pytest.mark.parametrize(("flag", "minutes"), [([], 10.0), (["--distributed-timeout-minutes", "2"], 2.0)])
def test_every_group_times_out_as_the_flag_says(flag, minutes):
    done = subprocess.run([sys.executable, "-c", _SCRIPT, *launch.TINY_MODEL, *launch.TINY_TRAINING,
                           "--train-iters", "4", *flag], env=launch.env(standby=False), cwd=launch.REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"default": minutes, "data_parallel": minutes, "tensor_parallel": minutes}, found
