"""The patch registry: the record every change to someone else's code is declared as, the checks a record
makes of the installed code, and `install()`, which decides and applies them at start-up (never on import).
It imports none of the records' files until `install()` asks for them, so any part of the project may ask
it what was applied (the async-save worker applies what its trainer did).

One file per upstream (megatron_core.py, megatron_core_cpu.py, torch_dcp.py, torch_startup.py, nvrx.py,
stdlib.py) declares `PATCHES`: records naming the target, the versions it was written for, why (the
upstream bug, or the reason), and what must hold of the installed code for it to be right: attributes
present, parameter names, and where the patch depends on how upstream code is written, a line of that
code. A record without `apply` is a dependency: code of ours (a subclass overriding private methods, a
private name used at run time) that relies on it; it is checked the same way.

`install()` checks every record that concerns this run, then applies. A record whose problem upstream
does not have here (fixed, or absent in this release) stands down; one whose target is not what it
was written for stops the process with one line naming the package, its version and the attribute
(exit code 2), or, where going without it only costs time, stands down. Each decision other than
"applied as expected" is one `[resil] patch:` line. docs/patches.md lists the records.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from megatron_resil import exit_codes
from megatron_resil.module_files import module_path

STOP = "stop"  # without it we would be wrong: exit 2
STAND_DOWN = "stand down"  # without it we are slower or less tidy, not wrong: go on, say so
# The order of install.
_MODULES = ("stdlib", "megatron_core", "megatron_core_cpu", "torch_dcp", "torch_startup", "nvrx")
_EXIT_CODE = exit_codes.BAD_ARGUMENTS  # the same command on the same installation fails the same way


class UpstreamMismatch(SystemExit):
    """An installed package is not what a patch was written for; its one line is printed already."""

    def __init__(self, line: str) -> None:
        super().__init__(_EXIT_CODE)
        self.line = line


# ---- what a record checks ------------------------------------------------------------------------

def _split(path: str) -> tuple[str, str]:
    module, _, qualname = path.partition(":")
    return module, qualname


def _resolve(path: str):
    """The object at "module:Qual.name" (the module itself without a name); raises LookupError."""
    module_name, qualname = _split(path)
    try:
        obj = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - whatever stops the import, it is one line, not a traceback
        raise LookupError(f"module {module_name} cannot be imported ({type(err).__name__}: {err})") from None
    for depth, part in enumerate(qualname.split(".") if qualname else ()):
        if not hasattr(obj, part):
            owner = qualname.split(".")[:depth]
            where = f"{module_name}.{'.'.join(owner)}" if owner else module_name
            raise LookupError(f"{where} has no attribute {part!r}")
        obj = getattr(obj, part)
    return obj


def _shown(path: str) -> str:
    module_name, qualname = _split(path)
    return f"{module_name}.{qualname}" if qualname else module_name


@dataclass(frozen=True)
class Has:
    """The attribute exists."""

    path: str

    def problem(self) -> str | None:
        try:
            _resolve(self.path)
        except LookupError as err:
            return str(err)
        return None


@dataclass(frozen=True)
class Takes:
    """A callable whose parameters begin with these names; any it has beyond them have defaults, so our
    calls (and upstream's calls of our overrides) still fit. `more`: further required parameters are
    fine (an override of ours that takes them as *args)."""

    path: str
    params: tuple[str, ...]
    more: bool = False

    def problem(self) -> str | None:
        try:
            signature = inspect.signature(_resolve(self.path))
        except LookupError as err:
            return str(err)
        except (TypeError, ValueError) as err:
            return f"{_shown(self.path)} has no signature to check ({err})"
        params = list(signature.parameters.values())
        names = tuple(p.name for p in params[:len(self.params)])
        required = [p.name for p in params[len(self.params):]
                    if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if names != self.params or (required and not self.more):
            takes = ", ".join(p.name for p in params)
            return f"{_shown(self.path)} takes ({takes}), not ({', '.join(self.params)})"
        return None


def _source_on_disk(module_name: str) -> str:
    """A module's source, read from its file without importing it or its packages (for the records that
    must be in place before megatron-core is imported)."""
    path = module_path(module_name)
    if path is None or not path.endswith(".py"):
        raise LookupError(f"module {module_name} is missing")
    with open(path, encoding="utf-8") as f:
        return f.read()


@dataclass(frozen=True)
class Says:
    """The source of the target contains this text: the line of upstream code the patch depends on.
    `count`: exactly that many times. `on_disk`: read the module's file without importing it."""

    path: str
    text: str
    count: int | None = None
    on_disk: bool = False

    def problem(self) -> str | None:
        try:
            source = _source_on_disk(self.path) if self.on_disk else inspect.getsource(_resolve(self.path))
        except LookupError as err:
            return str(err)
        except (OSError, TypeError) as err:
            return f"the source of {_shown(self.path)} cannot be read to check it ({err})"
        found = source.count(self.text)
        if self.count is None and not found:
            return f"{_shown(self.path)} no longer contains {self.text!r}"
        if self.count is not None and found != self.count:
            return f"{_shown(self.path)} contains {self.text!r} {found} times, not {self.count}"
        return None


@dataclass(frozen=True)
class NotImported:
    """The module is not imported yet (a patch that must be in place before it is)."""

    module: str

    def problem(self) -> str | None:
        if self.module in sys.modules:
            return f"{self.module} was imported before patches.install()"
        return None


@dataclass(frozen=True)
class AnyOf:
    """One of these holds (upstream code of which more than one form is known to fit)."""

    checks: tuple

    def problem(self) -> str | None:
        problems = [check.problem() for check in self.checks]
        return None if None in problems else problems[0]


Check = Has | Takes | Says | NotImported | AnyOf


# ---- the record ------------------------------------------------------------------------------------

def always(args: argparse.Namespace | None) -> bool:
    return True


@dataclass(frozen=True)
class Patch:
    name: str  # what it does, in a few words (the `[resil] patch:` lines quote it)
    package: str  # the distribution it patches, as pip names it ("python": the interpreter)
    written_for: str  # PEP 440 versions of `package` it was written and tested for
    target: str  # "module:Qual.name" it replaces, or relies on (a dependency)
    why: str  # the upstream bug or issue, or the reason
    checks: tuple[Check, ...] = ()
    apply: Callable[[], None] | None = None  # None: a dependency, checked, nothing replaced
    # Upstream does not have the problem here: why, or None. On `not_needed_on` versions that is what we
    # expect, and standing down is silent; elsewhere it is said in one line.
    not_needed: Callable[[], str | None] | None = None
    not_needed_on: str = ""
    on_mismatch: str = STOP
    without: str = ""  # what going without it costs (for STAND_DOWN records)
    when: Callable[[argparse.Namespace | None], bool] = always  # does this run use it (args None: yes)
    first: bool = False  # installed before the others are checked (they import what it must precede)
    # Its apply binds to the process that runs it (a fork hook that knows its installer's pid): a standby
    # that installs the others ahead for its workers leaves it to each worker (standby_warmup.py).
    per_process: bool = False


@dataclass
class Decision:
    patch: Patch
    verdict: str  # "applied", "relied on" (a dependency), "not needed", "stood down", "stopped"
    line: str | None = None  # the [resil] line, None when it went as expected
    details: dict = field(default_factory=dict)


def installed_version(package: str) -> str:
    if package == "python":
        return platform.python_version()
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _in(version: str, specifiers: str) -> bool:
    if not specifiers:
        return False
    try:
        return SpecifierSet(specifiers).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def _decide(patch: Patch) -> Decision:
    version = installed_version(patch.package)
    label = f"{patch.package} {version}"
    if patch.not_needed is not None:
        try:
            reason = patch.not_needed()
        except LookupError:  # what it looks at is gone: the checks below say what
            reason = None
        if reason is not None:
            line = None if _in(version, patch.not_needed_on) else \
                f"[resil] patch: {label}: '{patch.name}' stood down: {reason}"
            return Decision(patch, "not needed", line, {"reason": reason})
    problems = [p for p in (check.problem() for check in patch.checks) if p is not None]
    if problems:
        if patch.on_mismatch == STAND_DOWN:
            return Decision(patch, "stood down", f"[resil] patch: {label}: '{patch.name}' stood down: "
                            f"{problems[0]}; {patch.without}", {"reason": problems[0]})
        role = "relies on" if patch.apply is None else "was written for"
        line = (f"[resil] patch: {label}: {problems[0]}, which '{patch.name}' {role} ({patch.package} "
                f"{patch.written_for}; docs/patches.md); exiting with code {_EXIT_CODE}")
        return Decision(patch, "stopped", line, {"reason": problems[0]})
    verdict = "applied" if patch.apply is not None else "relied on"
    line = None if _in(version, patch.written_for) else \
        (f"[resil] patch: {label} is outside the versions '{patch.name}' was written for "
         f"({patch.written_for}); its checks pass: {verdict}")
    return Decision(patch, verdict, line)


# ---- installing --------------------------------------------------------------------------------------

_decided: dict[str, Decision] = {}
# In a worker forked from a standby that installed this run's records ahead: their names, and the lines
# the standby did not print (it was quiet); the worker says them as its own install would have.
_ahead: frozenset[str] | None = None
_ahead_unsaid: list[str] = []


def records() -> list[Patch]:
    """Every record, in the order `install` takes them."""
    found = []
    for name in _MODULES:
        found.extend(importlib.import_module(f"megatron_resil.patches.{name}").PATCHES)
    return found


def _say(line: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # before torch.distributed: the launcher's rank
        print(line, flush=True)


def install(args: argparse.Namespace | None = None, *, only: tuple[str, ...] | None = None,
            quiet: bool = False) -> None:
    """Check and apply every record this run needs (`args`: the run's arguments; None: all of them),
    once per process. `only`: just these records (a spawned helper, as its parent decided). Raises
    UpstreamMismatch (a SystemExit with code 2) after printing its one line."""
    if only is None and _ahead is not None:
        if wanted_ahead(args) != _ahead:  # the standby compares before it forks (standby_warmup.py)
            raise RuntimeError(f"records installed ahead {sorted(_ahead)} are not this run's "
                               f"{sorted(wanted_ahead(args))}")
        while _ahead_unsaid:
            line = _ahead_unsaid.pop(0)
            if not quiet:
                _say(line)
    patches = [p for p in records() if p.name not in _decided
               and (p.name in only if only is not None else p.when(args))]
    for batch in ([p for p in patches if p.first], [p for p in patches if not p.first]):
        decisions = [_decide(patch) for patch in batch]
        stop = next((d for d in decisions if d.verdict == "stopped"), None)
        if stop is not None:
            _say(stop.line)
            raise UpstreamMismatch(stop.line)
        for decision in decisions:
            if decision.verdict == "applied":
                _apply(decision)
            _decided[decision.patch.name] = decision
            if decision.line is not None and not quiet:
                _say(decision.line)


def wanted_ahead(args: argparse.Namespace) -> frozenset[str]:
    """The records a run with `args` installs that a standby may install ahead, in its own process, for
    the workers it forks (all but the per-process ones)."""
    return frozenset(p.name for p in records() if p.when(args) and not p.per_process)


def install_ahead(args: argparse.Namespace) -> None:
    """In a standby: install, quietly, what `wanted_ahead(args)` names, so that megatron-core can be
    imported before any worker is forked; each worker's `install(args)` then checks that its run wants
    the same, says the lines this one kept quiet, and installs the per-process records itself."""
    global _ahead
    names = wanted_ahead(args)
    install(only=tuple(names), quiet=True)
    _ahead = names
    _ahead_unsaid.extend(_decided[name].line for name in _decided
                         if name in names and _decided[name].line is not None)


def imported_ahead() -> bool:
    """Whether this process's records were installed ahead, by the standby it was forked from."""
    return _ahead is not None


def install_import_speedups() -> None:
    """For a tool that imports megatron-core but trains nothing (preprocess_data, the ckpt tool): only the
    records that keep importing it fast, quietly. Each stands down where it does not fit, so none can stop
    the tool. A record already decided in this process (a second call, pretrain.py's install) is skipped."""
    install(only=tuple(p.name for p in records() if p.first and p.on_mismatch == STAND_DOWN), quiet=True)


def _apply(decision: Decision) -> None:
    patch = decision.patch
    try:
        patch.apply()
    except (ImportError, AttributeError) as err:  # a name our code imports to do it: no traceback either
        line = (f"[resil] patch: {patch.package} {installed_version(patch.package)}: '{patch.name}' could "
                f"not be applied ({type(err).__name__}: {err}); it was written for {patch.package} "
                f"{patch.written_for} (docs/patches.md); exiting with code {_EXIT_CODE}")
        _say(line)
        raise UpstreamMismatch(line) from None


def applied() -> tuple[str, ...]:
    """The names of the records applied in this process, for a spawned helper to apply the same."""
    return tuple(name for name, d in _decided.items() if d.verdict == "applied")


def decisions() -> list[dict]:
    """The decisions other than "as expected", for the event log (written once it is configured)."""
    return [{"patch": d.patch.name, "package": d.patch.package, "version": installed_version(d.patch.package),
             "verdict": d.verdict, "message": d.line, **d.details}
            for d in _decided.values() if d.line is not None]


def call_installed(target: str, names: tuple[str, ...], *args):
    """Entry point of a spawned process: apply the records its parent applied (`names`), quietly, before
    `target` ("module:function") and its module are imported, then call it."""
    install(only=names, quiet=True)
    module_name, function = _split(target)
    return getattr(importlib.import_module(module_name), function)(*args)
