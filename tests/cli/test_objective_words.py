"""One objective vocabulary for plan and tune: plan takes tune's `both` (the geometric mean of PP and TG, the pick
tune's `both` front holds); `balanced`, plan's old word, is read as `both` by plan and by tune."""
from __future__ import annotations

import json

from offload_tuner.app.requests import PlanRequest
from offload_tuner.cli import main
from tuner.objectives import parse_objective

PLAN = ["plan", "preset:Qwen3-30B-A3B", "--gpu", "16GiB", "--ctx", "8192", "--json", "--objective"]


def test_plan_takes_both_and_reads_balanced_as_both(capsys) -> None:
    assert main([*PLAN, "both"]) == 0
    both = json.loads(capsys.readouterr().out)
    assert main([*PLAN, "balanced"]) == 0                 # an old command line
    balanced = json.loads(capsys.readouterr().out)
    assert both["objective"] == balanced["objective"] == "both"
    assert both == balanced
    assert PlanRequest(model="m", objective="balanced").objective == "both"


def test_tune_reads_the_same_words() -> None:
    for word in ("both", "balanced"):
        assert parse_objective(word).kind == "both"
    assert parse_objective("tg").kind == "tg" and parse_objective("pp").kind == "pp"
