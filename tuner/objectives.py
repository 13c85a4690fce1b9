"""What a study maximises: the user's workload answered fastest (`time`, the default), TG, PP, both (a Pareto
front), or a user expression such as `tg + 0.1*pp`.

`time` ranks configs by the workload's mean request time (planner/workload.py): each request class takes its new
tokens at the class's PP and its generated tokens at the class's TG. An engine run measures PP and TG once, at the
study's benchmark workload (`bench_for`: the classes' mean new tokens at their mean cached depth); each class's
speeds are those times the cost model's ratio between the class's depth and size and the benchmark's, computed once
per study on the planner's pick for the budget (`request_time`) and stored with the study, so every trial of it,
resumed or not, is scored with the same numbers. The value maximised is the workload's tokens per second (a
request's new and generated tokens over its mean time); reports show the mean request time beside it.

User expressions are parsed with `ast` into a small tree of our own and evaluated without `eval`: only the names
`tg` and `pp` (tokens per second at the study's workload), numbers, `+ - * /`, unary minus and parentheses. Any
other node (a call, an attribute, `**`, a comparison, another name) is an InputError naming what was found.
"""
from __future__ import annotations

import ast
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal
from collections.abc import Callable

from planner.bench_run import BenchRun
from planner.errors import InputError

if TYPE_CHECKING:
    from planner.hardware import HardwareProfile
    from planner.model import ModelInventory
    from planner.plan import Plan
    from planner.workload import RequestClass, Workload

ObjectiveKind = Literal["time", "tg", "pp", "both", "expr"]
BENCH_MAX_GEN = 128        # generated tokens a benchmark run times: TG settles within them
BENCH_MIN_GEN = 16
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
class ClassSpeeds:
    """One request class as the time objective sees it: its share, its tokens, and its PP and TG as multiples of
    the benchmark run's (the cost model's ratio)."""
    weight: float
    new_tokens: int
    gen_tokens: int
    pp_scale: float
    tg_scale: float


TTFT_MISS = 1e-3     # a config over the TTFT limit scores under this (t/s): below any config within it


@dataclass(frozen=True)
class RequestTime:
    """A workload's mean request time as a function of the benchmark run's TG and PP, and its limit on the time
    to first token (tune --ttft), if any."""
    workload: str
    classes: tuple[ClassSpeeds, ...]
    ttft_limit_s: float | None = None

    def ttft_s(self, pp_tps: float) -> float:
        """The slowest class's time to first token: its new tokens at its PP (inf when PP is 0)."""
        worst = 0.0
        for c in self.classes:
            if c.new_tokens:
                pp = pp_tps * c.pp_scale
                worst = max(worst, c.new_tokens / pp if pp > 0 else math.inf)
        return worst

    def mean_s(self, tg_tps: float, pp_tps: float) -> float:
        """Seconds a request takes on average (inf when a speed the workload needs is 0)."""
        total = 0.0
        for c in self.classes:
            pp, tg = pp_tps * c.pp_scale, tg_tps * c.tg_scale
            if (c.new_tokens and pp <= 0) or (c.gen_tokens and tg <= 0):
                return math.inf
            total += c.weight * ((c.new_tokens / pp if c.new_tokens else 0.0) + (c.gen_tokens / tg if c.gen_tokens
                                                                                  else 0.0))
        return total / sum(c.weight for c in self.classes)

    def tokens_per_request(self) -> float:
        return sum(c.weight * (c.new_tokens + c.gen_tokens) for c in self.classes) / sum(c.weight for c in
                                                                                         self.classes)

    def tps(self, tg_tps: float, pp_tps: float) -> float:
        """The workload's tokens per second: what the time objective maximises (0 when it cannot be served). Over
        the TTFT limit: TTFT_MISS x limit / TTFT, so every config within the limit ranks above it, and among those
        over it the quicker first token ranks first (the search is led toward the limit)."""
        s = self.mean_s(tg_tps, pp_tps)
        if not math.isfinite(s) or s <= 0:
            return 0.0
        if self.ttft_limit_s is not None and (first := self.ttft_s(pp_tps)) > self.ttft_limit_s:
            return TTFT_MISS * self.ttft_limit_s / first
        return self.tokens_per_request() / s

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"workload": self.workload, "classes": [vars(c).copy() for c in self.classes]}
        if self.ttft_limit_s is not None:
            d["ttft_limit_s"] = self.ttft_limit_s
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestTime:
        return cls(str(d["workload"]), tuple(ClassSpeeds(**c) for c in d["classes"]), d.get("ttft_limit_s"))


def bench_for(workload: Workload, repetitions: int = 3) -> BenchRun:
    """The benchmark run a study measures for `workload`: its mean new tokens as the prompt, at its mean cached
    depth, and up to BENCH_MAX_GEN generated tokens (TG is per token; more only makes runs longer)."""
    total = sum(c.weight for c in workload.classes)

    def mean(attr: str) -> int:
        return round(sum(c.weight * getattr(c, attr) for c in workload.classes) / total)
    return BenchRun(n_prompt=max(1, mean("new_tokens")), n_gen=min(BENCH_MAX_GEN, max(BENCH_MIN_GEN,
                         mean("gen_tokens"))), depth=mean("cached_tokens"), repetitions=repetitions)


def request_time(inv: ModelInventory, hw: HardwareProfile, plan: Plan, workload: Workload,
                 bench: BenchRun) -> RequestTime:
    """Each class's speeds relative to `bench`'s, by the cost model on `plan`. A class with k requests in flight
    processes their k prompts together and then generates k tokens a step: its PP is the cost model's at k x new
    tokens, its per-request TG the k-token step's rate over k."""
    from planner.cost import predict
    base = predict(inv, plan, hw, n_prompt=max(bench.n_prompt, 1), depth=bench.depth)
    classes = []
    for c in workload.classes:
        pp, tg = class_speeds(inv, hw, plan, c)
        classes.append(ClassSpeeds(float(c.weight), c.new_tokens, c.gen_tokens,
                                   pp / base.pp_tps if base.pp_tps > 0 else 0.0,
                                   tg / base.tg_tps if base.tg_tps > 0 else 0.0))
    return RequestTime(workload.name, tuple(classes), workload.ttft_limit_s)


def class_speeds(inv: ModelInventory, hw: HardwareProfile, plan: Plan, c: RequestClass) -> tuple[float, float]:
    """(PP, TG) per request of one class by the cost model: a class with k requests in flight processes their k
    prompts together (PP at k x new tokens, each request waiting for all) and then generates k tokens a step (its
    per-request TG: the k-token step's rate over k)."""
    from planner.cost import predict
    k = c.in_flight
    pp = predict(inv, plan, hw, n_prompt=max(k * c.new_tokens, 1), depth=c.cached_tokens).pp_tps / k
    at = predict(inv, plan, hw, n_prompt=k, depth=c.prompt_tokens)
    return pp, (at.tg_tps if k == 1 else at.pp_tps / k)


def predicted_request_s(inv: ModelInventory, hw: HardwareProfile, plan: Plan, workload: Workload) -> float:
    """The workload's mean request time by the cost model on `plan` (each class at its own size and depth): what
    `plan --workload` ranks by (inf when a speed a class needs is 0)."""
    def one(c: RequestClass) -> float:
        pp, tg = class_speeds(inv, hw, plan, c)
        if (c.new_tokens and pp <= 0) or (c.gen_tokens and tg <= 0):
            return math.inf
        return (c.new_tokens / pp if c.new_tokens else 0.0) + (c.gen_tokens / tg if c.gen_tokens else 0.0)
    return workload.mean_request_s(one)


@dataclass(frozen=True)
class Objective:
    """kind "time": the workload's tokens per second (`request`, attached by the study), maximised; "tg"/"pp":
    one value, maximised; "both": (tg, pp), both maximised; "expr": expr(tg, pp), maximised."""
    kind: ObjectiveKind
    text: str
    request: RequestTime | None = None

    def with_request(self, request: RequestTime) -> Objective:
        return replace(self, request=request)

    @property
    def n_values(self) -> int:
        return 2 if self.kind == "both" else 1

    @property
    def directions(self) -> list[str]:
        return ["maximize"] * self.n_values

    @property
    def names(self) -> list[str]:
        if self.kind == "time":
            return ["workload_tps"]
        return ["tg_tps", "pp_tps"] if self.kind == "both" else [self.text]

    def values(self, tg_tps: float, pp_tps: float) -> tuple[float, ...]:
        """The study's values for measured throughputs; NaN where the expression is undefined (x / 0)."""
        if self.kind == "time":
            if self.request is None:
                raise InputError("objective time needs the workload's request classes (tune --workload)")
            return (self.request.tps(tg_tps, pp_tps),)
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
    """'time' (the workload's mean request time), 'tg', 'pp', 'both' (or 'pareto', or 'balanced', plan's old
    word: the front holds plan's geometric-mean pick), or an expression over tg and pp. Raises InputError."""
    t = (text or "").strip()
    if not t:
        raise InputError("--objective is empty; use time, tg, pp, both or an expression such as 'tg + 0.1*pp'")
    low = t.lower()
    if low == "time":
        return Objective("time", "time")
    if low in ("tg", "pp"):
        return Objective(low, low)   # type: ignore[arg-type]
    if low in ("both", "pareto", "balanced"):
        return Objective("both", "both")
    _compiled(t)
    return Objective("expr", t)
