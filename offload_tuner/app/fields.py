"""A request's fields as the command line and the HTTP service take them: the kind of value (read from the
dataclass's annotations), the flag that spells it, its help text (the field's metadata), and the one parser of a
value given as text.

cli/ makes its options from these (cli/common.py add_option) and service/ checks a JSON body and writes its
OpenAPI schema with them (service/bodies.py): one spelling of every option, one help text, one wording of every
bad value, wherever the request comes from."""
from __future__ import annotations

import re
import types
from dataclasses import MISSING, dataclass, field, fields
from functools import cache
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from planner.errors import InputError

# str, int, float: one value; bool: a switch (store_true); choice: one of a Literal's values; list: a tuple of
# strings (a comma list on the command line); other: no flag or key (a study spec's space limits)
Kind = Literal["str", "int", "float", "bool", "choice", "list", "other"]
# a number as text: ASCII digits only (int() and float() would also take '1_000', '٣', ' 5 ', 'nan' and 'inf');
# the service's schema gives the same patterns for a number sent as text
INT_TEXT = r"[+-]?[0-9]+"
FLOAT_TEXT = r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?"


def opt(default: Any = MISSING, *, help: str, flag: str | None = None, choices: tuple[str, ...] = ()) -> Any:
    """A request field with its help text (the CLI's --help and the service's schema both show it), its flag
    where the field's name is not the flag's (timeout_s is --timeout), and its choices where a table elsewhere
    holds them (an engine name: planner.engines' registry) rather than a Literal."""
    return field(default=default, metadata={"help": help, **({"flag": flag} if flag else {}),
                                            **({"choices": tuple(choices)} if choices else {})})


@dataclass(frozen=True)
class Option:
    """One field of a request, as a flag or a JSON key."""
    name: str                       # the dataclass field: the JSON key
    flag: str                       # as the command line spells it: --n-prompt
    kind: Kind
    choices: tuple[str, ...]        # for kind choice
    help: str
    required: bool                  # the dataclass has no default for it

    def parse(self, text: str) -> Any:
        """TEXT as the field's value; an InputError worded as argparse words its own type errors."""
        if self.kind == "int":
            try:
                if re.fullmatch(INT_TEXT, text):
                    return int(text)
            except ValueError:                   # over Python's 4300 digits
                pass
            raise InputError(f"invalid int value: {text[:60]!r}")
        if self.kind == "float":
            if not re.fullmatch(FLOAT_TEXT, text):
                raise InputError(f"invalid float value: {text[:60]!r}")
            return float(text)
        if self.kind == "choice" and text not in self.choices:
            raise InputError(f"invalid choice: {text!r} (choose from {', '.join(map(repr, self.choices))})")
        return text


def _kind(tp: Any) -> tuple[Kind, tuple[str, ...]]:
    if get_origin(tp) in (Union, types.UnionType):           # X | None: the X
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) != 1:
            return "other", ()
        tp = args[0]
    if tp is bool:                     # before int: a bool is an int
        return "bool", ()
    if tp in (int, float, str):
        return tp.__name__, ()
    if get_origin(tp) is Literal:
        return "choice", tuple(get_args(tp))
    if get_origin(tp) is tuple and get_args(tp) == (str, ...):
        return "list", ()
    return "other", ()


@cache
def options(cls: type) -> dict[str, Option]:
    """CLS's fields as options, in the order the dataclass declares them."""
    hints = get_type_hints(cls)
    out = {}
    for f in fields(cls):
        kind, choices = ("choice", f.metadata["choices"]) if "choices" in f.metadata else _kind(hints[f.name])
        out[f.name] = Option(name=f.name, flag=f"--{f.metadata.get('flag', f.name.replace('_', '-'))}", kind=kind,
                             choices=choices, help=f.metadata.get("help", ""),
                             required=f.default is MISSING and f.default_factory is MISSING)
    return out
