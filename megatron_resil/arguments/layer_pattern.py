"""Megatron-LM's per-layer patterns (--moe-layer-freq, --linear-attention-freq): N, or a Python list
expression of 0s and 1s such as "([0]*1+[1]*15)", "[0]*3+[1]*58" or "[1,0,1]". Megatron-LM evaluates the
text; here a small grammar reads it (numbers, lists of 0 and 1, +, * and parentheses), and every list and
number is checked against MAX_LAYERS before it is built, so no text can make parsing spin or allocate."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

MAX_LAYERS = 1 << 14  # more than any model has (arguments/sizes.py bounds --num-layers by it too)
_MAX_NESTING = 32  # parentheses inside each other (a list holds only 0s and 1s)
_MAX_DIGITS = len(str(MAX_LAYERS))
_TOKENS = re.compile(r"\s*(?:([0-9]+)|(\S))")
_FREQUENCY = re.compile(r"\s*\+?([0-9]+)\s*")

Pattern = int | list[int]


class PatternError(ValueError):
    """Why a text is no layer pattern (a clause)."""


def is_value(value) -> bool:
    """`value` (e.g. from a checkpoint's saved arguments) is one a pattern reads as: N in [1, MAX_LAYERS],
    or a list of 1 to MAX_LAYERS 0s and 1s. Checked without building or reading anything."""
    if type(value) is int:
        return 1 <= value <= MAX_LAYERS
    return type(value) is list and 1 <= len(value) <= MAX_LAYERS and \
        all(type(v) is int and v in (0, 1) for v in value)


def parse(text: str) -> Pattern:
    """N (no bracket: as Megatron-LM reads it) or the list the expression makes; raises PatternError."""
    if "[" not in text:
        found = _FREQUENCY.fullmatch(text)
        if found is None:
            raise PatternError("N, or a list expression of 0 and 1 such as ([0]*1+[1]*15)")
        return _number(found.group(1))
    reader = _Reader(text)
    value = reader.expression(0)
    if reader.position < len(reader.tokens):
        raise PatternError(f"unexpected {reader.tokens[reader.position]!r}")
    if not isinstance(value, list) or not value:
        raise PatternError("the expression makes no list of layers")
    return value


def argument_type(name: str) -> Callable[[str], Pattern]:
    """The argparse type of a pattern flag: argparse's error line says `name` and why."""
    def read(text: str) -> Pattern:
        try:
            return parse(text)
        except PatternError as why:
            shown = repr(text[:80]) + ("..." if len(text) > 80 else "")
            raise argparse.ArgumentTypeError(f"invalid {name} value: {shown} ({why})") from None

    read.__name__ = name
    read.accepts = is_value  # what a checkpoint's saved value is checked by (arguments/checkpoint_args.py)
    return read


def _number(digits: str) -> int:
    if len(digits) > _MAX_DIGITS or not 1 <= int(digits) <= MAX_LAYERS:
        shown = digits if len(digits) <= 12 else f"a number of {len(digits)} digits"
        raise PatternError(f"{shown} is not between 1 and {MAX_LAYERS}")
    return int(digits)


class _Reader:
    """expression := term ('+' term)*; term := factor ('*' factor)*;
    factor := NUMBER | '[' (0|1) (',' (0|1))* [','] ']' | '[' ']' | '(' expression ')'."""

    def __init__(self, text: str) -> None:
        self.tokens = [number or char for number, char in _TOKENS.findall(text)]
        self.position = 0

    def _peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def _take(self) -> str:
        token = self._peek()
        if token is None:
            raise PatternError("it ends too early")
        self.position += 1
        return token

    def expression(self, depth: int) -> Pattern:
        value = self._term(depth)
        while self._peek() == "+":
            self._take()
            right = self._term(depth)
            if isinstance(value, list) != isinstance(right, list):
                raise PatternError("+ joins two lists or two numbers")
            _check_size(len(value) + len(right) if isinstance(value, list) else value + right)
            if isinstance(value, list):
                value.extend(right)  # in place: a long sum of short lists stays linear
            else:
                value += right
        return value

    def _term(self, depth: int) -> Pattern:
        value = self._factor(depth)
        while self._peek() == "*":
            self._take()
            right = self._factor(depth)
            if isinstance(value, list) and isinstance(right, list):
                raise PatternError("* repeats a list a number of times")
            length = len(value) if isinstance(value, list) else len(right) if isinstance(right, list) else 1
            times = right if isinstance(value, list) else value if isinstance(right, list) else value * right
            _check_size(length * times)
            value = value * right
        return value

    def _factor(self, depth: int) -> Pattern:
        if depth >= _MAX_NESTING:
            raise PatternError(f"nested more than {_MAX_NESTING} deep")
        token = self._take()
        if token[0] in "0123456789":
            return _number(token)
        if token == "(":
            value = self.expression(depth + 1)
            if self._take() != ")":
                raise PatternError("a ( is not closed")
            return value
        if token == "[":
            return self._list()
        if token == "*":
            raise PatternError("** (a power) is no part of a layer pattern: lists, numbers, + and * only")
        raise PatternError(f"unexpected {token!r}")

    def _list(self) -> list[int]:
        layers: list[int] = []
        while (token := self._take()) != "]":
            if token not in ("0", "1"):
                raise PatternError(f"a list holds 0 (dense) and 1 only, not {token[:8]!r}")
            layers.append(int(token))
            _check_size(len(layers))
            if self._peek() == ",":
                self._take()
            elif self._peek() != "]":
                raise PatternError("list items are separated by commas")
        return layers


def _check_size(size: int) -> None:
    """Before a list of `size` layers (or a number that large) is built."""
    if size > MAX_LAYERS:
        raise PatternError(f"it makes {size} layers, more than any model has ({MAX_LAYERS})")
