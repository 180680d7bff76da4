"""Builds megatron-core's GPTModel from the command line: config, layer spec, padded vocabulary.

On CPU the layer spec's core attention is swapped for `SDPACoreAttention`, because megatron-core's
DotProductAttention takes its scratch buffer from a CUDA-only global memory buffer.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module, MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec


class SDPACoreAttention(MegatronModule):
    """Causal core attention on torch's scaled_dot_product_attention; a drop-in for the local spec."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type, attention_type,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type=None, pg_collection=None) -> None:
        super().__init__(config=config)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        # megatron-core hands us [seq, batch, heads, head_dim]; SDPA wants [batch, heads, seq, dim].
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if k.size(1) != q.size(1):  # grouped-query attention: repeat key/value groups per head
            k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
            v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale,
            dropout_p=self.dropout if self.training else 0.0)
        seq, batch = out.size(2), out.size(0)
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)


def padded_vocab_size(vocab_size: int, args: argparse.Namespace) -> int:
    """Megatron pads the vocabulary to a multiple of make-vocab-size-divisible-by x TP size."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


def params_dtype(args: argparse.Namespace) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float32


def transformer_config(args: argparse.Namespace) -> TransformerConfig:
    return TransformerConfig(
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
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        bf16=args.bf16,
        params_dtype=params_dtype(args),
        pipeline_dtype=params_dtype(args),
        use_cpu_initialization=not torch.cuda.is_available(),
        # Fused kernels are CUDA-only; the unfused paths are numerically the same model.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
    )


def layer_spec(args: argparse.Namespace) -> ModuleSpec:
    if args.transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec()
    spec = get_gpt_layer_local_spec(normalization=args.normalization)
    if not torch.cuda.is_available():
        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


def build_model(args: argparse.Namespace, vocab_size: int) -> MegatronModule:
    config = transformer_config(args)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(args),
        vocab_size=padded_vocab_size(vocab_size, args),
        max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if args.bf16:
        # As in Megatron-LM: casts inputs to bf16 and the loss back to fp32.
        model = Float16Module(config, model)
    return model
