"""megatron-resil: Megatron-style GPT pretraining that survives failure."""

from setuptools import find_packages, setup

setup(
    name="megatron-resil",
    version="0.1.0",
    description="Megatron-LM-compatible GPT pretraining with crash-safe, verified checkpoints",
    packages=find_packages(include=["megatron_resil", "megatron_resil.*"]),
    py_modules=["pretrain"],
    python_requires=">=3.10",
    install_requires=[
        # Pinned to the build we test. On a CPU machine install it first from the CPU wheel
        # (scripts/setup_env.sh does): an unpinned torch pulls the multi-GB CUDA build.
        "torch==2.13.0",
        "megatron-core==0.16.1",
        "nvidia-resiliency-ext==0.4.1",
        "tensorstore>=0.1.60,!=0.1.72",
        "isal>=1.6",  # manifest and local-tier CRC-32 (ISA-L: zlib's values, ~6x faster here)
        "google-crc32c>=1.5",  # older manifests' CRC32C; zarr chunks
        "numpy",
        "packaging>=24.2",
        "matplotlib>=3.7",  # tools/timeline.py draws the run timeline
    ],
    extras_require={
        "gpu": ["transformer-engine[pytorch]"],
        "tensorboard": ["tensorboard"],
        "test": ["pytest>=8", "pytest-xdist>=3.5", "tensorboard", "ruff", "fusepy>=3.0.1"],
    },
)
