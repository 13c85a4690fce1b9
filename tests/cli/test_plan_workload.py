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
    # tg, pp or both without a workload: no request times, ranked by the objective as before (with none given at
    # all, plan ranks by the chat workload's request time: test_plan_default_objective.py)
    assert "mean_request_s" not in _plan(capsys, "--objective", "tg")["predicted"]


def _log(tmp_path, requests: list[tuple[int, int]], name: str = "log") -> str:
    """A JSONL request log of (prompt_tokens, completion_tokens) usage lines."""
    f = tmp_path / f"{name}.jsonl"
    f.write_text("".join(json.dumps({"usage": {"prompt_tokens": p, "completion_tokens": g}}) + "\n"
                         for p, g in requests))
    return str(f)


def _ctx(line: str) -> tuple[int, int]:
    argv = line.split()
    return int(argv[argv.index("-c") + 1]), int(argv[argv.index("-np") + 1])


@pytest.mark.parametrize("case, requests", [
    # the 32768 + 192 request alone in its class (the short ones are another class)
    ("alone", [(1000, 50)] * 20 + [(32768, 192)]),
    # the 32768 + 192 request in one class with five 28000 + 160 ones: the class's mean is 28795 + 165
    ("shared", [(1000, 50)] * 20 + [(28000, 160)] * 5 + [(32768, 192)]),
])
def test_the_emitted_context_holds_the_logs_longest_request(tmp_path, capsys, case, requests):
    out = _plan(capsys, "--workload", _log(tmp_path, requests))
    ctx, slots = _ctx(out["commands"]["llama-server"])
    assert slots == 1 and ctx >= 32768 + 192 and ctx % 256 == 0
    assert Plan.from_dict(out["plan"]).knobs.n_ctx == ctx == 33024
    assert not any(w.startswith("W029") for w in out["warnings"])      # 33024 is within Qwen3's 40960


def test_a_request_longer_than_the_training_context_is_one_warning(tmp_path, capsys):
    out = _plan(capsys, "--workload", _log(tmp_path, [(1000, 50)] * 5 + [(50000, 500)], "long"))
    assert _ctx(out["commands"]["llama-server"])[0] >= 50500
    w029 = [w for w in out["warnings"] if w.startswith("W029")]
    assert len(w029) == 1 and "longest request (50500 tokens)" in w029[0] and "40960" in w029[0]
    assert "\n" not in w029[0]
