"""Builds megatron-core's GPTModel from the command line: its TransformerConfig, the layer spec (dense or
MoE, megatron-core's local modules or Transformer Engine's), and one model chunk per pipeline stage this
rank holds (several with virtual pipeline stages), each cast for --bf16/--fp16 as Megatron-LM does.
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module, MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from megatron_resil.arguments.model import transformer_engine_available


class LocalNorm:
    """LayerNorm or RMSNorm for the local spec, from torch, with sequence parallelism.

    megatron-core's torch-backed norm (WrappedTorchNorm, used without Apex) refuses
    `sequence_parallel`. Under sequence parallelism each tensor-parallel rank normalises a slice of
    the sequence, so the norm's weights get partial gradients that must be summed across the
    tensor-parallel group; marking them `sequence_parallel` is what makes megatron-core's
    finalize_model_grads do that, as Apex's FusedLayerNorm does."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        norm_class = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_class(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


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
        args.bias_gelu_fusion and not args.disable_bias_linear
    return {
        "gradient_accumulation_fusion": args.gradient_accumulation_fusion and kernels.gradient_accumulation,
        "bias_activation_fusion": bias_activation,
        "bias_dropout_fusion": args.bias_dropout_fusion,
        "masked_softmax_fusion": args.masked_softmax_fusion and kernels.masked_softmax,
        "persist_layer_norm": not args.no_persist_layer_norm,
        "apply_rope_fusion": args.apply_rope_fusion and args.position_embedding_type == "rope"
        and kernels.transformer_engine,
    }


def transformer_config(args: argparse.Namespace) -> TransformerConfig:
    moe = args.num_experts is not None
    return TransformerConfig(
        # megatron-core 0.16's default ("full") is deprecated by itself, with a warning on every rank;
        # the empty list it converts that to means the same (no CUDA graphs are captured here).
        cuda_graph_scope=[],
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        normalization=args.normalization,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=not args.disable_bias_linear,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        expert_model_parallel_size=args.expert_model_parallel_size,
        num_moe_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff if moe else 0.0,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_grouped_gemm=args.moe_grouped_gemm,
        fp16=args.fp16,
        bf16=args.bf16,
        params_dtype=params_dtype(args),
        pipeline_dtype=params_dtype(args),
        # Two sends to the same peer in one batched p2p call get crossed under the interleaved schedule
        # with two pipeline ranks (Megatron-LM #750): separate calls keep them in order.
        batch_p2p_comm=args.virtual_pipeline_model_parallel_size is None,
        use_cpu_initialization=args.use_cpu_initialization,
        **fusions(args, torch.cuda.is_available(), FusedKernels.installed()),
    )


def layer_spec(args: argparse.Namespace) -> ModuleSpec:
    if args.transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(args.num_experts, args.moe_grouped_gemm)
    spec = get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm, normalization=args.normalization)
    spec.submodules.input_layernorm = LocalNorm
    spec.submodules.pre_mlp_layernorm = LocalNorm
    return spec


def _block_spec(args: argparse.Namespace, config: TransformerConfig, vp_stage: int | None):
    spec = layer_spec(args)
    if args.transformer_impl == "transformer_engine":
        return spec  # megatron-core picks TE's final norm itself
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=LocalNorm)


def build_model_chunks(args: argparse.Namespace, vocab_size: int) -> list[MegatronModule]:
    """This rank's model chunks: one per virtual pipeline stage it holds (one without virtual stages)."""
    config = transformer_config(args)
    virtual_stages = args.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(virtual_stages or 1):
        stage = vp_stage if virtual_stages else None
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=_block_spec(args, config, stage),
            vocab_size=padded_vocab_size(vocab_size, args),
            max_sequence_length=args.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            vp_stage=stage,
        )
        if torch.cuda.is_available():
            chunk.cuda(torch.cuda.current_device())
        if args.bf16 or args.fp16:
            # As in Megatron-LM: casts inputs to 16 bits and the loss back to fp32.
            chunk = Float16Module(config, chunk)
        chunks.append(chunk)
    return chunks
