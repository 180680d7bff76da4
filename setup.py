"""megatron-resil: Megatron-style GPT pretraining that survives failure."""

from setuptools import find_packages, setup

setup(
    name="megatron-resil",
    version="0.1.0",
    description="Megatron-LM-compatible GPT pretraining with crash-safe, verified checkpoints",
    packages=find_packages(include=["megatron_resil", "megatron_resil.*"]),
    py_modules=["pretrain"],
    python_requires=">=3.10",
    # Ranges, never pins: we install into the user's stack (an NGC container's own torch build, with
    # Transformer Engine compiled against it) without replacing anything in it. torch has a lower bound
    # only, so an installed build of any later version, pre-releases included, is kept. The upper bounds
    # are the newest releases tested (see README, "Support matrix"); scripts/constraints.txt pins what CI
    # runs. On a CPU machine without torch, install torch first (scripts/setup_env.sh does): a plain
    # requirement would pull the multi-GB CUDA build.
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16.1,<0.20",  # 0.17 and later publish wheels for Python 3.12 and newer only
        "nvidia-resiliency-ext>=0.4.1,<0.8",
        "tensorstore>=0.1.60,!=0.1.72",
        "isal>=1.6",  # manifest and local-tier CRC-32 (ISA-L: zlib's values, ~6x faster here)
        "google-crc32c>=1.5",  # older manifests' CRC32C; zarr chunks
        "numpy",
        "packaging>=24.2",
        "matplotlib>=3.7",  # tools/timeline.py draws the run timeline
        "einops>=0.8",  # megatron-core builds --num-distributed-optimizer-instances' groups with it
    ],
    extras_require={
        "gpu": ["transformer-engine[pytorch]"],
        "tensorboard": ["tensorboard"],
        # --optimizer muon: megatron-core's Muon (0.19 and later) needs it; it publishes for Python 3.12 and
        # later only, so on 3.10 and 3.11 the extra installs nothing and --optimizer muon is refused.
        "muon": ["emerging-optimizers>=0.2,<0.4; python_version >= '3.12'"],
        # GPT2BPETokenizer (--vocab-file, --merge-file); SentencePieceTokenizer (--tokenizer-model);
        # HuggingFaceTokenizer (megatron-core's runs transformers' AutoTokenizer); TikTokenizer
        "tokenizers": ["tokenizers>=0.20", "sentencepiece>=0.2", "transformers>=4.45", "tiktoken>=0.7"],
        "wandb": ["wandb"],  # --wandb-project (Megatron-LM's training extra installs it)
        # tools/preprocess_data --split-sentences: NLTK's punkt (3.9 and later read punkt_tab, no pickles)
        "preprocess": ["nltk>=3.9"],
        "test": ["pytest>=8", "pytest-xdist>=3.5", "tensorboard", "ruff", "fusepy>=3.0.1",
                 "tokenizers>=0.20", "sentencepiece>=0.2", "transformers>=4.45", "tiktoken>=0.7", "wandb",
                 "nltk>=3.9"],
    },
)
