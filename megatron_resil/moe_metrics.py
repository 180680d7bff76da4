"""The MoE routers', multi-token prediction's and sparse attention's indexer auxiliary losses, reduced across
ranks as Megatron-LM reduces them for its log line (`load_balancing_loss: ... |`, `mtp_1 loss: ... |`,
`indexer loss: ... |`): megatron-core adds each layer's loss to a process-wide tracker during the forward
passes; after each step every rank reduces it and it is cleared for the next."""

from __future__ import annotations

import argparse

from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper


def tracked_names(args: argparse.Namespace) -> list[str]:
    """Megatron-LM's names for the losses its router type records (it tests by substring, so
    seq_aux_loss also reports load_balancing_loss)."""
    balancing = args.moe_router_load_balancing_type
    names = []
    if "aux_loss" in balancing:
        names.append("load_balancing_loss")
    if "seq_aux_loss" in balancing:
        names.append("seq_load_balancing_loss")
    if "global_aux_loss" in balancing:
        names.append("global_load_balancing_loss")
    if args.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return names


def reduce_aux_losses(args: argparse.Namespace, num_microbatches: int) -> dict[str, float]:
    """Collective on every rank after a training step: each tracked loss averaged over the MoE layers
    and the step's microbatches, then the multi-token prediction losses, then sparse attention's indexer
    loss (with --dsa-indexer-loss-coeff > 0); {} for a dense model without either."""
    totals: dict = {}
    if args.num_experts is not None and tracked_names(args):
        moe_utils.track_moe_metrics(loss_scale=1.0 / num_microbatches, iteration=0,
                                    total_loss_dict=totals, force_initialize=True,
                                    track_names=tracked_names(args),
                                    num_layers=args.num_layers, moe_layer_freq=args.moe_layer_freq,
                                    mtp_num_layers=args.mtp_num_layers)
        totals = {name: totals[name] for name in tracked_names(args) if name in totals}  # Megatron's order
    if args.mtp_num_layers is not None:
        MTPLossLoggingHelper.track_mtp_metrics(1.0 / num_microbatches, 0, None, None, totals)
    if args.experimental_attention_variant == "dsa" and (args.dsa_indexer_loss_coeff or 0) > 0:
        DSAIndexerLossLoggingHelper.track_indexer_metrics(1.0 / num_microbatches, 0, None, None, totals)
    return {name: float(value) for name, value in totals.items()}


def clear() -> None:
    """Forget what forward passes outside training (evaluation) recorded."""
    moe_utils.clear_aux_losses_tracker()
    DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
