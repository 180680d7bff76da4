"""Megatron-LM's experimental attention variants: gated delta net (linear attention mixed with full
attention every --linear-attention-freq layers) and DeepSeek sparse attention (dsa). The rows go to
megatron-core's TransformerConfig as Megatron-LM passes them; model.py builds the layers with megatron-core's
own spec for them, as Megatron-LM's gpt_builder does.

Both run on GPU only: megatron-core builds these layers from Transformer Engine's modules alone, gated delta
net runs flash-linear-attention's Triton kernels (megatron-core will not build the layer without them), and
sparse attention's indexer rotates with fast-hadamard-transform's CUDA kernel. Where one is missing, the run
is refused with one line naming what is missing: a different attention would train a different model.
"""

from __future__ import annotations

import argparse
import importlib.metadata

from megatron_resil.arguments import layer_pattern
from megatron_resil.arguments.device import cuda_available, package_available
from megatron_resil.arguments.errors import ArgumentError
from megatron_resil.arguments.flag_table import Flag, add_flags, config_choices
from megatron_resil.arguments.model import transformer_engine_available

TC = "TransformerConfig"
VARIANTS = ("gdn", "gdn2", "dsa", "gated_delta_net")  # Megatron-LM's; gated_delta_net is gdn's old name
# megatron-core 0.16 and 0.17 declare dsa but their GPT block spec builds only gated delta net.
DSA_SINCE = (0, 18)
DSA_KERNEL_PACKAGES = {"tilelang": (("tilelang", "tilelang"),),
                       "cudnn": (("flash_mla", "flash-mla"), ("cudnn", "nvidia-cudnn-frontend"))}

# Megatron-LM's --linear-attention-freq: N (a full-attention layer every N layers, linear attention in the
# others) or a list expression of 1 (linear attention) and 0 (full attention) per layer.
linear_attention_freq = layer_pattern.argument_type("linear attention pattern")

FLAGS = (
    Flag("--experimental-attention-variant", None, str, choices=VARIANTS, to=TC,
         help="gated delta net (gdn; gated_delta_net is its old name) mixed with full attention, or DeepSeek "
              "sparse attention (dsa, with --multi-latent-attention); GPU only"),
    # gated delta net
    Flag("--linear-attention-freq", None, linear_attention_freq, to=TC,
         help="N: full attention every N-th layer, gated delta net in the others; or a list of 1 (gated "
              "delta net) and 0 (full attention) per layer, e.g. '([1]*3+[0]*1)*2'"),
    Flag("--linear-conv-kernel-dim", 4, int, "gated delta net's causal convolution width", to=TC),
    Flag("--linear-key-head-dim", 128, int, "gated delta net's query and key head size", to=TC),
    Flag("--linear-value-head-dim", 128, int, "gated delta net's value and gate head size", to=TC),
    Flag("--linear-num-key-heads", 16, int, "gated delta net's query and key heads", to=TC),
    Flag("--linear-num-value-heads", 32, int, "gated delta net's value and gate heads", to=TC),
    # DeepSeek sparse attention
    Flag("--dsa-indexer-n-heads", None, int, "heads of the sparse attention's indexer", to=TC),
    Flag("--dsa-indexer-head-dim", None, int, "head size of the sparse attention's indexer", to=TC),
    Flag("--dsa-indexer-topk", None, int, "tokens each query attends to (the indexer's top k)", to=TC),
    Flag("--dsa-indexer-topk-freq", 1, int, to=TC,
         help="compute the top k every N layers, the layers between reuse it"),
    Flag("--dsa-indexer-skip-topk-offset", 0, int, to=TC,
         help="layer offset of --dsa-indexer-topk-freq's sharing"),
    Flag("--dsa-indexer-loss-coeff", None, float, to=TC,
         help="weight of the indexer's KL-divergence loss (logged as indexer loss; 0 or none: no loss)"),
    Flag("--dsa-indexer-use-sparse-loss", to=TC, help="compute the indexer loss on the top-k tokens only"),
    Flag("--dsa-kernel-backend", "none", str, choices=("none", "tilelang", "cudnn"), to=TC,
         help="fused sparse attention kernels (none: megatron-core's PyTorch path)"),
    Flag("--dsa-indexer-rope-interleaved", to=TC, help="the indexer's rope interleaved, as multi-latent "
                                                       "attention's"),
    Flag("--no-dsa-indexer-rotate-activation", True, to=TC,
         help="no Hadamard rotation of the indexer's queries and keys before scoring"),
    Flag("--no-dsa-indexer-scoring-relu", True, to=TC, help="no ReLU on the indexer's scores"),
    Flag("--dsa-indexer-k-norm-epsilon", None, float, "epsilon of the indexer's key norm", to=TC),
    Flag("--dsa-indexer-k-norm-fp32", to=TC, help="the indexer's key norm in fp32"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "experimental attention variants", FLAGS)


def validate(args: argparse.Namespace, world_size: int) -> None:
    variant = args.experimental_attention_variant
    if variant is None:
        return
    known = config_choices(TC, "experimental_attention_variant")
    if variant == "gdn" and "gdn" not in known:
        args.experimental_attention_variant = "gated_delta_net"  # the same layer under its older name
    if args.experimental_attention_variant not in known:
        raise ArgumentError(f"--experimental-attention-variant {variant} needs a newer megatron-core "
                            f"(installed: {_core_release()}, which knows {', '.join(known) or 'none'})")
    if variant == "dsa" and _core_version() < DSA_SINCE:
        raise ArgumentError(f"--experimental-attention-variant dsa needs megatron-core "
                            f"{'.'.join(map(str, DSA_SINCE))} or later (installed: {_core_release()}, whose "
                            "GPT layer specs do not build sparse attention)")
    _require_gpu_kernels(args, variant)
    if variant == "dsa":
        _sparse_attention(args)
    else:
        _gated_delta_net(args, variant)


def _require_gpu_kernels(args: argparse.Namespace, variant: str) -> None:
    """CUDA, Transformer Engine (megatron-core's spec for these layers is Transformer Engine's only) and the
    variant's kernel packages, each found or named in the one refusal line."""
    missing = [] if cuda_available() else ["CUDA"]
    if not transformer_engine_available() and not package_available("transformer_engine"):
        missing.append("transformer-engine")
    if variant == "dsa":
        packages = [("fast_hadamard_transform", "fast-hadamard-transform")] \
            if args.dsa_indexer_rotate_activation else []
        packages += DSA_KERNEL_PACKAGES.get(args.dsa_kernel_backend, ())
        uses = "megatron-core builds it from Transformer Engine's layers, and its indexer's Hadamard " \
               "rotation is fast-hadamard-transform's CUDA kernel, built from source against the CUDA toolkit"
    else:
        packages = [("fla", "flash-linear-attention")]
        uses = "megatron-core builds it from Transformer Engine's layers and runs flash-linear-attention's " \
               "Triton kernels"
    missing += [name for module, name in packages if not package_available(module)]
    if missing:
        hint = [name for _, name in packages if name in missing]
        raise ArgumentError(f"--experimental-attention-variant {variant} runs on GPU only ({uses}); missing "
                            f"here: {', '.join(missing)}"
                            + (f" (pip install {' '.join(hint)})" if hint and "CUDA" not in missing else ""))
    if args.transformer_impl != "transformer_engine":
        raise ArgumentError(f"--experimental-attention-variant {variant} needs --transformer-impl "
                            "transformer_engine: megatron-core builds these layers from Transformer Engine's "
                            "modules only")


def _gated_delta_net(args: argparse.Namespace, variant: str) -> None:
    """Megatron-LM's and megatron-core's checks, before any work starts."""
    pattern = args.linear_attention_freq
    if pattern is None:  # megatron-core's GPT spec needs it (its hybrid models' gdn2 do not)
        raise ArgumentError(f"--experimental-attention-variant {variant} needs --linear-attention-freq (N: "
                            "full attention every N-th layer, gated delta net in the others)")
    if isinstance(pattern, list) and len(pattern) != args.num_layers:
        raise ArgumentError(f"--linear-attention-freq lists {len(pattern)} layers, not --num-layers "
                            f"{args.num_layers}")
    if isinstance(pattern, int) and pattern < 1:
        raise ArgumentError("--linear-attention-freq must be positive")
    if args.linear_num_value_heads % args.linear_num_key_heads:
        raise ArgumentError(f"--linear-num-value-heads {args.linear_num_value_heads} must be a multiple of "
                            f"--linear-num-key-heads {args.linear_num_key_heads}")
    split = args.tensor_model_parallel_size * args.context_parallel_size
    for flag in ("--linear-num-key-heads", "--linear-num-value-heads"):
        heads = getattr(args, flag[2:].replace("-", "_"))
        if heads % split:
            raise ArgumentError(f"{flag} {heads} must be a multiple of --tensor-model-parallel-size x "
                                f"--context-parallel-size ({split})")


def _sparse_attention(args: argparse.Namespace) -> None:
    if not args.multi_latent_attention:
        raise ArgumentError("--experimental-attention-variant dsa needs --multi-latent-attention "
                            "(megatron-core builds sparse attention on it)")
    for flag in ("--dsa-indexer-n-heads", "--dsa-indexer-head-dim", "--dsa-indexer-topk"):
        if getattr(args, flag[2:].replace("-", "_")) is None:
            raise ArgumentError(f"--experimental-attention-variant dsa needs {flag}")
    if args.add_bias_linear:
        raise ArgumentError("--experimental-attention-variant dsa needs --disable-bias-linear "
                            "(megatron-core's sparse attention has no biases)")
    if args.dsa_indexer_rotate_activation and not args.bf16:
        raise ArgumentError("--experimental-attention-variant dsa needs --bf16: the indexer's Hadamard "
                            "rotation takes bf16 only (or --no-dsa-indexer-rotate-activation)")
    if args.context_parallel_size > 1:
        raise ArgumentError("--experimental-attention-variant dsa does not run with --context-parallel-size "
                            "> 1 (megatron-core)")
    if args.apply_rope_fusion:
        raise ArgumentError("--experimental-attention-variant dsa needs --no-rope-fusion (megatron-core's "
                            "sparse attention has no fused rope)")
    if args.dsa_indexer_topk_freq < 1 or args.dsa_indexer_skip_topk_offset < 0:
        raise ArgumentError("--dsa-indexer-topk-freq must be positive and --dsa-indexer-skip-topk-offset not "
                            "negative")


def _core_release() -> str:
    return f"megatron-core {importlib.metadata.version('megatron-core')}"


def _core_version() -> tuple[int, ...]:
    parts = importlib.metadata.version("megatron-core").split(".")[:2]
    return tuple(int(part) for part in parts if part.isdigit())
