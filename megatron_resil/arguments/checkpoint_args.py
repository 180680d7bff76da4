"""--use-checkpoint-args, as Megatron-LM's load_args_from_checkpoint: before the command line is checked, the
model's arguments saved in the checkpoint under --load take their place. Which ones, and how, is Megatron-LM's
list for the installed release: most replace the command line's value ("forced"); the sizes only fill in one
the command line left out. This module owns the flags and the merge; reading the checkpoint is
checkpointing/saved_args.py's, which parse_args calls between parsing and validation, as Megatron-LM's
initialize_megatron calls load_args_from_checkpoint.

The saved arguments are untrusted data: each value must be one its flag could have given (a size within
arguments/sizes.py's bounds, a layer pattern checked without being read as text), and a path that decides
what code runs (the tokenizer directory under --trust-remote-code) is never taken from them."""

from __future__ import annotations

import argparse
import importlib.metadata
import math
from dataclasses import dataclass

from packaging.version import Version

from megatron_resil import events
from megatron_resil.arguments import sizes
from megatron_resil.arguments.errors import ArgumentError
from megatron_resil.arguments.flag_table import Flag, add_flags, warn

FLAGS = (
    Flag("--use-checkpoint-args",
         help="as in Megatron-LM: before the model is built, the model's arguments saved in the checkpoint "
              "under --load replace the command line's (sizes such as --num-layers only where the command "
              "line leaves them out)"),
    Flag("--use-mp-args-from-checkpoint-args",
         help="with --use-checkpoint-args: the tensor-, pipeline- and expert-parallel sizes too"),
    Flag("--no-use-tokenizer-model-from-checkpoint-args", True,
         dest="use_tokenizer_model_from_checkpoint_args",
         help="with --use-checkpoint-args: keep the command line's --tokenizer-type and --tokenizer-model"),
)

# Megatron-LM's name -> ours, where the same flag stores its value under another name here.
_OURS = {"apply_layernorm_1p": "layernorm_zero_centered_gamma"}
# The sizes a command line must give unless a checkpoint does (model.py's required flags).
_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
# Bounds on saved values that are no size: integers a C long holds, text a flag could carry, lists as
# long as a layer pattern at most.
_MAX_INT = (1 << 63) - 1
_MAX_TEXT = 4096
_MAX_ITEMS = 1 << 14


@dataclass(frozen=True)
class Copied:
    """One argument load_args_from_checkpoint copies: `forced` replaces the command line's value, else only
    a value the command line left None is filled in; `since`/`until`: the megatron-core releases (the
    Megatron-LM release of the same version) that copy it, where that changed between 0.16 and 0.19."""

    name: str
    forced: bool = True
    since: str | None = None
    until: str | None = None

    def copied_by(self, release: Version) -> bool:
        return (self.since is None or release >= Version(self.since)) and \
            (self.until is None or release < Version(self.until))


# Megatron-LM's megatron/training/checkpointing.py, core_v0.16.1 to core_v0.19.0, in its order. Those the
# running code has no argument for (Mamba, hybrid models, ...) are never copied.
MODEL = (
    *(Copied(name, forced=False) for name in ("num_layers", "hidden_size", "ffn_hidden_size", "seq_length",
                                               "num_attention_heads")),
    Copied("num_query_groups"), Copied("group_query_attention"), Copied("kv_channels", forced=False),
    Copied("max_position_embeddings", forced=False),
    *(Copied(name) for name in (
        "position_embedding_type", "add_position_embedding", "use_rotary_position_embeddings", "rotary_base",
        "rotary_percent", "rotary_interleaved", "add_bias_linear", "add_qkv_bias", "squared_relu", "swiglu",
        "untie_embeddings_and_output_weights", "apply_layernorm_1p", "normalization",
        "apply_query_key_layer_scaling", "attention_dropout", "hidden_dropout")),
    Copied("hybrid_override_pattern", until="0.17"),
    *(Copied(name, since="0.17") for name in ("mtp_hybrid_override_pattern", "mtp_num_layers",
                                               "mtp_use_repeated_layer")),
    Copied("spec"), Copied("hybrid_attention_ratio", until="0.17"), Copied("hybrid_mlp_ratio", until="0.17"),
    Copied("num_experts"), Copied("moe_layer_freq"), Copied("moe_ffn_hidden_size"), Copied("moe_router_topk"),
    Copied("moe_token_dispatcher_type", forced=False), Copied("moe_router_pre_softmax"),
    Copied("moe_grouped_gemm"), Copied("moe_single_grouped_weight", since="0.18"),
    Copied("moe_single_grouped_bias", since="0.18"),
    *(Copied(name) for name in (
        "moe_shared_expert_intermediate_size", "moe_router_score_function", "moe_router_enable_expert_bias",
        "moe_router_topk_scaling_factor", "mamba_state_dim", "mamba_head_dim", "mamba_num_groups",
        "mamba_num_heads")),
    Copied("is_hybrid_model", until="0.17"), Copied("hybrid_layer_pattern", forced=False, since="0.17"),
    Copied("heterogeneous_layers_config_path"), Copied("heterogeneous_layers_config_encoded_json"),
    Copied("moe_latent_size"),
)
TOKENIZER = (Copied("tokenizer_model"), Copied("tokenizer_type"))  # unless --no-use-tokenizer-model-from-...
LATER = (Copied("tiktoken_pattern"), Copied("padded_vocab_size", forced=False),
         Copied("ckpt_format", forced=False))
PARALLEL = (Copied("tensor_model_parallel_size"), Copied("pipeline_model_parallel_size"),
            Copied("virtual_pipeline_model_parallel_size"),
            Copied("num_layers_per_virtual_pipeline_stage", forced=False),
            Copied("expert_model_parallel_size"))  # with --use-mp-args-from-checkpoint-args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "model arguments from the checkpoint (Megatron-LM's options)", FLAGS)


def validate(args: argparse.Namespace, world_size: int) -> None:
    """Checked before the other concerns, in wanted(): they check what was merged."""


def wanted(args: argparse.Namespace) -> bool:
    """Whether a checkpoint's arguments are to be read, the flags' own checks first (ArgumentError)."""
    if not args.use_checkpoint_args:
        if args.use_mp_args_from_checkpoint_args:
            warn("--use-mp-args-from-checkpoint-args does nothing without --use-checkpoint-args")
        return False
    if args.load is None:
        raise ArgumentError("--use-checkpoint-args needs --load DIR: the checkpoint whose model arguments "
                            "it takes")
    if args.non_persistent_ckpt_type == "local":
        raise ArgumentError("--use-checkpoint-args cannot be used with --non-persistent-ckpt-type local (as "
                            "in Megatron-LM): a node-local checkpoint is found only once the parallel "
                            "layout, which the arguments decide, is set up; drop one of them")
    return True


def say_missing_sizes(args: argparse.Namespace, why: str) -> None:
    """Without a checkpoint's arguments to fill them in, the sizes a model needs must be on the command
    line."""
    for name in _REQUIRED:
        if getattr(args, name) is None:
            raise ArgumentError(f"--{name.replace('_', '-')} is required: --use-checkpoint-args has nothing "
                                f"to take it from ({why})")


def copied_values(args: argparse.Namespace) -> dict[str, object]:
    """Every argument a checkpoint can give, by Megatron-LM's name, with its value in `args`."""
    return {row.name: getattr(args, _OURS.get(row.name, row.name), None)
            for row in (*MODEL, *TOKENIZER, *LATER, *PARALLEL)}


def _release() -> Version:
    return Version(Version(importlib.metadata.version("megatron-core")).base_version)


def merge(args: argparse.Namespace, saved: dict, parser: argparse.ArgumentParser, where: str) -> list[str]:
    """Megatron-LM's copying of `saved` (what the checkpoint at `where` holds), each value said in its line;
    returns every argument whose value (given or default) the checkpoint's changed, with both values."""
    saved = dict(saved)
    if "disable_bias_linear" in saved:  # Megatron-LM's one-off conversion for older checkpoints
        saved["add_bias_linear"] = not saved["disable_bias_linear"]
    rows = [*MODEL, *(TOKENIZER if args.use_tokenizer_model_from_checkpoint_args else ()), *LATER,
            *(PARALLEL if args.use_mp_args_from_checkpoint_args else ())]
    actions = {action.dest: action for action in parser._actions}
    release, changed = _release(), []
    for row in rows:
        ours = _OURS.get(row.name, row.name)
        if not row.copied_by(release) or ours not in actions:
            continue  # an argument the running code does not have
        if row.name == "moe_ffn_hidden_size" and saved.get("num_experts") is None:
            if args.moe_ffn_hidden_size is not None:
                changed.append(f"moe_ffn_hidden_size ({args.moe_ffn_hidden_size} -> None)")
            args.moe_ffn_hidden_size = None  # as Megatron-LM: a dense checkpoint's model has no experts
            continue
        if row.name == "tokenizer_model" and args.trust_remote_code:
            _keep_tokenizer_model(args, saved.get(row.name), where)
            continue
        if not row.forced and getattr(args, ours) is not None:
            continue
        value = saved.get(row.name, saved.get(ours))
        if value is None:
            events.print_rank_0(f"Checkpoint did not provide arguments {row.name}")
            continue
        flag = actions[ours].option_strings[0]
        if not _fits(actions[ours], value):
            raise ArgumentError(f"{where} holds {row.name}={shown(value)}, which is no value of {flag}; "
                                "drop --use-checkpoint-args")
        if ours in sizes.LIMITS and (why := sizes.out_of_bounds(ours, value)) is not None:
            raise ArgumentError(f"{where} holds {row.name}={value}, which {flag} cannot be: it {why}; drop "
                                "--use-checkpoint-args")
        events.print_rank_0(f"Setting {row.name} to {value} from checkpoint")
        if getattr(args, ours) != value:
            changed.append(f"{row.name} ({getattr(args, ours)} -> {value})")
        setattr(args, ours, value)
    return changed


def _keep_tokenizer_model(args: argparse.Namespace, saved, where: str) -> None:
    """Under --trust-remote-code the tokenizer directory decides what code runs: the command line's is kept,
    and said, when the checkpoint names another. (Its --tokenizer-type is still taken, as in Megatron-LM: it
    only picks among the tokenizers built here, reading the directory the command line trusts.)"""
    if saved is not None and saved != args.tokenizer_model:
        kept = args.tokenizer_model if args.tokenizer_model is not None else "(none given)"
        events.print_rank_0(f"[resil] checkpoint args: kept the command line's --tokenizer-model {kept}, "
                            f"not {shown(saved)} from {where}: under --trust-remote-code the tokenizer "
                            "directory decides what code runs, and that is never taken from a checkpoint")


def _fits(action: argparse.Action, value) -> bool:
    """`value`, saved in an untrusted checkpoint, is one the flag could have given."""
    if action.nargs == 0:  # a switch
        return isinstance(value, bool)
    if action.nargs in ("+", "*"):
        return type(value) is list and 1 <= len(value) <= _MAX_ITEMS and \
            all(_fits_one(action, v) for v in value)
    return _fits_one(action, value)


def _fits_one(action: argparse.Action, value) -> bool:
    """Checked by type, never by handing the value to the flag's parsing function (a text the checkpoint
    chose would be read as the command line's)."""
    kind = action.type or str
    if isinstance(value, bool):
        return False
    if kind is int:
        fits = type(value) is int and -_MAX_INT <= value <= _MAX_INT
    elif kind is float:
        fits = type(value) in (int, float) and abs(value) <= _MAX_INT and math.isfinite(value)
    elif kind is str:
        fits = type(value) is str and len(value) <= _MAX_TEXT and value.isprintable()
    else:  # a parsing function (--moe-layer-freq's): its own check of a parsed value, or none fits
        accepts = getattr(kind, "accepts", None)
        fits = accepts is not None and accepts(value)
    return fits and (action.choices is None or value in action.choices)


def shown(value) -> str:
    """A saved value as a refusal quotes it: escaped, and short whatever its size or kind."""
    if value is None or isinstance(value, (bool, float)):
        return ascii(value)
    if isinstance(value, int):
        return str(value) if value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"
    if isinstance(value, str):
        return ascii(value[:80]) + ("..." if len(value) > 80 else "")
    if isinstance(value, (list, tuple, dict, set)):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"a {type(value).__name__}"


