"""megatron-resil: Megatron-style GPT pretraining that survives failure."""

__version__ = "0.1.0"
