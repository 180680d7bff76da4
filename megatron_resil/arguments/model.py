"""Model shape and numerics flags (Megatron-LM names and defaults): the network's size, attention
(multi-latent attention included), position embeddings, norms, activation recomputation, multi-token
prediction. Rows with `to` go to megatron-core's TransformerConfig as they are (model.py reads the rest).
"""

from __future__ import annotations

import argparse
import importlib.util

from megatron_resil.arguments import sizes
from megatron_resil.arguments.device import cuda_available
from megatron_resil.arguments.errors import ArgumentError
from megatron_resil.arguments.flag_table import Flag, add_flags, warn

TC = "TransformerConfig"
MLA = "MLATransformerConfig"
KERNEL = "only selects a GPU kernel (same results)"
RECOMPUTE = "only trades GPU memory for compute (same results)"
ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")

FLAGS = (
    # network size
    Flag("--num-layers", None, int),
    Flag("--hidden-size", None, int),
    Flag("--ffn-hidden-size", None, int, "default: 4 x hidden size (2/3 of that, to a multiple of 64, "
                                        "with --swiglu)"),
    Flag("--num-attention-heads", None, int),
    Flag("--kv-channels", None, int, "default: hidden size / attention heads"),
    Flag("--group-query-attention"),
    Flag("--num-query-groups", 1, int),
    Flag("--seq-length", None, int),
    Flag("--max-position-embeddings", None, int, "default: --seq-length"),
    Flag("--position-embedding-type", "learned_absolute", str, choices=("learned_absolute", "rope", "none")),
    Flag("--no-position-embedding", True, dest="add_position_embedding",
         help="deprecated in Megatron-LM (use --position-embedding-type); accepted with rope, where it "
              "changes nothing"),
    Flag("--rotary-percent", 1.0, float, "share of each head's dimensions rotary embeddings rotate"),
    Flag("--rotary-base", 10000, int, "base of the rotary embeddings' frequencies"),
    Flag("--rotary-interleaved", to=TC, help="rotate pairs of even and odd dimensions (RoFormer style)"),
    Flag("--rotary-seq-len-interpolation-factor", None, int,
         "sequence-length interpolation factor of the rotary embeddings"),
    Flag("--use-rope-scaling", help="Llama 3.x's rope frequency scaling"),
    Flag("--rope-scaling-factor", 8.0, float, "Llama 3.x's rope scaling factor (with --use-rope-scaling)"),
    Flag("--make-vocab-size-divisible-by", 128, int),
    Flag("--init-method-std", 0.02, float, to=TC),
    Flag("--hidden-dropout", 0.1, float, to=TC),
    Flag("--attention-dropout", 0.1, float, to=TC),
    Flag("--normalization", "LayerNorm", str, choices=("LayerNorm", "RMSNorm"), to=TC),
    Flag("--norm-epsilon", 1e-5, float, "epsilon of every LayerNorm/RMSNorm", dest="layernorm_epsilon",
         to=TC),
    Flag("--apply-layernorm-1p", dest="layernorm_zero_centered_gamma", to=TC,
         help="norms learn (1 + gamma) with gamma starting at 0 (zero-centered gamma)"),
    Flag("--qk-layernorm", to=TC, help="normalize queries and keys (--normalization's kind)"),
    Flag("--swiglu", help="gated linear units with SiLU instead of gelu"),
    Flag("--squared-relu", help="squared ReLU instead of gelu"),
    Flag("--untie-embeddings-and-output-weights"),
    Flag("--attention-softmax-in-fp32", to=TC, help="attention masking and softmax in fp32"),
    Flag("--apply-query-key-layer-scaling", to=TC,
         help="scale Q x K^T by 1 / layer number (also sets --attention-softmax-in-fp32)"),
    Flag("--attention-backend", "auto", str, choices=ATTENTION_BACKENDS,
         help="Transformer Engine's attention kernel (flash, fused, unfused), or megatron-core's own "
              "(local); auto lets Transformer Engine pick. With --transformer-impl local, megatron-core's "
              "attention runs whatever is chosen"),
    Flag("--deterministic-mode", to=TC,
         help="deterministic kernels and collectives: torch.use_deterministic_algorithms, and "
              "NCCL_ALGO, NVTE_ALLOW_NONDETERMINISTIC_ALGO and CUBLAS_WORKSPACE_CONFIG defaults"),
    Flag("--calculate-per-token-loss", to=TC,
         help="divide the loss by the global batch's non-padded tokens, not per microbatch"),
    Flag("--use-mcore-models", dest="deprecated_use_mcore_models",
         help="deprecated in Megatron-LM and ignored there: megatron-core models are the only ones"),
    Flag("--transformer-impl", None, str, choices=("local", "transformer_engine"),
         help="default: transformer_engine when CUDA and Transformer Engine are present, else local"),
    # Megatron-LM's fusion switches, each on unless turned off; model.fusions decides what a run gets.
    Flag("--no-masked-softmax-fusion", True, help="disable fusing query-key scaling, masking and softmax"),
    Flag("--no-bias-gelu-fusion", True, help="disable bias and gelu fusion"),
    Flag("--no-bias-swiglu-fusion", True, help="disable bias and swiglu fusion"),
    Flag("--no-bias-dropout-fusion", True, help="disable bias and dropout fusion"),
    Flag("--no-rope-fusion", True, dest="apply_rope_fusion", help="disable rope fusion"),
    Flag("--no-gradient-accumulation-fusion", True,
         help="disable fusing gradient accumulation into the weight-gradient GEMM of linear layers"),
    Flag("--no-persist-layer-norm", dest="no_persist_layer_norm",
         help="disable Apex's persistent fused layer norm kernel (GPU only)"),
    Flag("--cross-entropy-loss-fusion", to=TC, gpu=KERNEL, help="the fused cross-entropy kernel"),
    Flag("--cross-entropy-fusion-impl", "native", str, choices=("native", "te"), to=TC, gpu=KERNEL,
         help="which fused cross-entropy: megatron-core's (native) or Transformer Engine's (te)"),
    # multi-latent attention
    Flag("--multi-latent-attention", to=TC, help="DeepSeek's multi-latent attention"),
    Flag("--q-lora-rank", None, int, "rank of the queries' low-rank projection (None: no compression)",
         to=MLA),
    Flag("--kv-lora-rank", 32, int, "rank of the keys' and values' low-rank projection", to=MLA),
    Flag("--qk-head-dim", 128, int, "head dimension of Q x K without the rotary part", to=MLA),
    Flag("--qk-pos-emb-head-dim", 64, int, "head dimension of the rotary part of Q and K", to=MLA),
    Flag("--v-head-dim", 128, int, "head dimension of V", to=MLA),
    Flag("--rotary-scaling-factor", 1.0, float, "YaRN rotary scaling factor (multi-latent attention)",
         to=MLA),
    Flag("--mscale", 1.0, float, "YaRN mscale (multi-latent attention)", to=MLA),
    Flag("--mscale-all-dim", 0.0, float, "YaRN mscale over all dimensions (multi-latent attention)", to=MLA),
    # activation recomputation
    Flag("--recompute-activations",
         help="selective recomputation (the same as --recompute-granularity selective)"),
    Flag("--recompute-granularity", None, str, choices=("full", "selective"), to=TC,
         help="full: recompute whole layers (--recompute-method, --recompute-num-layers); selective: "
              "recompute --recompute-modules"),
    Flag("--recompute-method", None, str, choices=("uniform", "block"), to=TC),
    Flag("--recompute-num-layers", None, int, to=TC),
    Flag("--recompute-modules", None, str, nargs="+", to=TC,
         help="submodules selective recomputation recomputes (default: core_attn)"),
    # multi-token prediction
    Flag("--mtp-num-layers", None, int, "multi-token prediction layers (DeepSeek-V3 style)", to=TC),
    Flag("--mtp-loss-scaling-factor", 0.1, float, "weight of the multi-token prediction loss", to=TC),
    Flag("--attention-output-gate", to=TC, help="a sigmoid gate on the attention output"),
    # MuP (Maximal Update Parameterization), megatron-core 0.19's: its TransformerConfig scales the
    # initialization, the attention and the logits; optimizer.py scales the learning rates and Adam's epsilon.
    Flag("--use-mup", to=TC, help="MuP: initialization, attention, logits, learning rates and Adam's epsilon "
                                  "scaled by the width multiplier (hidden size / --mup-base-hidden-size)"),
    Flag("--mup-base-hidden-size", None, int, "MuP's base width (default: --hidden-size, multiplier 1)",
         to=TC),
    Flag("--mup-width-mult", 1.0, float, "replaced by hidden size / --mup-base-hidden-size under --use-mup "
                                         "(as in Megatron-LM)", to=TC),
    Flag("--mup-embedding-mult", 1.0, float, "MuP: multiplier of the embeddings' output", to=TC),
    Flag("--mup-output-mult", 1.0, float, "MuP: multiplier of the logits (1.0: 1 / width multiplier)", to=TC),
    Flag("--mup-base-head-dim", None, float, "MuP: attention scale sqrt(this) / kv-channels ** "
         "--mup-attn-scale-power (default: 1 / kv-channels ** power)", to=TC),
    Flag("--mup-attn-scale-power", 1.0, float, "MuP: power of kv-channels in the attention scale (0.5: "
                                               "standard)", to=TC),
)
MUP_FLAGS = ("--mup-base-hidden-size", "--mup-width-mult", "--mup-embedding-mult", "--mup-output-mult",
             "--mup-base-head-dim", "--mup-attn-scale-power")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "model", FLAGS)


def transformer_engine_available() -> bool:
    return cuda_available() and importlib.util.find_spec("transformer_engine") is not None


def validate(args: argparse.Namespace, world_size: int) -> None:
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        if getattr(args, flag) is None:
            raise ArgumentError(f"--{flag.replace('_', '-')} is required")
    sizes.check(args, sizes.MODEL)  # before any of them divides another or sizes a default
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute" and args.seq_length > args.max_position_embeddings:
        raise ArgumentError(
            f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
            f"{args.max_position_embeddings}; raise --max-position-embeddings")
    if not args.add_position_embedding and args.position_embedding_type != "rope":
        raise ArgumentError("--no-position-embedding is deprecated; use --position-embedding-type "
                            "(accepted with rope only, as in Megatron-LM)")
    if args.swiglu and args.squared_relu:
        raise ArgumentError("--swiglu and --squared-relu are two activations; pick one")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = sizes.default_ffn_hidden_size(args.hidden_size, args.swiglu)
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
    if not 0.0 < args.rotary_percent <= 1.0:
        raise ArgumentError(f"--rotary-percent {args.rotary_percent} must be in (0, 1]")
    if args.apply_query_key_layer_scaling:
        args.attention_softmax_in_fp32 = True  # as Megatron-LM: the scaling implies it
    if args.position_embedding_type != "rope":
        args.apply_rope_fusion = False
    if args.transformer_impl is None:
        args.transformer_impl = "transformer_engine" if transformer_engine_available() else "local"
    elif args.transformer_impl == "transformer_engine" and not transformer_engine_available():
        raise ArgumentError(
            "--transformer-impl transformer_engine needs CUDA and the transformer-engine package "
            "(pip install -e .[gpu]); use --transformer-impl local on CPU")
    if args.multi_latent_attention and args.transformer_impl != "transformer_engine":
        # MLA hands its attention separate key and value head sizes, which megatron-core's own attention
        # (the local layers) does not take: it runs in Transformer Engine's only.
        raise ArgumentError("--multi-latent-attention needs --transformer-impl transformer_engine (GPU): "
                            "megatron-core's local attention cannot run it")
    _validate_attention_backend(args)
    _validate_recompute(args)
    _validate_mup(args)
    if args.deterministic_mode and args.cross_entropy_loss_fusion:
        raise ArgumentError("--deterministic-mode needs --cross-entropy-loss-fusion off (as in Megatron-LM)")
    if args.cross_entropy_loss_fusion and args.cross_entropy_fusion_impl == "te":
        raise ArgumentError("--cross-entropy-fusion-impl te: Megatron-LM disabled Transformer Engine's fused "
                            "cross entropy (stability); use native")
    if args.mtp_num_layers is not None and args.position_embedding_type not in ("rope", "none"):
        raise ArgumentError(f"--mtp-num-layers needs --position-embedding-type rope or none, not "
                            f"{args.position_embedding_type} (as in Megatron-LM)")


def _validate_mup(args: argparse.Namespace) -> None:
    if args.mup_base_hidden_size is not None and args.mup_base_hidden_size <= 0:
        raise ArgumentError("--mup-base-hidden-size must be positive")
    if not args.use_mup:
        given = [flag for flag in FLAGS if flag.name in MUP_FLAGS and flag.is_set(args)]
        if given:
            warn(f"{', '.join(flag.name for flag in given)} changes nothing without --use-mup (as in "
                 "Megatron-LM)")


def _validate_attention_backend(args: argparse.Namespace) -> None:
    """Megatron-LM: `local` only with the local layers; otherwise the backend picks Transformer Engine's
    kernel, which the local layers (megatron-core's own attention) do not have."""
    if args.attention_backend == "local" and args.transformer_impl != "local":
        raise ArgumentError("--attention-backend local needs --transformer-impl local (as in Megatron-LM)")
    if args.transformer_impl == "local" and args.attention_backend not in ("auto", "local"):
        warn(f"--attention-backend {args.attention_backend} picks a Transformer Engine kernel; "
             "--transformer-impl local runs megatron-core's own attention (same results)")


def _validate_recompute(args: argparse.Namespace) -> None:
    """Refuses what megatron-core's TransformerConfig and Megatron-LM refuse; without a granularity, the
    method and layer count change nothing (as in Megatron-LM)."""
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    if args.recompute_granularity == "selective":
        for flag in ("--recompute-method", "--recompute-num-layers"):
            if getattr(args, flag[2:].replace("-", "_")) is not None:
                raise ArgumentError(f"{flag} applies to --recompute-granularity full only, not selective")
    if args.recompute_granularity == "full" and (args.recompute_method is None or
                                                 args.recompute_num_layers is None):
        raise ArgumentError("--recompute-granularity full needs --recompute-method and "
                            "--recompute-num-layers")
    if args.recompute_granularity is not None and not cuda_available():
        # megatron-core's recomputation saves and restores the CUDA RNG state around each recomputed part.
        warn(f"--recompute-granularity {args.recompute_granularity} {RECOMPUTE}; ignored without CUDA")
        args.recompute_granularity = args.recompute_method = args.recompute_num_layers = None
