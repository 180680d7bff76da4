"""megatron-resil: Megatron-style GPT pretraining that survives failure."""

from megatron_resil import lazy_compile

__version__ = "0.1.0"

lazy_compile.install()
