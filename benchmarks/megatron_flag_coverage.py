"""How many of Megatron-LM's own GPT and MoE training command lines pretrain.py accepts whole.

Reads, from a copy of Megatron-LM's source (a checkout, or a bare git directory such as the one the
`fetch` tool leaves), the MODEL_ARGS of its functional tests' training configs
(tests/functional_tests/test_cases/{gpt,moe}/*/model_config.yaml; inference and RL configs left out), with
each config's ENV_VARS and the world size its CI job runs it at (nodes x GPUs of the recipe under
tests/test_utils/recipes that lists it; a config no recipe lists is judged at --world-size, the CI machine's
8 GPUs), and the command lines of its example pretraining scripts (their exported environment, and the
world size their torchrun is given), then takes each through pretrain.py's start-up, in-process:

    python benchmarks/megatron_flag_coverage.py /path/to/Megatron-LM [--cpu] [--json FILE]

A command line is "accepted whole" when, with its environment and at its world size, it passes every
start-up check up to the built model: the arguments (no flag dropped with a warning), the patches
(`patches.install`), megatron-core's own checks of the configs built from them (TransformerConfig,
OptimizerConfig, DistributedDataParallelConfig), and, where its layers can be built on this machine
(`--transformer-impl local`), the model itself, on the meta device, for the first and the last rank of a
world of that size. Transformer Engine's layers need CUDA and Transformer Engine itself: a config using
them is checked up to megatron-core's configs, and the report counts those apart.

By default the checks are made as on a GPU host with Transformer Engine (the configs are GPU runs): of the
version Megatron-LM's pyproject.toml pins (its `tool.uv.dependency-metadata`), so the version checks, ours
and megatron-core's, run; and Apex's fused kernels, as in the NGC PyTorch container its CI runs in. --cpu
checks as on this machine. Kernel packages a GPU host installs apart from Transformer Engine
(flash-linear-attention for gated delta net, fast-hadamard-transform for sparse attention) are looked for as
they are here: a config needing one that is missing is refused with a reason naming it, and a second figure
counts the configs accepted whole if the GPU host also has them.

Paths in the command lines are placeholders: `${VAR}` becomes a directory under a scratch root, and the
files a flag must name (data prefixes, vocabulary, merges, tokenizer model) are created empty, except those
start-up reads: GPT-2's vocabulary and merges as the smallest valid ones, and the tokenizer model as a tiny
SentencePiece model. A refused command line is tried again (at the same world size) without the flag its
refusal names, until it passes, to list every flag it needed dropped; the report counts those flags and the
reasons given.
"""

from __future__ import annotations

import argparse
import base64
import collections
import contextlib
import io
import itertools
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_resil import arguments, patches  # noqa: E402
from megatron_resil.arguments.data import BUILT_TOKENIZERS  # noqa: E402
from megatron_resil.checkpointing import take_from_checkpoint  # noqa: E402

CONFIG_GLOB = ("tests/functional_tests/test_cases/gpt/*/model_config.yaml",
               "tests/functional_tests/test_cases/moe/*/model_config.yaml")
NOT_TRAINING_MODES = ("inference", "rl")
# The example pretraining scripts the issue names, each with the positional arguments it expects
# ("{root}" is the scratch root).
EXAMPLES = {
    "examples/gpt3/train_gpt3_175b_distributed.sh":
        ["{root}/ckpt", "{root}/tensorboard", "{root}/gpt2-vocab.json", "{root}/gpt2-merges.txt",
         "{root}/data/corpus_text_document"],
    "examples/llama/train_llama3_8b_h100_fp8.sh": ["{root}/ckpt", "{root}/tensorboard"],  # mock data
    "examples/mixtral/train_mixtral_8x7b_distributed.sh":
        ["{root}/ckpt", "{root}/tokenizer.model", "{root}/data/corpus_text_document"],
}
# With --pending-as-built, a command line using a tokenizer not built here (BERT, multimodal, SFT) is judged
# with a stand-in (NullTokenizer), and one in samples in iterations, so the report shows what else stands
# in its way.
TOKENIZER_FLAGS = ("--tokenizer-type", "--vocab-file", "--merge-file", "--tokenizer-model",
                   "--tiktoken-pattern",
                   "--vocab-size")
SAMPLE_FLAGS = {"--train-samples": "--train-iters", "--lr-decay-samples": "--lr-decay-iters",
                "--lr-warmup-samples": "--lr-warmup-iters"}
# Flags whose value names a file that must exist (created empty here); --data-path names prefixes.
FILE_FLAGS = ("--vocab-file", "--merge-file", "--tokenizer-model")
GPT2_FILES = {"--vocab-file": '{"<|endoftext|>": 0}', "--merge-file": "#version: 0.2\n"}
# Configs outside what issue 24 asks for, reported apart (the share over all configs is printed too):
# ModelOpt distillation is a feature of another program than GPT pretraining (NVIDIA ModelOpt's knowledge
# distillation, Megatron-LM's --export-* flags); and a command line Megatron-LM's own parser refuses as its
# test harness passes it is not one a user can run there either.
OTHER_PROGRAMS = {"--export-kd-cfg", "--export-kd-teacher-load", "--export-te-mcore-model"}
# (the flag refused, words of our refusal line) -> why Megatron-LM refuses the same command line
MEGATRON_LM_REFUSES = {
    ("--hierarchical-context-parallel-sizes", "invalid int value"):
        "its harness passes '2 2' as one word, and Megatron-LM's argparse (nargs='+', type=int) refuses it",
    ("--use-torch-fsdp2", "needs --untie-embeddings-and-output-weights"):
        "its validate_args asserts '--use-torch-fsdp2 requires --untie-embeddings-and-output-weights'",
}
_FLAG = re.compile(r"--[a-zA-Z0-9][a-zA-Z0-9_-]*")
_VAR = re.compile(r"\$\{(\w+)\}|\$(\w+)")


@dataclass
class CommandLine:
    source: str  # config or script, relative to the snapshot
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # its ENV_VARS, or what the script exports
    world_size: int | None = None  # None: --world-size
    world_size_from: str = ""  # the recipe or the torchrun arguments it comes from


@dataclass
class Verdict:
    source: str
    accepted: bool
    world_size: int = 0
    unknown: list[str] = field(default_factory=list)  # flags our parser does not know
    refused: list[tuple[str, str]] = field(default_factory=list)  # (flag, the line it was refused with)
    dropped: list[str] = field(default_factory=list)  # warning lines: a flag given, ignored
    model_built: bool = False  # the last check was building the model (else: megatron-core's configs)


# --- reading Megatron-LM's command lines ---------------------------------------------------------------

def snapshot_tree(path: Path, scratch: Path) -> tuple[Path, str]:
    """A directory holding the snapshot's tests/ and examples/, and the commit measured."""
    if (path / "tests" / "functional_tests").is_dir():
        commit = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or "unknown (not a git checkout)"
        return path, commit
    git = ["git", "--git-dir", str(path)]
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
    tree = scratch / "megatron-lm"
    tree.mkdir()
    wanted = [p for p in ("tests/functional_tests/test_cases", RECIPES, "examples", "pyproject.toml")
              if subprocess.run([*git, "cat-file", "-e", f"HEAD:{p}"], capture_output=True).returncode == 0]
    archive = subprocess.run([*git, "archive", "HEAD", *wanted], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree, commit.strip()


RECIPES = "tests/test_utils/recipes"
# Where a test case is listed by several recipes, the first of these platforms' (its main CI).
RECIPE_PREFERENCE = ("h100", "a100", "gb200")


def recipe_jobs(tree: Path) -> dict[str, tuple[int, int, str]]:
    """Each GPT and MoE test case the CI recipes list: (nodes, GPUs per node, the recipe's path) of its job,
    as tests/test_utils/python_scripts/recipe_parser.py reads them (the spec's nodes and gpus, which a
    product may override)."""
    found: dict[str, list[tuple[int, int, str]]] = collections.defaultdict(list)

    def walk(products, nodes: int, gpus: int, recipe: str) -> None:
        for product in products or []:
            n, g = product.get("nodes", nodes), product.get("gpus", gpus)
            cases = product.get("test_case", [])
            for case in cases if isinstance(cases, list) else [cases]:
                found[case].append((n, g, recipe))
            walk(product.get("products"), n, g, recipe)

    for path in sorted((tree / RECIPES).glob("**/*.yaml")):
        recipe = yaml.safe_load(path.read_text()) or {}
        spec = recipe.get("spec", {})
        if spec.get("model") in ("gpt", "moe"):
            walk(recipe.get("products"), spec.get("nodes", 1), spec.get("gpus", 8),
                 str(path.relative_to(tree)))

    def preference(entry: tuple[int, int, str]) -> int:
        platform = Path(entry[2]).parent.name
        return RECIPE_PREFERENCE.index(platform) if platform in RECIPE_PREFERENCE else len(RECIPE_PREFERENCE)

    return {case: min(entries, key=preference) for case, entries in found.items()}


# Variables of the CI scripts that hold a number, not a path.
NUMBERS = {"REPEAT": "1"}


def _placeholder(value: str, root: Path) -> str:
    def substitute(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        return NUMBERS.get(name, str(root / name))
    return _VAR.sub(substitute, value)


def config_command_lines(tree: Path, root: Path) -> list[CommandLine]:
    """Each training config's MODEL_ARGS (and MODEL_ARGS_2, ... for its later runs), turned into a command
    line as tests/functional_tests/shell_test_utils/_run_training.sh does: `true` is the bare flag, an
    empty value drops the flag, a list is its items; with its ENV_VARS and its CI job's world size: the
    recipe's nodes x GPUs per node, the latter as run_ci_test.sh sets it for a run that names its own
    (MODEL_ENV_VARS.<run>.GPUS_PER_NODE)."""
    jobs = recipe_jobs(tree)
    lines = []
    for pattern in CONFIG_GLOB:
        for path in sorted(tree.glob(pattern)):
            config = yaml.safe_load(path.read_text())
            if config.get("MODE") in NOT_TRAINING_MODES or not config.get("MODEL_ARGS"):
                continue
            for key in sorted(k for k in config if re.fullmatch(r"MODEL_ARGS(_\d+)?", k)):
                argv: list[str] = []
                for flag, value in config[key].items():
                    if value is True:
                        argv.append(flag)
                    elif value == "" or value is None:
                        continue
                    elif isinstance(value, list):
                        argv += [flag, *(_placeholder(str(v), root) for v in value)]
                    else:
                        text = _placeholder(str(value), root)
                        if re.fullmatch(r"\[[^]]+\]", text):  # "[a b]" is passed as the words a b
                            argv += [flag, *text[1:-1].split()]
                        else:
                            argv += [flag, text]
                source = str(path.parent.relative_to(tree))
                env = {name: str(value) for name, value in (config.get("ENV_VARS") or {}).items()}
                nodes, gpus, recipe = jobs.get(path.parent.name, (None, None, ""))
                run_gpus = ((config.get("MODEL_ENV_VARS") or {}).get(key) or {}).get("GPUS_PER_NODE")
                if run_gpus is not None:
                    nodes, gpus = nodes or 1, int(run_gpus)
                    recipe = f"{recipe or 'no recipe'}; MODEL_ENV_VARS.{key}.GPUS_PER_NODE {run_gpus}"
                lines.append(CommandLine(source if key == "MODEL_ARGS" else f"{source} ({key})", argv, env,
                                         nodes * gpus if nodes else None, recipe))
    return lines


def example_command_lines(tree: Path, root: Path) -> list[CommandLine]:
    """Run each example script with bash, torchrun replaced by a function that writes its arguments and the
    environment the script exported; the world size is torchrun's --nproc_per_node x --nnodes."""
    lines = []
    for script, positional in EXAMPLES.items():
        work = root / "example_cwd"
        work.mkdir(exist_ok=True)
        (work / "pretrain_gpt.py").write_text("")
        out = work / "argv.json"
        capture = ('torchrun() { python3 -c "import json,os,sys; json.dump([sys.argv[1:], dict(os.environ)], '
                   f"open('{out}', 'w'))\" \"$@\"; }}; source \"$0\" \"$@\"")
        arguments_given = [p.format(root=root) for p in positional]
        given_env = {**os.environ, "WANDB_API_KEY": ""}
        subprocess.run(["bash", "-c", capture, str(tree / script), *arguments_given],
                       cwd=work, capture_output=True, text=True, env=given_env)
        argv, seen_env = json.loads(out.read_text())
        out.unlink()
        script_at = argv.index("pretrain_gpt.py") if "pretrain_gpt.py" in argv else \
            next(i for i, a in enumerate(argv) if a.endswith("pretrain_gpt.py"))
        exported = {k: v for k, v in seen_env.items() if given_env.get(k) != v and not k.startswith("BASH")
                    and k not in ("SHLVL", "_", "PWD", "OLDPWD")}
        launcher = argv[:script_at]
        size = _count(_value(launcher, "--nproc_per_node") or _value(launcher, "--nproc-per-node")) * \
            _count(_value(launcher, "--nnodes"))
        lines.append(CommandLine(script, argv[script_at + 1:], exported, size,
                                 f"torchrun {' '.join(launcher)}".strip()))
    return lines


@cache
def sentencepiece_model() -> bytes:
    """A tiny SentencePiece model (empty where the sentencepiece package is missing)."""
    try:
        import sentencepiece
    except ImportError:
        return b""
    with tempfile.TemporaryDirectory() as directory:
        corpus = Path(directory) / "corpus.txt"
        corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 10)
        sentencepiece.SentencePieceTrainer.train(input=str(corpus), model_prefix=f"{directory}/sp",
                                                 vocab_size=30, model_type="bpe", minloglevel=2)
        return Path(f"{directory}/sp.model").read_bytes()


def tiktoken_vocab(size: int) -> bytes:
    """Megatron's tiktoken vocabulary of `size` tokens (what start-up reads: the format and the count): the
    256 bytes, then distinct two- and three-byte strings."""
    longer = (bytes(t) for n in (2, 3) for t in itertools.product(range(256), repeat=n))
    tokens = [*(bytes([b]) for b in range(256)), *itertools.islice(longer, max(0, size - 256))]
    return json.dumps([{"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": ""}
                       for i, t in enumerate(tokens)]).encode()


def huggingface_tokenizer(directory: Path) -> None:
    """A tokenizer directory AutoTokenizer loads: a word-level vocabulary of <|endoftext|> alone."""
    directory.mkdir(parents=True, exist_ok=True)
    try:
        import tokenizers
    except ImportError:
        return
    tokenizers.Tokenizer(tokenizers.models.WordLevel({"<|endoftext|>": 0}, unk_token="<|endoftext|>")).save(
        str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))


def create_named_files(argv: list[str], root: Path) -> None:
    """The files the command line names (under the scratch root) exist: empty, except those start-up
    reads: GPT-2's vocabulary and merges (the smallest: <|endoftext|> alone, no merges) and the tokenizer
    model (a SentencePiece model, a tiktoken vocabulary of the size asked for, or a Hugging Face
    tokenizer directory)."""
    def touch(path: str, data: bytes = b"") -> None:
        if path.startswith(str(root)):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_bytes(data)

    kind = _value(argv, "--tokenizer-type")
    for i, arg in enumerate(argv[:-1]):
        if arg == "--tokenizer-model" and kind == "HuggingFaceTokenizer":
            if argv[i + 1].startswith(str(root)):
                huggingface_tokenizer(Path(argv[i + 1]))
        elif arg == "--tokenizer-model" and kind == "TikTokenizer":
            size = int(_value(argv, "--vocab-size") or 2**17)
            specials = int(_value(argv, "--tiktoken-num-special-tokens") or 1000)
            touch(argv[i + 1], tiktoken_vocab(size - specials))
        elif arg in FILE_FLAGS:
            touch(argv[i + 1], sentencepiece_model() if arg == "--tokenizer-model"
                  else GPT2_FILES.get(arg, "").encode())
        if arg == "--data-path":
            for value in argv[i + 1:]:
                if value.startswith("--"):
                    break
                if not re.fullmatch(r"[\d.]+", value):
                    touch(value + ".bin")
                    touch(value + ".idx")


# --- running our parser ----------------------------------------------------------------------------------

def transformer_engine_version(tree: Path) -> str | None:
    """The Transformer Engine version Megatron-LM's CI installs, as its pyproject.toml pins it for uv
    (`[[tool.uv.dependency-metadata]]`, name transformer-engine), or None."""
    import tomllib

    path = tree / "pyproject.toml"
    if not path.is_file():
        return None
    metadata = tomllib.loads(path.read_text()).get("tool", {}).get("uv", {}).get("dependency-metadata", [])
    return next((entry.get("version") for entry in metadata if entry.get("name") == "transformer-engine"),
                None)


@contextlib.contextmanager
def gpu_host(te_version: str | None):
    """Start-up asks `cuda_available()` and `transformer_engine_available()`, our checks the Transformer
    Engine version, model.py which fused kernels are installed, and megatron-core's config checks the
    Transformer Engine version and whether its kernels (fused rotary embedding, permutation, ...) exist:
    answer as a GPU host with Transformer Engine `te_version` (None: unknown, its version checks are
    skipped) and Apex, as Megatron-LM's CI container is. Only those questions are answered; the code that
    asks them is the installed one."""
    from packaging.version import Version

    from megatron_resil import model

    te = tuple(int(part) for part in te_version.split("+")[0].split(".")[:2]) if te_version else None
    answers = {"cuda_available": lambda: True, "transformer_engine_available": lambda: True,
               "_transformer_engine_version": lambda: te}
    patched = [(module, attr, getattr(module, attr)) for name, module in list(sys.modules.items())
               if name.startswith("megatron_resil.arguments") for attr in answers if hasattr(module, attr)]
    kernels = model.FusedKernels(gradient_accumulation=True, masked_softmax=True, transformer_engine=True)
    fusions = model.fusions
    patched += [(model.FusedKernels, "installed", model.FusedKernels.__dict__["installed"]),
                (model, "fusions", fusions)]
    for module, attr, _ in patched:
        if attr in answers:
            setattr(module, attr, answers[attr])
    model.FusedKernels.installed = classmethod(lambda cls: kernels)
    model.fusions = lambda args, cuda, installed: fusions(args, True, installed)
    absent: list[tuple] = []
    if te_version is not None:
        from megatron.core import utils

        patched.append((utils, "get_te_version", utils.get_te_version))
        utils.get_te_version = lambda: Version(te_version.split("+")[0])
        for module, name in _transformer_engine_kernels():
            if not hasattr(module, name):
                absent.append((module, name))
            elif getattr(module, name) is None:
                patched.append((module, name, None))
            else:
                continue
            setattr(module, name, _transformer_engine_kernel(name))
    try:
        yield
    finally:
        for module, attr, original in patched:
            setattr(module, attr, original)
        for module, name in absent:
            delattr(module, name)


def _transformer_engine_kernels() -> list[tuple]:
    """The kernels megatron-core's config checks import by name to see whether Transformer Engine has them
    (its fused rotary embedding, permutation, ...): (module, name), each `fused_*` name the check imports
    from a megatron-core module."""
    import importlib
    import inspect

    from megatron.core.transformer import transformer_config

    found = []
    source = inspect.getsource(transformer_config)
    for module_name, names in re.findall(r"from (megatron\.core\.[\w.]+) import \(([^)]*)\)", source):
        module = importlib.import_module(module_name)
        found += [(module, name) for name in re.findall(r"\bfused_\w+", names)]
    return found


def _transformer_engine_kernel(name: str):
    def kernel(*args, **kwargs):
        raise RuntimeError(f"{name} is Transformer Engine's kernel: not run by this benchmark")
    return kernel


def megatron_lm_packages(tree: Path) -> set[str]:
    """The distributions Megatron-LM's pyproject.toml lists in any of its optional-dependency groups
    (`training`: wandb; `dev`: emerging_optimizers, fast-hadamard-transform; `ssm`: flash-linear-attention,
    ...), names normalized: what its own CI host and its users' installs have."""
    import tomllib

    project = tomllib.loads((tree / "pyproject.toml").read_text()).get("project", {})
    groups = project.get("optional-dependencies", {})
    return {re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")
            for requirements in groups.values() for requirement in requirements}


# The distribution a module the start-up checks ask for comes from, where the names differ.
MODULE_DISTRIBUTION = {"fla": "flash-linear-attention"}


@contextlib.contextmanager
def kernel_packages_installed(listed: set[str]):
    """Validation asks `package_available(module)` for the packages a feature needs (kernels, wandb, ...):
    answer that each is installed where Megatron-LM's own pyproject lists its distribution (`listed`), and
    yield the set of modules asked for (clear it between command lines)."""
    asked: set[str] = set()

    def installed(module: str) -> bool:
        asked.add(module)
        return MODULE_DISTRIBUTION.get(module, module).lower().replace("_", "-") in listed

    patched = [(module, module.package_available) for name, module in list(sys.modules.items())
               if name.startswith("megatron_resil.arguments") and hasattr(module, "package_available")]
    for module, _ in patched:
        module.package_available = installed
    try:
        yield asked
    finally:
        for module, original in patched:
            module.package_available = original


# Warnings that say a flag the command line gave was ignored: such a command line is not accepted whole.
DROPPED = ("; ignored without CUDA", "; ignored: the installed ")


@dataclass
class Attempt:
    refusal: str | None  # the one line pretrain.py would print; None: accepted
    dropped: list[str] = field(default_factory=list)  # warning lines of flags ignored
    model_built: bool = False


@contextlib.contextmanager
def environment(env: dict[str, str]):
    """The command line's own environment variables over this process's, while it is judged; rank 0's, so
    its warnings are printed."""
    saved = dict(os.environ)  # start-up sets some itself (--attention-backend: NVTE_*_ATTN)
    os.environ.update({**env, "RANK": "0"})
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _start_up(argv: list[str], world_size: int) -> Attempt:
    """pretrain.py's start-up up to the built model: arguments, patches, megatron-core's configs, the model
    (where its layers can be built here)."""
    said = io.StringIO()
    dropped: list[str] = []
    with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
        try:
            args = arguments.parse_args(argv, world_size=world_size, saved_args=take_from_checkpoint)
            dropped = [line for line in said.getvalue().splitlines()
                       if line.startswith("pretrain.py: warning:") and any(d in line for d in DROPPED)]
            patches.install(args, quiet=True)
            return Attempt(None, dropped, megatron_core_checks(args, world_size))
        except patches.UpstreamMismatch as stop:
            return Attempt(stop.line, dropped)
        except SystemExit as stop:
            if stop.code == 0:
                return Attempt(None, dropped)
            errors = [line for line in said.getvalue().splitlines() if "error:" in line]
            return Attempt(errors[-1] if errors else f"exit code {stop.code}", dropped)
        except Exception as err:  # noqa: BLE001 - megatron-core's checks raise what they raise; one line each
            text = " ".join(str(err).split()) or type(err).__name__
            return Attempt(f"pretrain.py: error: megatron-core refuses it: {type(err).__name__}: {text}",
                           dropped)


def megatron_core_checks(args: argparse.Namespace, world_size: int) -> bool:
    """megatron-core's own checks of what pretrain.py builds from `args`: its configs, then the model of the
    first and the last rank, on the meta device, in a world of `world_size` whose collectives are not run.
    Whether the model was built: not with Transformer Engine's layers (or an experimental attention
    variant's, which are Transformer Engine's), which need CUDA and Transformer Engine itself."""
    from megatron_resil import model, optimizer

    model.transformer_config(args)  # its refusal: one line and exit 2, as at start-up
    optimizer.ddp_config(args)
    optimizer.optimizer_config(args)
    if args.transformer_impl != "local" or args.experimental_attention_variant is not None:
        return False
    for rank in sorted({0, world_size - 1}):
        build_on_meta(args, world_size, rank)
    return True


def build_on_meta(args: argparse.Namespace, world_size: int, rank: int) -> None:
    """The model chunks of `rank`, on the meta device (nothing allocated), megatron-core's groups built in a
    fake world of `world_size` (torch's fake process group: no collective runs)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_resil import model, parallel
    from megatron_resil.tokenizer import build_tokenizer

    vocab_size = build_tokenizer(args).vocab_size
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        groups = argparse.Namespace(**vars(args))
        groups.use_gloo_process_groups = False  # no gloo groups in a fake world
        parallel.initialize(groups)
        on_meta = argparse.Namespace(**vars(args))
        on_meta.use_cpu_initialization = True  # no device of its own: the meta device below
        with torch.device("meta"):
            model.build_model_chunks(on_meta, vocab_size)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _drop(argv: list[str], flag: str) -> list[str]:
    """argv without `flag` and the values after it."""
    out, skipping = [], False
    for arg in argv:
        if arg == flag:
            skipping = True
            continue
        if skipping and not _FLAG.fullmatch(arg):
            continue
        skipping = False
        out.append(arg)
    return out


def _value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv and argv.index(flag) + 1 < len(argv) else None


def with_pending_as_built(argv: list[str]) -> list[str]:
    """The command line with stand-ins for what items 2 and 3 build: a NullTokenizer of the same size
    instead of a tokenizer not built yet, and sample counts turned into iterations of the global batch."""
    out = list(argv)
    gpt2_default = "GPT2BPETokenizer" if "--vocab-file" in out and "--merge-file" in out else "NullTokenizer"
    if (_value(out, "--tokenizer-type") or gpt2_default) not in BUILT_TOKENIZERS:
        vocab = _value(out, "--vocab-size") or "128000"
        for flag in TOKENIZER_FLAGS:
            out = _drop(out, flag)
        out += ["--tokenizer-type", "NullTokenizer", "--vocab-size", vocab]
    batch = int(_value(out, "--global-batch-size") or 1)
    for samples_flag, iters_flag in SAMPLE_FLAGS.items():
        samples = _value(out, samples_flag)
        if samples is not None:
            out = _drop(out, samples_flag)
            if int(samples):
                out += [iters_flag, str(max(1, int(samples) // batch))]
    return out


def judge(line: CommandLine, fallback_world_size: int, parser: argparse.ArgumentParser) -> Verdict:
    """The command line through start-up at its world size (`fallback_world_size` where no recipe gives
    one), with its environment; refused, again without the flag its refusal names, until it passes."""
    world_size = line.world_size or fallback_world_size
    known = {option for action in parser._actions for option in action.option_strings}
    present = [a for a in line.argv if _FLAG.fullmatch(a)]
    verdict = Verdict(line.source, accepted=False, world_size=world_size,
                      unknown=sorted({f for f in present if f not in known}))
    argv = line.argv
    for flag in verdict.unknown:
        argv = _drop(argv, flag)
    with environment(line.env):
        for _ in range(len(present) + 1):
            attempt = _start_up(argv, world_size)
            verdict.dropped += [d for d in attempt.dropped if d not in verdict.dropped]
            verdict.model_built = attempt.model_built
            if attempt.refusal is None:
                break
            named = [f for f in _FLAG.findall(attempt.refusal) if f in argv]
            if not named:  # a check of a default: report the line itself
                verdict.refused.append((attempt.refusal.removeprefix("pretrain.py: error: "),
                                        attempt.refusal))
                break
            verdict.refused.append((named[0], attempt.refusal))
            argv = _drop(argv, named[0])
    verdict.accepted = not verdict.unknown and not verdict.refused and not verdict.dropped
    return verdict


def _count(value: str | None) -> int:
    """A launcher's process or node count ("2", or torchrun's "MIN:MAX" for nodes: the most)."""
    if not value:
        return 1
    return int(value.split(":")[-1])


def _out_of_scope(verdict: Verdict) -> str | None:
    """Why a refused command line is outside issue 24's scope, or None. Only when everything refused in it
    is (a flag refused because an out-of-scope one was dropped counts with it): a config refused for
    anything else as well counts as refused."""
    refused = [(f, "") for f in verdict.unknown] + verdict.refused
    if not refused:
        return None
    if all(f in OTHER_PROGRAMS for f, _ in refused):
        return "ModelOpt distillation (a feature of another program)"
    def megatron_lm_refuses(flag: str, line: str) -> str | None:
        return next((why for (key, words), why in MEGATRON_LM_REFUSES.items()
                     if flag == key and words in line), None)

    reasons = {why for f, line in refused for why in [megatron_lm_refuses(f, line)] if why}
    # a flag refused only because one Megatron-LM refuses was dropped (its line names it) counts with it
    if reasons and all(megatron_lm_refuses(f, line) or any(key in line for key, _ in MEGATRON_LM_REFUSES)
                       for f, line in refused):
        return "Megatron-LM refuses it too: " + "; ".join(sorted(reasons))
    return None


def report(verdicts: list[Verdict], commit: str, host: str, lines: list[CommandLine], top: int,
           pending_as_built: bool, with_packages: dict[str, set[str]]) -> dict:
    """`with_packages`: the command lines refused here but accepted whole if the kernel packages named
    (module names) were installed too."""
    configs = [v for v in verdicts if not v.source.startswith("examples/")]
    examples = [v for v in verdicts if v.source.startswith("examples/")]
    # A config with several runs (MODEL_ARGS_2, ...) is accepted when all of them are.
    by_config: dict[str, bool] = {}
    for v in configs:
        name = v.source.split(" (")[0]
        by_config[name] = by_config.get(name, True) and v.accepted
    flags = collections.Counter()
    reasons: dict[str, str] = {}
    for v in verdicts:
        for flag in v.unknown:
            flags[flag] += 1
            reasons.setdefault(flag, "unknown flag")
        for flag, line in v.refused:
            flags[flag] += 1
            reasons.setdefault(flag, line.removeprefix("pretrain.py: error: "))
    accepted = sum(by_config.values())
    out_of_scope = {name: why for v in configs if not v.accepted
                    for name in [v.source.split(" (")[0]] for why in [_out_of_scope(v)] if why}
    in_scope = {name: ok for name, ok in by_config.items() if name not in out_of_scope}
    from_recipes = collections.Counter(v.world_size for v, line in zip(verdicts, lines, strict=True)
                                       if line.world_size is not None and v in configs)
    fallback = collections.Counter(v.world_size for v, line in zip(verdicts, lines, strict=True)
                                   if line.world_size is None and v in configs)
    built = {v.source.split(" (")[0] for v in configs if v.accepted and v.model_built}
    summary = {
        "megatron_lm_commit": commit,
        "checked_as": host + (", tokenizers and sample-based training as if built" if pending_as_built
                              else ""),
        "world_sizes": {"from_ci_recipes": dict(from_recipes), "no_recipe_lists_it": dict(fallback)},
        "configs": len(by_config),
        "configs_accepted_whole": accepted,
        "configs_accepted_whole_model_built": len(built & {n for n, ok in by_config.items() if ok}),
        "configs_dropping_flags": {v.source: v.dropped for v in configs if v.dropped},
        "share": round(accepted / max(len(by_config), 1), 4),
        "configs_out_of_scope": out_of_scope,
        "share_in_scope": round(sum(in_scope.values()) / max(len(in_scope), 1), 4),
        "examples": {v.source: {"accepted": v.accepted, "unknown": v.unknown,
                                "refused": [f for f, _ in v.refused]} for v in examples},
        "refused_flags": [{"flag": f, "command_lines": n, "first_reason": reasons[f]}
                          for f, n in flags.most_common()],
        "configs_refused": {name: [*v.unknown, *(f for f, _ in v.refused)] for v in configs
                            if not v.accepted for name in [v.source]},
        "world_size_of": {line.source: [v.world_size, line.world_size_from or "--world-size"]
                          for v, line in zip(verdicts, lines, strict=True)},
    }
    known: dict[str, bool] = {}
    for v in configs:
        name = v.source.split(" (")[0]
        parsed = not v.unknown and not any(line.split("error: ")[-1].startswith("argument ")
                                           for _, line in v.refused)
        known[name] = known.get(name, True) and parsed
    summary["configs_all_flags_known"] = sum(known.values())
    whole_with_packages: dict[str, bool] = {}
    for v in configs:
        name = v.source.split(" (")[0]
        whole_with_packages[name] = whole_with_packages.get(name, True) and (v.accepted
                                                                             or v.source in with_packages)
    packages = collections.Counter(module for v in configs if v.source in with_packages
                                   for module in sorted(with_packages[v.source]))
    summary["configs_accepted_whole_with_kernel_packages"] = sum(whole_with_packages.values())
    with_packages_in_scope = {name: ok for name, ok in whole_with_packages.items()
                              if name not in out_of_scope}
    summary["share_in_scope_with_kernel_packages"] = round(
        sum(with_packages_in_scope.values()) / max(len(with_packages_in_scope), 1), 4)
    summary["kernel_packages"] = dict(packages)
    print(f"Megatron-LM {commit}, checked as on {summary['checked_as']}")
    sizes = ", ".join(f"{n} at {size}" for size, n in sorted(from_recipes.items()))
    print(f"world sizes: from Megatron-LM's CI recipes {sizes or 'none'}; "
          + (f"{sum(fallback.values())} no recipe lists, at {', '.join(map(str, sorted(fallback)))} "
             "(--world-size)" if fallback else "every config listed"))
    print(f"functional-test training configs (gpt, moe) whose every flag our parser knows (name and value): "
          f"{sum(known.values())}/{len(known)} = {100 * sum(known.values()) / max(len(known), 1):.1f}%")
    print(f"functional-test training configs (gpt, moe) accepted whole: {accepted}/{len(by_config)} "
          f"= {100 * summary['share']:.1f}% (every start-up check up to the model; the model itself built "
          f"on the meta device for the {summary['configs_accepted_whole_model_built']} of them on "
          "megatron-core's local layers: Transformer Engine's need CUDA)")
    if summary["configs_dropping_flags"]:
        print(f"  not counted: {len(summary['configs_dropping_flags'])} accepted only with a flag ignored "
              "(--json: configs_dropping_flags)")
    left_out = "; ".join(f"{name.split('/')[-1]}: {why}" for name, why in out_of_scope.items()) or "none"
    print(f"  of those in scope ({len(out_of_scope)} left out: {left_out}): "
          f"{sum(in_scope.values())}/{len(in_scope)} = {100 * summary['share_in_scope']:.1f}%")
    if packages:
        needed = ", ".join(f"{module} for {n}" for module, n in packages.most_common())
        print(f"  ... accepted whole on a GPU host that also has the packages Megatron-LM's pyproject.toml "
              f"lists for them (module {needed}): "
              f"{summary['configs_accepted_whole_with_kernel_packages']}/{len(by_config)}; in scope "
              f"{sum(with_packages_in_scope.values())}/{len(with_packages_in_scope)} = "
              f"{100 * summary['share_in_scope_with_kernel_packages']:.1f}%")
    for v in examples:
        state = "accepted" if v.accepted else \
            f"refused: {', '.join([*v.unknown, *(f for f, _ in v.refused)])}"
        print(f"{v.source}: {state}")
    if flags:
        print("\nmost frequent refused flags (command lines; first reason):")
        for flag, n in flags.most_common(top):
            print(f"  {n:4d}  {flag}: {reasons[flag]}")
        if len(flags) > top:
            print(f"  ... and {len(flags) - top} more (--top N, or --json)")
    return summary


def main() -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("megatron_lm", type=Path, help="a Megatron-LM checkout or bare git directory")
    cli.add_argument("--world-size", type=int, default=8,
                     help="for the configs no CI recipe lists (default: Megatron-LM's CI machine, 8 GPUs)")
    cli.add_argument("--cpu", action="store_true", help="check as on this machine, not as on a GPU host")
    cli.add_argument("--top", type=int, default=40, help="how many refused flags to list")
    cli.add_argument("--json", type=Path, help="write the full report here")
    cli.add_argument("--pending-as-built", action="store_true",
                     help="judge tokenizers (issue 24 item 2) and sample-based training (item 3) as if "
                          "built: "
                          "a NullTokenizer and iterations stand in for them")
    opts = cli.parse_args()
    logging.getLogger("megatron.core").setLevel(logging.ERROR)  # its deprecation notes, per model built
    scratch = Path(tempfile.mkdtemp(prefix="flag_coverage_"))
    try:
        tree, commit = snapshot_tree(opts.megatron_lm.resolve(), scratch)
        root = scratch / "placeholders"
        root.mkdir()
        lines = config_command_lines(tree, root) + example_command_lines(tree, root)
        for line in lines:
            create_named_files(line.argv, root)
            if opts.pending_as_built:
                line.argv = with_pending_as_built(line.argv)
        parser = arguments.build_parser()
        te_version = None if opts.cpu else transformer_engine_version(tree)
        host = "this host" if opts.cpu else "a GPU host with Transformer Engine " \
            f"{te_version or '(its version not pinned by the snapshot)'} and Apex"
        with_packages: dict[str, set[str]] = {}
        # Paths a config names inside Megatron-LM (--tp-comm-overlap-cfg) are relative to its root, where
        # its CI runs them.
        with gpu_host(te_version) if not opts.cpu else contextlib.nullcontext(), contextlib.chdir(tree):
            verdicts = [judge(line, opts.world_size, parser) for line in lines]
            if not opts.cpu:  # the refused ones again, as if the GPU host had every kernel package
                with kernel_packages_installed(megatron_lm_packages(tree)) as asked:
                    for line, verdict in zip(lines, verdicts, strict=True):
                        asked.clear()
                        if not verdict.accepted and judge(line, opts.world_size, parser).accepted and asked:
                            with_packages[line.source] = set(asked)
        summary = report(verdicts, commit, host, lines, opts.top, opts.pending_as_built, with_packages)
        if opts.json:
            opts.json.write_text(json.dumps(summary, indent=1) + "\n")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
