"""Typed choices: a config key whose value is one of a fixed set is a ``Choice`` (an Enum that is
also a str), so OmegaConf refuses any other value when the config is composed, and ``choice_error``
turns that refusal into the one line every bad value gets.

Each member's name is its value (``adam = "adam"``): OmegaConf looks a typed value up by name and
writes the name into the resolved config.yaml, so the file keeps the lowercase strings users type
and the workers, which read it as plain strings, compare with strings as before.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

from omegaconf.errors import ValidationError
from omegaconf.nodes import EnumNode


class Choice(str, Enum):
    """A value from a fixed set, printed as itself (Python 3.11 prints a str-Enum as 'Class.member')."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


def make_choice(name: str, values: Iterable[str], doc: str, module: str) -> type[Choice]:
    """A Choice whose members are ``values``: for a set kept elsewhere (pp's schedule table) or a
    value class syntax cannot name (``raise``, ``1f1b``)."""
    made = Choice(name, [(value, value) for value in values], module=module)
    made.__doc__ = doc
    return made


class Precision(Choice):
    """Compute precision of a strategy that has a bf16 mode (and of trainer.precision)."""

    fp32 = "fp32"
    bf16 = "bf16"


def choice_error(exc: BaseException, prefix: str = "") -> str | None:
    """OmegaConf's refusal of a value for a Choice-typed key as one line naming the key, the value
    and the choices (None: exc is no such refusal). prefix: where the refusing node sits in the
    whole config ("strategy." for a strategy's Options checked on their own)."""
    node = getattr(exc, "child_node", None)
    if not isinstance(exc, ValidationError) or not isinstance(node, EnumNode) or not exc.full_key:
        return None
    key, names = prefix + exc.full_key, [member.name for member in node.enum_type]
    listed = f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]
    return f"{key}={exc.value} is unknown; use {key}={listed}"
