"""`plan --workload`: the candidates ranked by the workload's predicted mean request time, the emitted context
holding its longest request in each slot."""
from __future__ import annotations

import json

import pytest

from offload_tuner import cli
from offload_tuner.app.common import hardware
from planner.loader import load_model
from planner.plan import Plan
from tuner.objectives import predicted_request_s
from planner.workload import preset

MODEL = "preset:Qwen3-30B-A3B:Q4_K_M"


def _plan(capsys, *extra: str) -> dict:
    assert cli.main(["plan", MODEL, "--gpu", "12GiB", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_ranks_by_the_workloads_request_time_and_sizes_the_context(capsys):
    out = _plan(capsys, "--workload", "rag")
    assert out["workload"] == "rag" and out["objective"] == "time, workload rag"
    times = [out["predicted"]["mean_request_s"]] + [a["mean_request_s"] for a in out["alternatives"]]
    assert times == sorted(times) and len(times) > 3
    # the number is the cost model's, class by class, on the plan printed
    plan = Plan.from_dict(out["plan"])
    inv, hw = load_model(MODEL), hardware(None, "12GiB")
    assert out["predicted"]["mean_request_s"] == pytest.approx(predicted_request_s(inv, hw, plan, preset("rag")))
    assert plan.knobs.n_ctx == 16640 and plan.knobs.n_seq == 1          # rag: 16384 + 250 tokens, whole 256s
    assert "-c 16640" in out["commands"]["llama-server"]
    # four requests in flight: four slots, each holding the longest request
    assert "-np 4" in _plan(capsys, "--workload", "batch")["commands"]["llama-server"]
    # without a workload: no request times, ranked by the objective as before
    assert "mean_request_s" not in _plan(capsys)["predicted"]
