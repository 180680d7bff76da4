"""Model shape and numerics flags (Megatron-LM names and defaults)."""

from __future__ import annotations

import argparse
import importlib.util

from megatron_resil.arguments.device import cuda_available
from megatron_resil.arguments.errors import ArgumentError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden size")
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"],
                   default="learned_absolute")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default=None,
                   help="default: transformer_engine when CUDA and Transformer Engine are present, "
                        "else local")
    for flag, dest, what in _FUSION_SWITCHES:
        g.add_argument(flag, action="store_false", dest=dest, help=f"disable {what} (a GPU fusion)")
    g.add_argument("--no-persist-layer-norm", action="store_true",
                   help="disable Apex's persistent fused layer norm kernel (GPU only)")


# Megatron-LM's fusion switches, each on unless turned off; model.fusions decides what a run gets.
_FUSION_SWITCHES = (
    ("--no-masked-softmax-fusion", "masked_softmax_fusion", "fusing query-key scaling, masking and softmax"),
    ("--no-bias-gelu-fusion", "bias_gelu_fusion", "bias and gelu fusion"),
    ("--no-bias-swiglu-fusion", "bias_swiglu_fusion", "bias and swiglu fusion"),
    ("--no-bias-dropout-fusion", "bias_dropout_fusion", "bias and dropout fusion"),
    ("--no-rope-fusion", "apply_rope_fusion", "rope fusion"),
    ("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion",
     "fusing gradient accumulation into the weight-gradient computation of linear layers"),
)


def transformer_engine_available() -> bool:
    return cuda_available() and importlib.util.find_spec("transformer_engine") is not None


def validate(args: argparse.Namespace, world_size: int) -> None:
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        if getattr(args, flag) is None:
            raise ArgumentError(f"--{flag.replace('_', '-')} is required")
        if getattr(args, flag) <= 0:
            raise ArgumentError(f"--{flag.replace('_', '-')} must be positive")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute" and args.seq_length > args.max_position_embeddings:
        raise ArgumentError(
            f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
            f"{args.max_position_embeddings}; raise --max-position-embeddings")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.kv_channels is None:
        if args.hidden_size % args.num_attention_heads:
            raise ArgumentError(
                f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                f"{args.num_attention_heads}; set --kv-channels or change one of them")
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    elif args.num_attention_heads % args.num_query_groups:
        raise ArgumentError("--num-attention-heads must be divisible by --num-query-groups")
    for flag in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(args, flag) < 1.0:
            raise ArgumentError(f"--{flag.replace('_', '-')} must be in [0, 1)")
    if args.transformer_impl is None:
        args.transformer_impl = "transformer_engine" if transformer_engine_available() else "local"
    elif args.transformer_impl == "transformer_engine" and not transformer_engine_available():
        raise ArgumentError(
            "--transformer-impl transformer_engine needs CUDA and the transformer-engine package "
            "(pip install -e .[gpu]); use --transformer-impl local on CPU")
