"""Fill-in-the-middle samples, as Megatron-LM's --fim-data makes them (its GPTFIMDataset): what one sample
of token ids becomes, and which token ids the FIM sentinels are. data.py's FIMGPTDataset applies it.

A sample (seq_length + 1 ids) is cut at the FIM end-of-document token; each non-empty piece, and the piece
after the last cut, is turned into a FIM one with probability --fim-rate: its text (special tokens left
out) is split at two uniformly drawn character positions into prefix, middle and suffix, each tokenized
again and laid out as SPM (<prefix> <suffix> suffix <middle> prefix middle) with probability --fim-spm-rate,
else PSM (<prefix> prefix <suffix> suffix <middle> middle). With --fim-split-sample, a piece holding that
token is FIM'd (at --fim-rate) fragment by fragment (each at --fim-fragment-rate). The pieces are joined
with the end-of-document token, as in Megatron-LM only after non-empty pieces, then cut or padded with
the FIM pad token back to the sample's length.

One difference, for exact resumption: Megatron-LM draws from one generator per dataset, seeded with --seed,
so a sample's draws depend on which samples that process read before it (and restart with every resumed
job). Here each sample draws from its own generator, seeded with --seed, its split and its index: the same
sample is the same FIM sample in any order, on any rank, before and after a resume.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy

# The FIM tokens by role, and the flag that names each (Megatron-LM's, with its defaults).
FIM_TOKEN_FLAGS = {"prefix": "--fim-prefix-token", "middle": "--fim-middle-token",
                   "suffix": "--fim-suffix-token", "pad": "--fim-pad-token", "eod": "--fim-eod-token"}


class FIMTokenizer(Protocol):
    """What FIM reads of a tokenizer: the ids of named tokens, and text to ids and back."""

    unk_id: int | None

    def token_to_id(self, token: str) -> int | None: ...
    def tokenize(self, text: str) -> list[int]: ...
    def detokenize(self, ids: Iterable[int]) -> str: ...


@dataclass(frozen=True)
class FIMSettings:
    """The FIM flags, with the sentinels as token ids."""

    rate: float
    spm_rate: float
    prefix_id: int
    middle_id: int
    suffix_id: int
    pad_id: int
    eod_id: int
    split_sample_id: int | None = None
    fragment_rate: float | None = None
    no_prefix: str | None = None


class FIMTokenError(ValueError):
    """A FIM token the tokenizer has no id for; the message is one line naming the flag."""


def token_ids(tokenizer: FIMTokenizer, named: dict[str, str]) -> tuple[dict[str, int], list[str]]:
    """The id of each named token {flag: token}, as Megatron-LM looks it up (the tokenizer's
    tokens_to_ids): its vocabulary id, else the tokenizer's unknown-token id. Returns the ids by flag and,
    for a warning, the flags whose token took the unknown id."""
    ids, unknown = {}, []
    for flag, token in named.items():
        found = tokenizer.token_to_id(token)
        if found is None:
            if tokenizer.unk_id is None:
                raise FIMTokenError(f"{flag} {token}: not a token of the tokenizer, which has no unknown "
                                    "token to stand for it; add it with --tokenizer-special-tokens")
            found = tokenizer.unk_id
            unknown.append(f"{flag} {token}")
        ids[flag] = int(found)
    return ids, unknown


def settings_from_args(args: argparse.Namespace, tokenizer: FIMTokenizer) -> tuple[FIMSettings, list[str]]:
    """The FIM settings of the command line, and the flags whose token took the unknown id."""
    named = {flag: getattr(args, flag[2:].replace("-", "_")) for flag in FIM_TOKEN_FLAGS.values()}
    if args.fim_split_sample is not None:
        named["--fim-split-sample"] = args.fim_split_sample
    ids, unknown = token_ids(tokenizer, named)
    role_ids = {role: ids[flag] for role, flag in FIM_TOKEN_FLAGS.items()}
    return FIMSettings(
        rate=args.fim_rate, spm_rate=args.fim_spm_rate, prefix_id=role_ids["prefix"],
        middle_id=role_ids["middle"], suffix_id=role_ids["suffix"], pad_id=role_ids["pad"],
        eod_id=role_ids["eod"], split_sample_id=ids.get("--fim-split-sample"),
        fragment_rate=args.fim_fragment_rate, no_prefix=args.fim_no_prefix), unknown


class FIMTransform:
    """Turns a sample of token ids into its FIM sample of the same length (the module docstring)."""

    def __init__(self, settings: FIMSettings, tokenizer: FIMTokenizer) -> None:
        self.settings = settings
        self.tokenizer = tokenizer

    def __call__(self, sample: numpy.ndarray, rng: numpy.random.RandomState) -> numpy.ndarray:
        eod = self.settings.eod_id
        pieces: list[numpy.ndarray | list[int]] = []
        start = 0
        for cut in numpy.flatnonzero(sample == eod):
            if cut > start:  # an empty piece adds nothing, not even its end-of-document token
                pieces += [self._split_and_permute(sample[start:cut], rng), [eod]]
            start = cut + 1
        pieces.append(self._split_and_permute(sample[start:], rng))
        out = numpy.concatenate(pieces).astype(numpy.int64)
        if len(out) >= len(sample):
            return out[:len(sample)]
        return numpy.concatenate([out, numpy.full(len(sample) - len(out), self.settings.pad_id, numpy.int64)])

    def _split_and_permute(self, piece: numpy.ndarray, rng: numpy.random.RandomState) -> numpy.ndarray:
        split = self.settings.split_sample_id
        cuts = numpy.flatnonzero(piece == split) if split is not None else numpy.empty(0, numpy.int64)
        if not len(cuts):
            return self._permute(piece, self.settings.rate, rng)
        if not rng.binomial(1, self.settings.rate):
            return piece
        fragments: list[numpy.ndarray | list[int]] = []
        start = 0
        for cut in cuts:
            if cut > start:
                fragments += [self._permute(piece[start:cut], self.settings.fragment_rate, rng), [split]]
            start = cut + 1
        fragments.append(self._permute(piece[start:], self.settings.fragment_rate, rng))
        return numpy.concatenate(fragments)

    def _permute(self, ids: numpy.ndarray, rate: float, rng: numpy.random.RandomState) -> numpy.ndarray:
        if not rng.binomial(1, rate):
            return ids
        s = self.settings
        text = self.tokenizer.detokenize(ids)
        if s.no_prefix is not None and text.startswith(s.no_prefix):
            return ids
        # Either boundary may be 0 or len(text), and both may be equal: any part may be empty.
        first, second = sorted(rng.randint(low=0, high=len(text) + 1, size=2))
        prefix, middle, suffix = (numpy.array(self.tokenizer.tokenize(part), dtype=numpy.int64)
                                  for part in (text[:first], text[first:second], text[second:]))
        if rng.binomial(1, s.spm_rate):
            return numpy.concatenate([[s.prefix_id, s.suffix_id], suffix, [s.middle_id], prefix, middle])
        return numpy.concatenate([[s.prefix_id], prefix, [s.suffix_id], suffix, [s.middle_id], middle])


def sample_rng(seed: int, *where: int) -> numpy.random.RandomState:
    """The generator of one sample (`where`: its split and index): its own, so its FIM draws do not depend
    on the order samples are read in."""
    return numpy.random.RandomState([seed, *where])
