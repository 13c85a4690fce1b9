"""Placements: budgets respected, homes contiguous, filling orders, and the error for budgets nothing fits in."""
from __future__ import annotations

from dataclasses import replace

import pytest

from planner.errors import BudgetError
from planner.hardware import GiB, MiB, from_gpu_sizes
from planner.memory import estimate
from planner.plan import Knobs, Plan
from planner.presets import load_preset
from planner.propose import Room, best_plans, fill_experts, layer_order, propose, proposals, split_homes

from tiny import f32_inventory, qwen3moe_spec


def test_split_homes_contiguous_and_proportional():
    assert split_homes(6, 0, ["CUDA0"]) == ["CPU"] * 6
    assert split_homes(6, 4, ["CUDA0"]) == ["CPU", "CPU"] + ["CUDA0"] * 4
    assert split_homes(8, 8, ["CUDA0", "CUDA1"], [3.0, 1.0]) == ["CUDA0"] * 6 + ["CUDA1"] * 2


def test_layer_orders():
    layers = list(range(8))
    assert layer_order(layers, "first") == layers
    assert layer_order(layers, "last") == layers[::-1]
    spread = layer_order(layers, "spread")
    assert sorted(spread) == layers and spread[:2] == [0, 4]


@pytest.mark.parametrize("preset,gpus", [("Qwen3-30B-A3B", "16GiB"), ("DeepSeek-V3", "24GiB"),
                                         ("GLM-4.5-Air", "24GiB,16GiB"), ("gpt-oss-120b", "12GiB")])
def test_every_proposal_fits_and_places_every_tensor(preset, gpus):
    inv = load_preset(preset).inventory()
    hw = from_gpu_sizes(gpus)
    budget = Room.from_hardware(hw)
    plans = propose(inv, hw, Knobs(n_ctx=8192))
    assert plans
    names = {t.name for t in inv.allocated()}
    for p in plans:
        assert set(p.assignment) == names
        assert p.assignment["token_embd.weight"] == "CPU"
        assert budget.fits(estimate(inv, p, hw)), p.label
        homes = [p.assignment[f"blk.{i}.attn_norm.weight"] for i in range(inv.n_layer - inv.hparams.n_nextn)]
        first_gpu = next((i for i, h in enumerate(homes) if h != "CPU"), len(homes))
        assert all(h == "CPU" for h in homes[:first_gpu]) and all(h != "CPU" for h in homes[first_gpu:])


def test_filling_uses_the_budget_and_beats_experts_on_cpu():
    inv = load_preset("Qwen3-30B-A3B").inventory()
    hw = from_gpu_sizes("16GiB")
    ranked = best_plans(inv, hw, Knobs(n_ctx=8192))
    best = ranked[0]
    used = estimate(inv, best.plan, hw).devices["CUDA0"].total
    assert 14 * GiB < used <= 16 * GiB - 512 * MiB
    cpu_only_experts = next(s for s in ranked if s.plan.label == "experts-cpu")
    assert best.tg_tps > cpu_only_experts.tg_tps


def test_budget_nothing_fits_in_raises():
    inv = load_preset("Qwen3-30B-A3B").inventory()
    with pytest.raises(BudgetError, match="nothing fits on the GPU"):
        propose(inv, from_gpu_sizes("700MiB"), Knobs(n_ctx=8192))


def test_proposals_carry_the_parameters_their_labels_are_made_of():
    inv = load_preset("Qwen3-30B-A3B").inventory()
    hw = from_gpu_sizes("16GiB")
    props = proposals(inv, hw, Knobs(n_ctx=8192))
    assert [p.plan for p in props] == propose(inv, hw, Knobs(n_ctx=8192))
    assert [p.label for p in props] == [p.plan.label for p in props] == \
        ["experts-cpu+fill-first", "experts-cpu+fill-last", "experts-cpu+fill-spread", "experts-cpu",
         f"layers-{props[-1].n_gpu_layers}"]
    fills = [p for p in props if p.strategy == "experts-cpu+fill"]
    assert [p.order for p in fills] == ["first", "last", "spread"]
    assert all(p.n_gpu_layers == inv.n_layer for p in props[:4])      # every layer homed, experts to fill
    assert 0 < props[-1].n_gpu_layers < inv.n_layer                     # whole layers: as many as fit in 16 GiB
    ranked = best_plans(inv, hw, Knobs(n_ctx=8192))
    assert all(s.plan is s.proposal.plan and s.plan.label == s.proposal.label for s in ranked)


def test_a_partial_layer_keeps_ik_fused_up_and_gate_together():
    """ik runs up and gate as one MOE_FUSED_UP_GATE where the up experts are: an up on the GPU without its gate
    would copy the gate into the GPU's compute buffer. Mainline fills down, up, gate one at a time."""
    inv = f32_inventory(qwen3moe_spec())
    base = Plan("tiny", {t.name: "CPU" if t.is_expert or t.role == "token_embd" else "CUDA0"
                         for t in inv.allocated()}, Knobs(n_ctx=512), "mainline")
    one = 32 * 1024                                 # each expert tensor of a tiny layer (tiny.py)

    def layer0(plan):
        used = estimate(inv, plan).devices["CUDA0"].total
        a = fill_experts(inv, plan, Room({"CUDA0": used + 2 * one + one // 2}, 1 << 40), None, "first").assignment
        return {r: a[f"blk.0.ffn_{r}_exps.weight"] for r in ("down", "up", "gate")}

    assert layer0(base) == {"down": "CUDA0", "up": "CUDA0", "gate": "CPU"}
    ik = replace(base, dialect="ik")
    assert layer0(ik) == {"down": "CUDA0", "up": "CPU", "gate": "CPU"}
    # -no-fmoe: ik's up and gate are two MUL_MAT_IDs again, filled one at a time
    assert layer0(replace(ik, knobs=replace(ik.knobs, fmoe=False))) == {"down": "CUDA0", "up": "CUDA0", "gate": "CPU"}
