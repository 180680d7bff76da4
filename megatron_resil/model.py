"""Builds megatron-core's GPTModel from the command line: its TransformerConfig, the layer spec (dense or
MoE, megatron-core's local modules or Transformer Engine's, or an experimental attention variant's), and one
model chunk per pipeline stage this rank holds (several with virtual pipeline stages), each cast for
--bf16/--fp16 as Megatron-LM does.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import package_info, parallel_state
from megatron.core.activations import squared_relu
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
    get_transformer_block_with_experimental_attention_variant_spec,
)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.module import Float16Module, MegatronModule
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlockSubmodules
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import MLATransformerConfig

from megatron_resil import exit_codes, parallel
from megatron_resil.arguments import FLAGS
from megatron_resil.arguments.flag_table import config_fields, config_kwargs
from megatron_resil.arguments.model import transformer_engine_available


class LocalNorm:
    """LayerNorm or RMSNorm for the local spec, from torch, with sequence parallelism and Megatron-LM's
    --apply-layernorm-1p (zero-centered gamma).

    megatron-core's torch-backed norm (WrappedTorchNorm, used without Apex) refuses both. Under sequence
    parallelism each tensor-parallel rank normalises a slice of the sequence, so the norm's weights get
    partial gradients that must be summed across the tensor-parallel group; marking them
    `sequence_parallel` is what makes megatron-core's finalize_model_grads do that, as Apex's
    FusedLayerNorm does."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        rms = config.normalization == "RMSNorm"
        if config.layernorm_zero_centered_gamma:
            norm = ZeroCenteredNorm(hidden_size, eps, rms)
        else:
            norm = (torch.nn.RMSNorm if rms else torch.nn.LayerNorm)(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


class ZeroCenteredNorm(torch.nn.Module):
    """A norm that learns gamma - 1 (starting at 0) and scales by 1 + gamma, as Apex's and Transformer
    Engine's zero-centered-gamma norms do: the same parameter names and values as theirs."""

    def __init__(self, hidden_size: int, eps: float, rms: bool) -> None:
        super().__init__()
        self.shape, self.eps, self.rms = (hidden_size,), eps, rms
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
        self.bias = None if rms else torch.nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:
            return F.rms_norm(x, self.shape, self.weight + 1, self.eps)
        return F.layer_norm(x, self.shape, self.weight + 1, self.bias, self.eps)


def padded_vocab_size(vocab_size: int, args: argparse.Namespace) -> int:
    """Megatron pads the vocabulary to a multiple of make-vocab-size-divisible-by x TP size."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


def params_dtype(args: argparse.Namespace) -> torch.dtype:
    if args.bf16:
        return torch.bfloat16
    return torch.float16 if args.fp16 else torch.float32


@dataclass(frozen=True)
class FusedKernels:
    """Which optional fused kernels can be imported here."""
    gradient_accumulation: bool  # Apex's fused_weight_gradient_mlp_cuda (megatron-core's linear layers)
    masked_softmax: bool  # the scaled (upper-triangular) masked softmax kernels (Apex, Megatron-LM's build)
    transformer_engine: bool  # the fused rotary embedding

    @classmethod
    def installed(cls) -> FusedKernels:
        def importable(*names: str) -> bool:
            return all(importlib.util.find_spec(name) is not None for name in names)
        return cls(importable("fused_weight_gradient_mlp_cuda"),
                   importable("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda"),
                   transformer_engine_available())


def fusions(args: argparse.Namespace, cuda: bool, kernels: FusedKernels) -> dict[str, bool]:
    """TransformerConfig's fusion switches. On CPU all off: the fused paths are CUDA kernels, and the unfused
    ones compute the same model. On GPU, Megatron-LM's choices (each on unless its --no-*-fusion flag is
    given), except that a fusion whose kernel is not installed stays off instead of failing at its first use:
    megatron-core raises for gradient accumulation fusion without Apex's kernel, the masked softmax import
    fails inside the first attention, and rope fusion needs Transformer Engine."""
    if not cuda:
        return dict.fromkeys(("gradient_accumulation_fusion", "bias_activation_fusion", "bias_dropout_fusion",
                              "masked_softmax_fusion", "persist_layer_norm", "apply_rope_fusion"), False)
    # As Megatron-LM: swiglu's switch for swiglu, gelu's otherwise, and no gelu fusion without a bias.
    bias_activation = args.bias_swiglu_fusion if args.swiglu else \
        args.bias_gelu_fusion and args.add_bias_linear and not args.squared_relu
    return {
        "gradient_accumulation_fusion": args.gradient_accumulation_fusion and kernels.gradient_accumulation,
        "bias_activation_fusion": bias_activation,
        "bias_dropout_fusion": args.bias_dropout_fusion,
        "masked_softmax_fusion": args.masked_softmax_fusion and kernels.masked_softmax,
        "persist_layer_norm": not args.no_persist_layer_norm,
        "apply_rope_fusion": args.apply_rope_fusion and args.position_embedding_type == "rope"
        and kernels.transformer_engine,
    }


def cuda_graph_kwargs(args: argparse.Namespace) -> dict:
    """What the per-layer graphs capture, under the name the installed megatron-core gives it
    (cuda_graph_modules from 0.19; cuda_graph_scope before). Empty: the whole layer (0.16's own default,
    "full", is deprecated by itself, with a warning on every rank)."""
    field = "cuda_graph_modules" if "cuda_graph_modules" in config_fields("TransformerConfig") \
        else "cuda_graph_scope"
    return {field: list(args.cuda_graph_modules)}


def transformer_config(args: argparse.Namespace) -> TransformerConfig:
    """megatron-core's config: every table row that goes to it (arguments/*.py, `to=`), as Megatron-LM's
    core_transformer_config_from_args passes them, plus what is computed from several flags."""
    config_class = MLATransformerConfig if args.multi_latent_attention else TransformerConfig
    kwargs = config_kwargs(args, FLAGS, "TransformerConfig")
    if args.multi_latent_attention:
        kwargs.update(config_kwargs(args, FLAGS, "MLATransformerConfig"),
                      rotary_base=args.rotary_base, rotary_percent=args.rotary_percent)
    if args.num_experts is None:
        kwargs.update(moe_aux_loss_coeff=0.0)
    kwargs.update(cuda_graph_kwargs(args))
    if "fp8_param" in config_fields("TransformerConfig"):
        kwargs["fp8_param"] = args.fp8_param_gather
    kwargs.update(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else squared_relu if args.squared_relu else F.gelu,
        attention_backend=AttnBackend[args.attention_backend],
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        params_dtype=params_dtype(args),
        pipeline_dtype=params_dtype(args),
        # As Megatron-LM: batched p2p unless the interleaved schedule overlaps it. (Two batched sends to the
        # same peer get crossed under the interleaved schedule at PP=2, Megatron-LM #750: refused there.)
        batch_p2p_comm=not args.overlap_p2p_comm,
        use_cpu_initialization=args.use_cpu_initialization,
        # As Megatron-LM passes it: torch FSDP2 shards megatron-core's own linear layers separately only
        # under Transformer Engine (inside a local layer they are already sharded with it).
        transformer_impl=args.transformer_impl,
        **fusions(args, torch.cuda.is_available(), FusedKernels.installed()),
    )
    try:
        return config_class(**kwargs)
    except (ValueError, AssertionError) as err:  # megatron-core's own checks of the flags' values
        # Every rank builds the same config from the same flags, so every rank stops here alike.
        if parallel.rank() == 0:
            said = str(err).rstrip(".") or type(err).__name__
            sys.stderr.write(f"pretrain.py: error: megatron-core {package_info.__version__} refuses this "
                             f"model configuration: {said}; change the flags it names\n")
        raise SystemExit(exit_codes.BAD_ARGUMENTS) from None


_TORCH_NORMS = (WrappedTorchNorm,)


def _with_local_norms(spec) -> None:
    """Swap megatron-core's torch norm for LocalNorm wherever the local spec puts one (layers, their query
    and key norms, multi-token prediction layers); in place, on a spec just built for this model."""
    subs = spec.submodules
    for name in ("input_layernorm", "pre_mlp_layernorm", "enorm", "hnorm", "layer_norm"):
        if getattr(subs, name, None) in _TORCH_NORMS:
            setattr(subs, name, LocalNorm)
    attention = getattr(getattr(subs, "self_attention", None), "submodules", None)
    for name in ("q_layernorm", "k_layernorm", "kv_layernorm"):
        if getattr(attention, name, None) in _TORCH_NORMS:
            setattr(attention, name, LocalNorm)
    if hasattr(subs, "transformer_layer") and hasattr(subs.transformer_layer, "submodules"):
        _with_local_norms(subs.transformer_layer)


def block_spec(args: argparse.Namespace, config: TransformerConfig,
               vp_stage: int | None) -> TransformerBlockSubmodules:
    """This stage's layers as Megatron-LM builds them (dense, MoE, or as --moe-layer-freq mixes them; with
    --qk-layernorm and --multi-latent-attention), from megatron-core's local modules or Transformer
    Engine's. An experimental attention variant (gated delta net at --linear-attention-freq, or sparse
    attention) comes, as in Megatron-LM's gpt_builder, from megatron-core's spec for it (Transformer
    Engine's modules only: arguments/attention_variants.py checks they are here)."""
    if args.experimental_attention_variant is not None:
        return get_transformer_block_with_experimental_attention_variant_spec(config=config,
                                                                              vp_stage=vp_stage)
    use_te = args.transformer_impl == "transformer_engine"
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization=args.normalization,
                                      vp_stage=vp_stage)
    if not use_te:
        for layer in spec.layer_specs:
            _with_local_norms(layer)
        spec.layer_norm = LocalNorm
    return spec


def mtp_block_spec(args: argparse.Namespace, config: TransformerConfig, spec: TransformerBlockSubmodules,
                   vp_stage: int | None) -> MultiTokenPredictionBlockSubmodules | None:
    if args.mtp_num_layers is None:
        return None
    use_te = args.transformer_impl == "transformer_engine"
    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=use_te, vp_stage=vp_stage)
    if mtp is not None and not use_te:
        for layer in mtp.layer_specs:
            _with_local_norms(layer)
    return mtp


def build_model_chunks(args: argparse.Namespace, vocab_size: int) -> list[MegatronModule]:
    """This rank's model chunks: one per virtual pipeline stage it holds (one without virtual stages)."""
    config = transformer_config(args)
    virtual_stages = args.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(virtual_stages or 1):
        stage = vp_stage if virtual_stages else None
        spec = block_spec(args, config, stage)
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            mtp_block_spec=mtp_block_spec(args, config, spec, stage),
            vocab_size=padded_vocab_size(vocab_size, args),
            max_sequence_length=args.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_percent=args.rotary_percent,
            rotary_base=args.rotary_base,
            rope_scaling=args.use_rope_scaling,
            rope_scaling_factor=args.rope_scaling_factor,
            seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
            vp_stage=stage,
        )
        if torch.cuda.is_available():
            chunk.cuda(torch.cuda.current_device())
        if args.bf16 or args.fp16:
            # As in Megatron-LM: casts inputs to 16 bits and the loss back to fp32.
            chunk = Float16Module(config, chunk)
        chunks.append(chunk)
    return chunks
