"""A request's fields as the command line and the HTTP service take them: the kind of value (read from the
dataclass's annotations), the flag that spells it, its help text (the field's metadata), the one parser of a
value given as text, and a number's range (Bounds: the request checks it itself, check_bounds from its
__post_init__, so a value from a flag, a JSON body, a study spec or Python is refused alike).

cli/ makes its options from these (cli/common.py add_option) and service/ checks a JSON body and writes its
OpenAPI schema with them (service/bodies.py): one spelling of every option, one help text, one wording of every
bad value, wherever the request comes from."""
from __future__ import annotations

import math
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


@dataclass(frozen=True)
class Bounds:
    """The range of a number field: lo..hi (lo itself excluded when `above`), finite; `why` says where hi comes
    from. Checked by the request itself (check_bounds, from its __post_init__), so a flag, a JSON body and a study
    spec are refused alike."""
    lo: float
    hi: float
    above: bool = False
    why: str = ""

    def check(self, flag: str, v: Any) -> None:
        if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
            return
        shown = _shown(v)
        if isinstance(v, float) and not math.isfinite(v):
            raise InputError(f"{flag} {shown}: give a finite number, {'above' if self.above else 'at least'} "
                             f"{_shown(self.lo)} and at most {_shown(self.hi)}")
        if v < self.lo or (self.above and v == self.lo):
            raise InputError(f"{flag} must be {'above' if self.above else '>='} {_shown(self.lo)}, got {shown}"
                             if self.lo not in (0, 1) or self.above else
                             f"{flag} must be {'positive' if self.lo == 1 else '>= 0'}, got {shown}")
        if v > self.hi:
            raise InputError(f"{flag} {shown}: at most {_shown(self.hi)}" + (f" ({self.why})" if self.why else ""))


def _shown(v: int | float) -> str:
    """A number as a message shows it: whole numbers without a fraction, at most 40 characters."""
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        v = int(v)
    if isinstance(v, int) and v.bit_length() > 128:
        return f"{'-' if v < 0 else ''}(a {v.bit_length()}-bit number)"
    return str(v)[:40]


def opt(default: Any = MISSING, *, help: str, flag: str | None = None, choices: tuple[str, ...] = (),
        bounds: Bounds | None = None) -> Any:
    """A request field with its help text (the CLI's --help and the service's schema both show it), its flag
    where the field's name is not the flag's (timeout_s is --timeout), its choices where a table elsewhere
    holds them (an engine name: planner.engine_registry' registry) rather than a Literal, and a number's range."""
    return field(default=default, metadata={"help": help, **({"flag": flag} if flag else {}),
                                            **({"choices": tuple(choices)} if choices else {}),
                                            **({"bounds": bounds} if bounds else {})})


@dataclass(frozen=True)
class Option:
    """One field of a request, as a flag or a JSON key."""
    name: str                       # the dataclass field: the JSON key
    flag: str                       # as the command line spells it: --n-prompt
    kind: Kind
    choices: tuple[str, ...]        # for kind choice
    help: str
    required: bool                  # the dataclass has no default for it
    bounds: Bounds | None = None    # a number's range (int, float)

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
                             required=f.default is MISSING and f.default_factory is MISSING,
                             bounds=f.metadata.get("bounds"))
    return out


def check_bounds(request: Any) -> None:
    """Every number field of REQUEST within its Bounds (an InputError naming the flag, the value and the range);
    the requests call it from __post_init__."""
    for name, o in options(type(request)).items():
        if o.bounds is not None:
            o.bounds.check(o.flag, getattr(request, name))
