"""The house has floors: every import in megatron_resil/ goes to a module on its own floor or below, and no
modules import each other in a circle. An import inside a function counts as much as one at the top (a
deferred import is still a dependency), and so does the package a module lives in (importing
`megatron_resil.checkpointing.atomic` runs `megatron_resil/checkpointing/__init__.py` first).

FLOORS names the floors from the bottom up. A module belongs to the most specific entry naming it or a
package above it; a new module that no entry names fails the test until it is given a floor. A failure
names each offending import: the file and line, the two modules, and why (an upward import, a circle).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "megatron_resil"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# Bottom to top: (the floor's name, its entries). An entry is a module or a package (relative to
# megatron_resil; "" is megatron_resil/__init__.py itself), and names everything under it that no more
# specific entry names.
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # who this process is, its exit codes, the marks of a restart's phases: imports nothing of ours
    ("ground", ("", "quiet_imports", "exit_codes", "module_files", "rank_process", "phase_marks",
                "progress", "process_exit")),
    # the patch registry, not the records: those sit above the code of ours they install
    ("reporting and the patch registry", ("events", "patches")),
    ("what the command line reads", ("batch_schedule", "fim", "tokenizer_files", "tokenizer")),
    ("the command line", ("arguments",)),
    ("process groups", ("gpu_features", "group_connections", "parallel")),
    ("checkpoints", ("checkpointing",)),
    ("the engine", ("model", "optimizer", "data", "moe_metrics", "train_log")),
    ("the failure modes", ("resilience",)),
    # each installs code of ours, from the floors below, into megatron-core, torch or NVRx
    ("the patch records", ("patches.megatron_core", "patches.megatron_core_cpu", "patches.torch_dcp",
                           "patches.torch_startup", "patches.nvrx", "patches.stdlib")),
    ("the training loop", ("training",)),
    ("starting ranks", ("launch",)),
    # and the entry points kept under their former names
    ("tools", ("tools", "standby", "ft_launcher")),
)


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # a module of the package it makes Python run
    path: Path
    line: int
    implied: bool  # a package above the module named, run because it is


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _with_packages(module: str, modules: dict[str, Path]) -> set[str]:
    """`module` and the packages above it: what importing it runs."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & set(modules)


def _imported(source: str, path: Path, node: ast.Import | ast.ImportFrom,
              modules: dict[str, Path]) -> dict[str, bool]:
    """The package's modules that `node`, in module `source`, makes Python run: each with whether it is
    only implied (a package above a module it names)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = source.split(".") if path.name == "__init__.py" else source.split(".")[:-1]
            package = package[:len(package) - node.level + 1]
            base = ".".join(package + ([base] if base else []))
        # `from a import b`: b is a module of a, or a name a defines
        names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        if any(name in modules for name in names[1:]):
            names = names[1:]  # a, the package, runs only because its module b is imported
    named = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            named.add(name)
    implied = set().union(*(_with_packages(name, modules) for name in named)) - named
    return {module: False for module in named} | {module: True for module in implied}


def imports() -> list[Import]:
    """Every import of a module of the package by another, with where it is written."""
    modules = _modules()
    found = []
    for source, path in modules.items():
        own_packages = _with_packages(source, modules)  # imported before `source` runs at all
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target, implied in sorted(_imported(source, path, node, modules).items()):
                    if target not in own_packages:
                        found.append(Import(source, target, path, node.lineno, implied))
    return found


def floor_of(module: str) -> tuple[int, str] | None:
    """(floor number, entry) of the most specific entry naming `module`, None if none does."""
    relative = module.removeprefix(PACKAGE).removeprefix(".")
    best = None
    for number, (_, entries) in enumerate(FLOORS):
        for entry in entries:
            names_it = relative == entry or (entry != "" and relative.startswith(entry + "."))
            if names_it and (best is None or len(entry) > len(best[1])):
                best = (number, entry)
    return best


def circles(found: list[Import]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for imp in found:
        graph.setdefault(imp.source, set()).add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph.get(module, ()):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == module:
                    break
            if len(component) > 1:
                components.append(component)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return components


def _where(imp: Import) -> str:
    return f"{imp.path.relative_to(ROOT.parent)}:{imp.line}: {imp.source} -> {imp.target}"


def _floor(number: int) -> str:
    return f"floor {number} ({FLOORS[number][0]})"


def test_every_module_has_a_floor():
    unplaced = sorted(module for module in _modules() if floor_of(module) is None)
    assert not unplaced, "modules on no floor (add each to FLOORS in tests/test_layering.py): " + \
        ", ".join(unplaced)


def test_every_floor_entry_names_a_module():
    used = {placed[1] for placed in map(floor_of, _modules()) if placed is not None}
    stale = [entry for _, entries in FLOORS for entry in entries if entry not in used]
    assert not stale, f"FLOORS in tests/test_layering.py names what no longer exists: {', '.join(stale)}"


def test_no_import_goes_up_a_floor():
    upward = [imp for imp in imports() if None not in (floor_of(imp.source), floor_of(imp.target))
              and floor_of(imp.target)[0] > floor_of(imp.source)[0]]
    named = {(imp.path, imp.line) for imp in upward if not imp.implied}
    said = [f"{_where(imp)}: an upward import, from {_floor(floor_of(imp.source)[0])} to "
            f"{_floor(floor_of(imp.target)[0])}" for imp in upward
            if not imp.implied or (imp.path, imp.line) not in named]  # a package is said when only it goes up
    assert not said, "\n".join(said)


def test_no_modules_import_each_other_in_a_circle():
    found = imports()
    problems = []
    for component in circles(found):
        edges = [imp for imp in found if imp.source in component and imp.target in component]
        problems.append(f"a circle of {len(component)} modules:\n" +
                        "\n".join(f"  {_where(imp)}: part of that circle" for imp in edges))
    assert not problems, "\n".join(problems)
