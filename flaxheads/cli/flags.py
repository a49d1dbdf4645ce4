"""Argument parsing shared by the subcommands: a parser whose errors are :class:`UsageError`
(one line, exit 2, no usage dump) and ``type=`` checkers that refuse out-of-range numbers while
the flags are parsed, before any work starts."""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from typing import Any

from flaxheads.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Program:
    """What the ``flaxheads`` process knows of itself, handed to each subcommand with its flags:
    when it started and its compile cache (``flaxheads.runtime.compile_cache``)."""

    started: float
    compile_cache: Any = None


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` that raises :class:`UsageError` instead of printing the usage
    and exiting; ``flaxheads`` prints the message as one ``error:`` line and exits 2."""

    def error(self, message: str):
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _number(kind: type, test: Callable[[float], bool], expected: str) -> Callable[[str], float]:
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not math.isfinite(value) or not test(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    parse.__name__ = expected  # argparse names the type in some messages
    return parse


positive_int = _number(int, lambda v: v >= 1, "a positive integer")
non_negative_int = _number(int, lambda v: v >= 0, "an integer >= 0")
positive_float = _number(float, lambda v: v > 0, "a number > 0")
non_negative_float = _number(float, lambda v: v >= 0, "a number >= 0")
unit_fraction = _number(float, lambda v: 0 <= v <= 1, "a number from 0 to 1")
below_one = _number(float, lambda v: 0 <= v < 1, "a number >= 0 and < 1")
open_unit = _number(float, lambda v: 0 < v < 1, "a number between 0 and 1 (exclusive)")


def positive_ints(text: str) -> tuple[int, ...]:
    """``"512,256"`` -> ``(512, 256)``: comma-separated positive integers."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers (e.g. 512,256), got {text!r}")
    return values


def split_fractions(text: str) -> tuple[float, float, float]:
    """``"0.8,0.1,0.1"`` -> train, validation, test fractions: three numbers >= 0 summing to 1, train > 0."""
    parts = text.split(",")
    try:
        values = tuple(float(x) for x in parts)
    except ValueError:
        values = ()
    if len(values) != 3 or not all(math.isfinite(v) and v >= 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"expected three comma-separated fractions train,validation,test (e.g. 0.8,0.1,0.1), got {text!r}"
        )
    if abs(sum(values) - 1.0) > 1e-6 or values[0] == 0:
        raise argparse.ArgumentTypeError(
            f"the fractions must sum to 1 with a train fraction > 0, got {text!r} (sum {sum(values):g})"
        )
    return values


def step_spec(text: str) -> int | str:
    """A checkpoint step: an integer >= 0, ``latest`` or ``best``."""
    if text in ("latest", "best"):
        return text
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a step number, 'latest' or 'best', got {text!r}")


def names(text: str) -> tuple[str, ...]:
    """``"sport,tech"`` -> ``("sport", "tech")``: comma-separated names, none empty or repeated."""
    values = tuple(x.strip() for x in text.split(","))
    if len(values) < 2 or not all(values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(
            f"expected two or more distinct comma-separated names (e.g. sport,tech), got {text!r}"
        )
    return values


# ---- --chat-template (rank, predict, serve) -----------------------------------------------------------
def add_chat_template_flag(p: argparse.ArgumentParser, auto: str) -> None:
    """``--chat-template auto|on|off``: text pairs as conversations in the tokenizer's chat template (a reward
    model's input); ``auto``: what it means for this command."""
    p.add_argument(
        "--chat-template",
        choices=("auto", "on", "off"),
        default="auto",
        help="write each (prompt, response) text pair as a conversation in the tokenizer's chat template, as a "
        f"reward model reads it (default auto: {auto})",
    )


def chat_template_wanted(args: argparse.Namespace, clf: Any, *, reward_model: bool) -> bool:
    """Whether ``--chat-template`` turns chat templates on for ``clf`` (a :class:`~flaxheads.predict.Classifier`):
    the library's decision, :meth:`~flaxheads.predict.Classifier.wants_chat_template`."""
    return clf.wants_chat_template(args.chat_template, reward_model=reward_model)
