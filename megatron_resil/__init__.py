"""megatron-resil: Megatron-style GPT pretraining that survives failure."""

from megatron_resil import quiet_imports

__version__ = "0.1.0"

quiet_imports.install()  # first: every entry point imports this package before torch and megatron-core
