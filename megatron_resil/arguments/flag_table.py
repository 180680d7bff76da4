"""Megatron-LM flags declared as rows of a table: one row gives the parser its argument, megatron-core's
config its field, and the start-up checks what to do with a GPU-only feature on CPU or with a feature
that is not here. A concern module lists its rows in `FLAGS`; parse_args screens them all.

Where a row goes (`to`): the megatron-core config whose field of the same name (or `field`) it sets, as
Megatron-LM's core_transformer_config_from_args does; None when our own code reads it.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from typing import Any

from megatron_resil.arguments.errors import ArgumentError

# The megatron-core configs a row can feed, and the source files that define their fields.
CONFIG_SOURCES = {
    "TransformerConfig": ("transformer/transformer_config.py", "model_parallel_config.py"),
    "MLATransformerConfig": ("transformer/transformer_config.py", "model_parallel_config.py"),
    "DistributedDataParallelConfig": ("distributed/distributed_data_parallel_config.py",),
    "OptimizerConfig": ("optimizer/optimizer_config.py",),
}


@dataclass(frozen=True)
class Flag:
    """One Megatron-LM flag: its name, default and meaning, and where its value goes.

    A flag with no `type` is a switch: `--x` (default False) or `--no-x` (default True, dest without
    the "no"). `gpu`, for a feature that exists only on GPU: "results" when it changes what is computed
    (refused without CUDA), else the clause the one CPU warning says, e.g. "only selects a GPU kernel
    (same results)", before the flag is reset to its default. `refuse`: why a value other than the default
    cannot run here, on any device (a clause naming what to do instead). A GPU-only flag that only picks a
    faster path is ignored the same way, with one warning, where the installed megatron-core lacks its field.
    """

    name: str
    default: Any = False
    type: Callable[[str], Any] | None = None
    help: str = ""
    choices: tuple | None = None
    dest: str | None = None
    nargs: str | None = None
    to: str | None = None
    field: str | None = None
    gpu: str | None = None
    refuse: str | None = None

    @property
    def key(self) -> str:
        if self.dest:
            return self.dest
        name = self.name[2:]
        if self.type is None and self.default is True and name.startswith("no-"):
            name = name[3:]
        return name.replace("-", "_")

    def value(self, args: argparse.Namespace) -> Any:
        return getattr(args, self.key)

    def is_set(self, args: argparse.Namespace) -> bool:
        return self.value(args) != self.default


def add_flags(parser: argparse.ArgumentParser, title: str, flags: Iterable[Flag]) -> None:
    group = parser.add_argument_group(title)
    for flag in flags:
        kwargs: dict[str, Any] = {"dest": flag.key, "default": flag.default, "help": flag.help or None}
        if flag.type is None:
            kwargs["action"] = "store_false" if flag.default is True else "store_true"
        else:
            kwargs["type"] = flag.type
            if flag.choices is not None:
                kwargs["choices"] = flag.choices
            if flag.nargs is not None:
                kwargs["nargs"] = flag.nargs
        group.add_argument(flag.name, **kwargs)


_pending: list[str] = []


def warn(message: str) -> None:
    """One warning line, as Megatron-LM's warn_rank_0 (rank 0 only), printed once the whole command line
    has passed: a refused one ends in its one error line alone."""
    _pending.append(message)


def flush_warnings(print_them: bool) -> None:
    if print_them and os.environ.get("RANK", "0") == "0":
        for message in _pending:
            sys.stderr.write(f"pretrain.py: warning: {message}\n")
    _pending.clear()


def screen(args: argparse.Namespace, flags: Iterable[Flag], cuda: bool) -> None:
    """Before the concerns' own checks: refuse what cannot run here, and settle GPU-only flags on CPU."""
    for flag in flags:
        if not flag.is_set(args):
            continue
        shown = f"{flag.name} {_shown(flag.value(args))}".rstrip()
        if flag.refuse:
            raise ArgumentError(f"{shown}: {flag.refuse}")
        if flag.gpu and not cuda:
            if flag.gpu == "results":
                raise ArgumentError(f"{shown} needs CUDA: it changes what is computed, so it is not "
                                    "ignored on CPU; drop it on CPU")
            warn(f"{shown} {flag.gpu}; ignored without CUDA")
            setattr(args, flag.key, flag.default)
        if flag.to and flag.is_set(args) and (flag.field or flag.key) not in config_fields(flag.to):
            if flag.gpu and flag.gpu != "results":  # only a faster path: the run is the same without it
                warn(f"{shown} {flag.gpu}; ignored: the installed {_core_version()}'s {flag.to} has no "
                     f"{flag.field or flag.key}")
                setattr(args, flag.key, flag.default)
                continue
            raise ArgumentError(f"{shown} needs a megatron-core whose {flag.to} has "
                                f"{flag.field or flag.key} (installed: {_core_version()}); drop the flag "
                                "or upgrade megatron-core")


def _shown(value: Any) -> str:
    if value is True or value is False:
        return ""
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return str(value)


def config_kwargs(args: argparse.Namespace, flags: Iterable[Flag], to: str) -> dict[str, Any]:
    """The rows' values for the megatron-core config `to`, by field name. A field the installed
    megatron-core lacks is left out (screen() refused it unless the flag kept its default)."""
    fields = config_fields(to)
    return {(f.field or f.key): f.value(args) for f in flags
            if f.to == to and (f.field or f.key) in fields}


@cache
def config_fields(config: str) -> frozenset[str]:
    """The dataclass fields of a megatron-core config (its base classes' included), read from its source
    on disk rather than imported: arguments are checked before megatron-core (seconds to import) loads."""
    return frozenset(_config_annotations(config))


@cache
def config_choices(config: str, field: str) -> tuple[str, ...]:
    """The values a megatron-core config field's Literal annotation lists (e.g. the attention variants the
    installed release knows), read from its source; () when the field is not a Literal or is absent."""
    annotation = _config_annotations(config).get(field)
    literals = [node for node in ast.walk(annotation) if isinstance(node, ast.Subscript)
                and getattr(node.value, "id", getattr(node.value, "attr", None)) == "Literal"] \
        if annotation is not None else []
    if not literals:
        return ()
    values = literals[0].slice.elts if isinstance(literals[0].slice, ast.Tuple) else [literals[0].slice]
    return tuple(v.value for v in values if isinstance(v, ast.Constant))


@cache
def _config_annotations(config: str) -> dict[str, ast.expr]:
    """Each field of the config (bases included) and its type annotation, from megatron-core's source."""
    spec = importlib.util.find_spec("megatron.core")
    if spec is None or not spec.submodule_search_locations:
        return {}
    root = next(iter(spec.submodule_search_locations))
    classes: dict[str, tuple[list[str], dict[str, ast.expr]]] = {}
    for relative in CONFIG_SOURCES[config]:
        with open(os.path.join(root, relative)) as source:
            tree = ast.parse(source.read())
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                bases = [base.id for base in node.bases if isinstance(base, ast.Name)]
                classes[node.name] = (bases, {item.target.id: item.annotation for item in node.body
                                              if isinstance(item, ast.AnnAssign)
                                              and isinstance(item.target, ast.Name)})

    def with_bases(name: str) -> dict[str, ast.expr]:
        bases, fields = classes.get(name, ([], {}))
        merged: dict[str, ast.expr] = {}
        for base in bases:
            merged.update(with_bases(base))
        return {**merged, **fields}

    return with_bases(config)


def _core_version() -> str:
    import importlib.metadata

    try:
        return f"megatron-core {importlib.metadata.version('megatron-core')}"
    except importlib.metadata.PackageNotFoundError:
        return "megatron-core, version unknown"
