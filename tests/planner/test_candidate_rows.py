"""No duplicate rows in plan's candidate table (issue 40 item 11): a switch that changes nothing for a placement
(op offload with every weight on the GPU, mmap once op offload is off) does not make another candidate."""
from __future__ import annotations

from offload_tuner import cli
from offload_tuner.app.plan import plan_outcome
from offload_tuner.app.requests import PlanRequest
from planner.hardware import GiB, load_hardware
from planner.loader import load_model
from planner.propose import best_plans, distinct


def _row(s) -> tuple:
    return (s.plan.label, tuple(sorted((d, m.total) for d, m in s.memory.devices.items() if d != "CPU")),
            round(s.pp_tps, 1), round(s.tg_tps, 2))


def test_a_model_all_on_the_gpu_is_one_row_not_four():
    inv = load_model("preset:Qwen3-30B-A3B")
    ranked = best_plans(inv, load_hardware("rtx4090-ddr5").with_vram([24 * GiB]))
    # every layer's weights on the GPU (token_embd stays on the CPU, as llama.cpp keeps it): op offload on/off and
    # mmap yes/no are four plans with the same numbers
    def on_gpu(s) -> bool:
        return all(d != "CPU" for t, d in s.plan.assignment.items() if t != "token_embd.weight")
    full = [s for s in ranked if on_gpu(s)]
    assert len(full) == 4 and len({_row(s) for s in full}) == 1
    kept = [s for s in distinct(ranked) if on_gpu(s)]
    assert len(kept) == 1
    k = kept[0].plan.knobs          # the one with the default flags: op offload on, mmap
    assert k.offload.any_enabled and k.mmap


def test_what_differs_in_its_numbers_stays():
    inv = load_model("preset:Qwen3-30B-A3B")
    ranked = best_plans(inv, load_hardware("rtx4090-ddr5").with_vram([8 * GiB]))
    kept = distinct(ranked)
    assert [_row(s) for s in kept] == list(dict.fromkeys(_row(s) for s in ranked))   # one per row, in rank order
    assert len(kept) < len(ranked)
    # op offload on with and without mmap predict different PP (pinned uploads): both stay
    spread_on = [s for s in kept if s.plan.label.endswith("spread") and s.plan.knobs.offload.any_enabled]
    assert {s.plan.knobs.mmap for s in spread_on} == {True, False}


def test_plans_table_and_json_have_no_repeated_row(capsys):
    o = plan_outcome(PlanRequest(model="preset:Qwen3-30B-A3B", gpu="24GiB"))
    assert len({_row(s) for s in o.ranked}) == len(o.ranked)
    assert cli.main(["plan", "preset:Qwen3-30B-A3B", "--gpu", "24GiB", "--top", "20"]) == 0
    out = capsys.readouterr().out
    rows = out[out.index("candidate "):].splitlines()[2:]
    assert len(rows) == len(set(rows)) == len(o.ranked)
