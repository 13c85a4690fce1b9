"""What more than one command uses: options made from a request's fields, requests made from parsed flags, JSON
out, the layer table."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..app.explain import layer_summary
from ..app.fields import Option, options
from planner.errors import InputError


def emit_json(obj: object) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def _typed(o: Option):
    """argparse's type= for option O: the request's own parser (offload_tuner/app/fields.py), so a bad value reads the
    same here and over HTTP (`argument --ctx: invalid int value: 'abc'`)."""
    def parse(text: str) -> Any:
        try:
            return o.parse(text)
        except InputError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = o.kind
    return parse


def add_option(p: argparse.ArgumentParser, cls: type, name: str, **kw: Any) -> argparse.Action:
    """The flag of request CLS's field NAME: its spelling, type or choices and help come from the request; its
    default is None (False for a switch), so a flag counts only when given and the request's default applies."""
    o = options(cls)[name]
    if o.kind == "bool":
        return p.add_argument(o.flag, dest=name, action="store_true", help=o.help or None, **kw)
    if o.kind in ("int", "float", "choice"):
        kw.setdefault("type", _typed(o))
    if o.kind == "choice":
        kw.setdefault("metavar", "{" + ",".join(o.choices) + "}")
    elif o.flag[2:] != name.replace("_", "-"):          # --timeout for timeout_s: shown as TIMEOUT
        kw.setdefault("metavar", o.flag[2:].replace("-", "_").upper())
    return p.add_argument(o.flag, dest=name, help=o.help or None, **kw)


def add_positional(p: argparse.ArgumentParser, cls: type, name: str, **kw: Any) -> argparse.Action:
    return p.add_argument(name, help=options(cls)[name].help or None, **kw)


def given(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of request CLS that ARGS gives: not None, and switches only when on."""
    return {n: v for n in options(cls) if (v := getattr(args, n, None)) is not None and v is not False}


def request(cls: type, ns: argparse.Namespace, /, **extra: Any) -> Any:
    """Request CLS from the parsed flags NS (and EXTRA, what the flags do not carry), over its defaults."""
    return cls(**{**given(cls, ns), **extra})


def print_layers(inv, assignment: dict[str, str]) -> None:
    from planner.tables import table
    out_dev = assignment.get("output.weight", assignment.get("output_norm.weight", "CPU"))
    rows = [["token_embd", assignment.get("token_embd.weight", "CPU"), "-"], ["output", out_dev, "-"]]
    for r in layer_summary(inv, assignment):
        span = f"blk {r['first']}" if r["first"] == r["last"] else f"blk {r['first']}-{r['last']}"
        exps = ", ".join(f"{k}:{v}" for k, v in r["experts"].items()) or "-"
        rows.append([span, "/".join(r["dense"]), exps])
    print(table(["layers", "attn+dense on", "experts (up/gate/down)"], rows, right=set()))


def add_hw(p: argparse.ArgumentParser, cls: type) -> None:
    add_option(p, cls, "gpu")
    add_option(p, cls, "hardware")
    add_option(p, cls, "ram", metavar="SIZE")


def add_build(p: argparse.ArgumentParser, cls: type) -> None:
    add_option(p, cls, "build", metavar="DIALECT:N|PATH")
