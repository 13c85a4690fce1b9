"""What a study maximises: TG, PP, both (a Pareto front), or a user expression such as `tg + 0.1*pp`.

User expressions are parsed with `ast` into a small tree of our own and evaluated without `eval`: only the names
`tg` and `pp` (tokens per second at the study's workload), numbers, `+ - * /`, unary minus and parentheses. Any
other node (a call, an attribute, `**`, a comparison, another name) is an InputError naming what was found.
"""
from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from typing import Literal
from collections.abc import Callable

from ..errors import InputError

ObjectiveKind = Literal["tg", "pp", "both", "expr"]
MAX_EXPR_CHARS = 200
MAX_EXPR_NODES = 64
_NAMES = ("tg", "pp")
_BINOPS: dict[type, Callable[[float, float], float]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b if b != 0 else math.nan,
}
Expr = Callable[[float, float], float]


def _compile(node: ast.AST, text: str, count: list[int]) -> Expr:
    count[0] += 1
    if count[0] > MAX_EXPR_NODES:
        raise InputError(f"--objective {text!r}: too long (more than {MAX_EXPR_NODES} terms)")
    if isinstance(node, ast.Expression):
        return _compile(node.body, text, count)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        op = _BINOPS[type(node.op)]
        left, right = _compile(node.left, text, count), _compile(node.right, text, count)
        return lambda tg, pp: op(left(tg, pp), right(tg, pp))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _compile(node.operand, text, count)
        sign = -1.0 if isinstance(node.op, ast.USub) else 1.0
        return lambda tg, pp: sign * inner(tg, pp)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = float(node.value)
        if not math.isfinite(value):
            raise InputError(f"--objective {text!r}: number {node.value!r} is not finite")
        return lambda tg, pp: value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return (lambda tg, pp: tg) if node.id == "tg" else (lambda tg, pp: pp)
    what = node.id if isinstance(node, ast.Name) else type(node).__name__
    raise InputError(f"--objective {text!r}: {what!r} is not allowed; use tg, pp, numbers, + - * / and "
                     "parentheses, e.g. 'tg + 0.1*pp'")


def _names(tree: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


@dataclass(frozen=True)
class Objective:
    """kind "tg"/"pp": one value, maximised; "both": (tg, pp), both maximised; "expr": expr(tg, pp), maximised."""
    kind: ObjectiveKind
    text: str

    @property
    def n_values(self) -> int:
        return 2 if self.kind == "both" else 1

    @property
    def directions(self) -> list[str]:
        return ["maximize"] * self.n_values

    @property
    def names(self) -> list[str]:
        return ["tg_tps", "pp_tps"] if self.kind == "both" else [self.text]

    def values(self, tg_tps: float, pp_tps: float) -> tuple[float, ...]:
        """The study's values for measured throughputs; NaN where the expression is undefined (x / 0)."""
        if self.kind == "both":
            return (tg_tps, pp_tps)
        if self.kind == "tg":
            return (tg_tps,)
        if self.kind == "pp":
            return (pp_tps,)
        return (_compiled(self.text)(tg_tps, pp_tps),)

    def scalar(self, tg_tps: float, pp_tps: float) -> float:
        """One number to rank by (for "both": the geometric mean, used only for ordering seeds and reports)."""
        if self.kind == "both":
            return math.sqrt(max(tg_tps, 0.0) * max(pp_tps, 0.0))
        return self.values(tg_tps, pp_tps)[0]


_CACHE: dict[str, Expr] = {}


def _compiled(text: str) -> Expr:
    fn = _CACHE.get(text)
    if fn is None:
        fn = _parse_expr(text)
        _CACHE[text] = fn
    return fn


def _parse_expr(text: str) -> Expr:
    if len(text) > MAX_EXPR_CHARS:
        raise InputError(f"--objective: expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:
        raise InputError(f"--objective {text!r}: not an expression ({e.msg if isinstance(e, SyntaxError) else e}); "
                         "use tg, pp, numbers, + - * / and parentheses") from e
    fn = _compile(tree, text, [0])
    if not _names(tree) & set(_NAMES):
        raise InputError(f"--objective {text!r}: mentions neither tg nor pp, so every config would score the same")
    return fn


def parse_objective(text: str) -> Objective:
    """'tg', 'pp', 'both' (or 'pareto', or `plan`'s word 'balanced': the front holds plan's geometric-mean pick),
    or an expression over tg and pp. Raises InputError (one line)."""
    t = (text or "").strip()
    if not t:
        raise InputError("--objective is empty; use tg, pp, both or an expression such as 'tg + 0.1*pp'")
    low = t.lower()
    if low in ("tg", "pp"):
        return Objective(low, low)   # type: ignore[arg-type]
    if low in ("both", "pareto", "balanced"):
        return Objective("both", "both")
    _compiled(t)
    return Objective("expr", t)
