"""The --objective parser: the four kinds, values, and hostile input rejected as one-line InputErrors."""
from __future__ import annotations

import math

import pytest

from planner.errors import InputError
from planner.tuner.objectives import MAX_EXPR_CHARS, parse_objective


@pytest.mark.parametrize("text,kind,n", [("tg", "tg", 1), ("PP", "pp", 1), ("both", "both", 2), ("pareto", "both", 2),
                                         ("tg + 0.1*pp", "expr", 1), ("(tg+pp)/2", "expr", 1),
                                         ("-tg + 2*pp", "expr", 1)])
def test_kinds(text, kind, n):
    o = parse_objective(text)
    assert o.kind == kind and o.n_values == n and o.directions == ["maximize"] * n


def test_values():
    assert parse_objective("tg").values(10.0, 100.0) == (10.0,)
    assert parse_objective("pp").values(10.0, 100.0) == (100.0,)
    assert parse_objective("both").values(10.0, 100.0) == (10.0, 100.0)
    assert parse_objective("tg + 0.1*pp").values(10.0, 100.0) == (20.0,)
    assert parse_objective("(tg - 2) * (pp / 50)").values(10.0, 100.0) == (16.0,)
    assert parse_objective("+tg - -pp").values(1.0, 2.0) == (3.0,)
    assert math.isnan(parse_objective("tg / (pp - 100)").values(10.0, 100.0)[0])   # x / 0: undefined, not a crash
    assert parse_objective("both").scalar(4.0, 9.0) == pytest.approx(6.0)            # geometric mean for ranking


@pytest.mark.parametrize("text", [
    "__import__('os').system('echo hi')", "open('/etc/passwd')", "tg.real", "tg ** 2", "tg if pp else 0",
    "tg == pp", "[tg, pp]", "lambda: tg", "'tg'", "x + tg", "tg; pp", "tg +", "", "   ", "1 + 2", "True + tg",
    "1e999 * tg", "tg and pp", "tg[0]", "f'{tg}'", "tg @ pp", "tg // 2", "tg % 2", "~tg", "not tg",
    "(" * 30 + "tg" + ")" * 30 + "+" + "+".join(["tg"] * 40), "tg" + " + tg" * (MAX_EXPR_CHARS // 5),
])
def test_hostile_expressions_are_one_line_input_errors(text):
    with pytest.raises(InputError) as e:
        parse_objective(text)
    assert "\n" not in str(e.value)
