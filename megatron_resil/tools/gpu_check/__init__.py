"""The GPU check (issue 25): `python -m megatron_resil.tools.gpu_check` (see __main__.py), run by
scripts/gpu_check.sh on the GPU machine and, as a dry run on CPU, by tests/test_gpu_check.py."""
