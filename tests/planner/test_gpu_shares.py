"""planner.residency.gpu_shares: what a several-GPU plan gives each GPU (blocks, experts, the output layer), as the
reports name it, on the planner's own plan for cards of different sizes."""
from __future__ import annotations

from planner.hardware import GiB, load_hardware
from planner.memory import estimate
from planner.presets import load_preset
from planner.propose import best_plans
from planner.residency import gpu_shares, output_device


def test_the_shares_of_a_mixed_cards_plan_add_up_and_follow_the_cards():
    inv = load_preset("Qwen3-30B-A3B:Q4_K_M").inventory()
    hw = load_hardware("gpu-box").with_vram([b * GiB for b in (16, 8)])
    plan = best_plans(inv, hw)[0].plan
    shares = gpu_shares(inv, plan)
    assert list(shares) == ["CUDA0", "CUDA1"]
    on_gpu = {t.name: t.nbytes for t in inv.allocated() if plan.assignment.get(t.name, "CPU") != "CPU"}
    assert sum(s.expert_bytes + s.other_bytes for s in shares.values()) == sum(on_gpu.values())
    assert sum(s.layers for s in shares.values()) <= inv.n_layer and shares["CUDA1"].layers > 0
    # the output layer on the last GPU that homes blocks (the planner's rule), named on that GPU alone
    assert output_device(inv, plan) == "CUDA1" and [s.device for s in shares.values() if s.output] == ["CUDA1"]
    # the 16 GiB card holds more than the 8 GiB one, each inside its card
    mem = estimate(inv, plan, hw).devices
    assert mem["CUDA0"].total <= 16 * GiB and mem["CUDA1"].total <= 8 * GiB
    total = {d: s.expert_bytes + s.other_bytes for d, s in shares.items()}
    assert total["CUDA0"] > total["CUDA1"]
    assert shares["CUDA1"].words().startswith("CUDA1: ") and shares["CUDA1"].words().endswith("the output layer")
