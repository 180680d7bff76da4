"""The sizes a GPT is built from (Megatron-LM's flags): the bounds each keeps, whether it comes from the
command line or from a checkpoint's saved arguments (--use-checkpoint-args), and the fewest parameters a
model of given sizes holds, which checkpoint_args.py compares with what the checkpoint records before
anything is allocated."""

from __future__ import annotations

import argparse

from megatron_resil.arguments.errors import ArgumentError
from megatron_resil.arguments.layer_pattern import MAX_LAYERS

# Each at least 1 and at most this: well beyond any model trained so far (a 100k-wide MLP, 256 experts,
# a million-token context), and far below what would make a rank allocate more than it has.
LIMITS = {
    "num_layers": MAX_LAYERS,
    "hidden_size": 1 << 20,
    "ffn_hidden_size": 1 << 22,
    "num_attention_heads": 1 << 14,
    "num_query_groups": 1 << 14,
    "kv_channels": 1 << 16,
    "seq_length": 1 << 24,
    "max_position_embeddings": 1 << 24,
    "rotary_base": 1 << 40,
    "mtp_num_layers": 1 << 10,
    "num_experts": 1 << 16,
    "moe_ffn_hidden_size": 1 << 22,
    "moe_router_topk": 1 << 16,
    "moe_shared_expert_intermediate_size": 1 << 22,
}
MOE = ("num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_shared_expert_intermediate_size")
MODEL = tuple(name for name in LIMITS if name not in MOE)


def out_of_bounds(name: str, value: int) -> str | None:
    """Why `value` cannot be the size `name` (a clause), or None."""
    if value < 1:
        return "must be positive"
    if value > LIMITS[name]:
        return f"is more than any model has (at most {LIMITS[name]})"
    return None


def check(args: argparse.Namespace, names: tuple[str, ...]) -> None:
    """Each of `names` that is set is within its bounds; raises ArgumentError naming the flag."""
    for name in names:
        value = getattr(args, name)
        if value is not None and (why := out_of_bounds(name, value)) is not None:
            raise ArgumentError(f"--{name.replace('_', '-')} {value} {why}")


def default_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron-LM's: 4 x hidden; with swiglu's two input projections, 2/3 of that (to a multiple of 64)
    keeps the parameter count."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64 if swiglu else 4 * hidden_size


def least_parameters(args: argparse.Namespace) -> list[tuple[int, str]]:
    """The parts of the GPT these arguments build, each with the fewest parameters it holds and the sizes
    that make it. A lower bound whatever the layer spec: left out are what depends on the tokenizer (the
    embeddings and output layer), norms and biases, multi-token prediction, and attention whose shapes
    differ (multi-latent attention, the experimental variants). Sizes not yet checked count as absent."""
    def size(name: str) -> int:
        value = getattr(args, name, None)
        return value if type(value) is int and value > 0 else 0

    layers, hidden = size("num_layers"), size("hidden_size")
    if not (layers and hidden):
        return []
    gated = 3 if args.swiglu else 2  # fc1 (doubled by the gate under swiglu) and fc2
    ffn = size("ffn_hidden_size") or default_ffn_hidden_size(hidden, args.swiglu)
    parts = []
    if args.position_embedding_type == "learned_absolute":
        positions = size("max_position_embeddings") or size("seq_length")
        parts.append((positions * hidden, f"position embeddings: max_position_embeddings {positions} x "
                                          f"hidden_size {hidden}"))
    heads = size("num_attention_heads")
    if heads and not args.multi_latent_attention and args.experimental_attention_variant is None:
        kv = size("kv_channels") or hidden // heads
        groups = size("num_query_groups") if args.group_query_attention else heads
        parts.append((layers * hidden * kv * 2 * (heads + groups),
                      f"attention: num_layers {layers} x hidden_size {hidden} x kv_channels {kv} x 2 x "
                      f"(num_attention_heads {heads} + num_query_groups {groups})"))
    experts = size("num_experts") if size("num_experts") > 1 else 0
    moe_layers = _moe_layers(args.moe_layer_freq, layers) if experts else 0
    if moe_layers:
        expert_ffn = size("moe_ffn_hidden_size") or ffn
        parts.append((moe_layers * experts * hidden * expert_ffn * gated,
                      f"experts: {moe_layers} MoE layer(s) x num_experts {experts} x hidden_size {hidden} x "
                      f"moe_ffn_hidden_size {expert_ffn} x {gated}"))
        parts.append((moe_layers * experts * hidden, f"routers: {moe_layers} MoE layer(s) x num_experts "
                                                      f"{experts} x hidden_size {hidden}"))
        if shared := size("moe_shared_expert_intermediate_size"):
            parts.append((moe_layers * hidden * shared * gated,
                          f"shared experts: {moe_layers} MoE layer(s) x hidden_size {hidden} x "
                          f"moe_shared_expert_intermediate_size {shared} x {gated}"))
    if layers > moe_layers:
        parts.append(((layers - moe_layers) * hidden * ffn * gated,
                      f"MLPs: {layers - moe_layers} dense layer(s) x hidden_size {hidden} x ffn_hidden_size "
                      f"{ffn} x {gated}"))
    return parts


def _moe_layers(pattern, layers: int) -> int:
    """How many of the first `layers` layers --moe-layer-freq makes MoE layers."""
    if type(pattern) is int and pattern > 0:
        return len(range(0, layers, pattern))
    return sum(pattern[:layers]) if isinstance(pattern, list) else 0
