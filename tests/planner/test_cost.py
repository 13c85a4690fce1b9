"""Cost model: the roofline terms behave as the physics says (hand-checkable tiny cases, monotonicity)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from planner.cost import LLAMACPP, distinct_expert_fraction, predict
from planner.cost_terms import Term
from planner.hardware import load_hardware
from planner.plan import Knobs, OffloadPolicy, Plan
from planner.presets import load_preset
from planner.propose import assignment_from_homes

from tiny import f32_inventory, qwen3moe_spec


def test_distinct_expert_fraction():
    assert distinct_expert_fraction(128, 8, 1) == pytest.approx(8 / 128)
    assert distinct_expert_fraction(128, 8, 4096) == pytest.approx(1.0)
    # 2 tokens each picking 8 of 128: 1 - (120/128)^2
    assert distinct_expert_fraction(128, 8, 2) == pytest.approx(1 - (120 / 128) ** 2)


def _plans(inv, gpu_layers_experts: int):
    """All layers homed on CUDA0, experts of the last `gpu_layers_experts` MoE layers on CUDA0 too."""
    homes = ["CUDA0"] * inv.n_layer
    a = assignment_from_homes(inv, homes, "CUDA0", "CPU")
    moe = inv.moe_layers()
    for il in moe[len(moe) - gpu_layers_experts:]:
        for t in inv.by_layer[il]:
            if t.is_expert:
                a[t.name] = "CUDA0"
    return Plan("m", a, Knobs(n_ctx=4096))


def test_tg_improves_monotonically_as_experts_move_to_the_gpu():
    inv = load_preset("Qwen3-30B-A3B").inventory()
    hw = load_hardware("rtx4090-ddr5")
    tgs = [predict(inv, _plans(inv, k), hw).tg_tps for k in (0, 12, 24, 36, 48)]
    assert tgs == sorted(tgs) and tgs[-1] > 2 * tgs[0]


def test_all_gpu_tg_is_bytes_over_bandwidth_plus_launches():
    inv = f32_inventory(qwen3moe_spec())
    hw = load_hardware("gpu-box")
    plan = Plan("t", {t.name: ("CPU" if t.role == "token_embd" else "CUDA0") for t in inv.allocated()},
                Knobs(n_ctx=256))
    p = predict(inv, plan, hw)
    g = hw.gpus[0]
    expert_bytes = sum(t.nbytes for t in inv.allocated() if t.is_expert) * 2 / 4        # 2 of 4 experts
    other = sum(t.nbytes for t in inv.allocated() if not t.is_expert and t.role != "token_embd")
    gpu_read = (expert_bytes + other) / (g.mem_bw * hw.overheads.gpu_eff)
    assert p.tg_terms[Term("read", "CUDA0")] == pytest.approx(gpu_read)
    # a real MoE layer's graph nodes take tg_gpu_op_scale x calibrate's trivial node (fitted on all-GPU H100 runs)
    assert p.tg_terms[Term("launch")] == pytest.approx(2 * hw.overheads.per_layer_gpu_s * LLAMACPP.tg_gpu_op_scale)
    # the readable form keeps the text keys reports and benchmark JSON have always had
    assert p.breakdown["tg.CUDA0_read"] == p.tg_terms[Term("read", "CUDA0")]
    assert p.breakdown["tg.cpu_read"] == p.tg_terms[Term("read", "CPU")]
    assert set(p.breakdown) == {f"tg.{t}" for t in p.tg_terms} | {f"pp.{t}" for t in p.pp_terms}


def test_op_offload_helps_pp_at_large_ubatch_and_pinned_beats_pageable():
    inv = load_preset("Qwen3-30B-A3B").inventory()
    hw = load_hardware("gpu-box")
    base = _plans(inv, 0)
    big = replace(base, knobs=replace(base.knobs, n_ubatch=2048, n_batch=2048))
    off = replace(big, knobs=replace(big.knobs, offload=OffloadPolicy.all(False)))
    pinned = replace(big, knobs=replace(big.knobs, mmap=False))
    pp_on, pp_off, pp_pinned = (predict(inv, p, hw, n_prompt=2048).pp_tps for p in (big, off, pinned))
    assert pp_on > pp_off
    assert pp_pinned > pp_on
    # TG does not change with op offload (batch 1 never offloads)
    assert predict(inv, big, hw).tg_tps == pytest.approx(predict(inv, off, hw).tg_tps)


def _typed(expert_type: str):
    """Qwen3-30B-A3B with its experts in `expert_type` and every other weight Q8_0."""
    from planner.archs import build_inventory
    p = load_preset("Qwen3-30B-A3B")
    return build_inventory(p.spec, lambda name, shape, layer: expert_type if "_exps" in name else "Q8_0",
                           tied_output=p.tied_output, name="q", source="q")


def test_no_host_keeps_repacked_experts_on_the_cpu_for_the_prompt():
    """mainline --no-host: experts in RAM of a type ggml-cpu repacks (Q4_0) land in CPU_REPACK, which is no host
    buffer, so op offload never uploads them: PP with every expert in RAM drops to about the op-offload-off
    figure. A type that does not repack on x86 (Q5_K) keeps its upload, now from pageable memory."""
    from planner.memory import estimate
    hw = load_hardware("gpu-box")
    inv = _typed("Q4_0")
    base = _plans(inv, 0)
    big = replace(base, knobs=replace(base.knobs, n_ubatch=2048, n_batch=2048))
    off = replace(big, knobs=replace(big.knobs, offload=OffloadPolicy.all(False)))
    nohost = replace(big, knobs=replace(big.knobs, no_host=True))
    on_p, off_p, nh_p = (predict(inv, p, hw, n_prompt=2048) for p in (big, off, nohost))
    assert on_p.pp_tps > 2 * off_p.pp_tps                      # op offload matters at this ubatch
    assert nh_p.pp_tps == pytest.approx(off_p.pp_tps, rel=0.02)
    assert nh_p.pp_terms.get(Term("upload"), 0.0) == 0.0 and on_p.pp_terms[Term("upload")] > 0
    # TG: the repacked read time is x cpu_repack_tg_time (0.86, measured on the H100: TG 1.10-1.11x)
    assert nh_p.tg_tps > on_p.tg_tps
    same = predict(inv, nohost, hw, n_prompt=2048, facts=replace(LLAMACPP, cpu_repack_tg_time=1.0))
    assert same.tg_tps == pytest.approx(on_p.tg_tps)
    faster = predict(inv, nohost, hw, n_prompt=2048, facts=replace(LLAMACPP, cpu_repack_tg_time=0.5))
    assert faster.tg_terms[Term("read", "CPU")] < 0.55 * on_p.tg_terms[Term("read", "CPU")]
    assert predict(inv, big, hw, facts=replace(LLAMACPP, cpu_repack_tg_time=0.5)).tg_tps == \
        pytest.approx(on_p.tg_tps)                             # without --no-host nothing repacks (CUDA_Host)
    # ik has no --no-host: the knob means nothing to its cost (its render refuses it)
    ik = replace(nohost, dialect="ik")
    assert predict(inv, ik, hw, n_prompt=2048).pp_terms.get(Term("upload"), 0.0) > 0
    # memory: the same GPU weights and KV; the repacked experts are anonymous host memory, no longer mapped
    m_on, m_nh = estimate(inv, big, hw), estimate(inv, nohost, hw)
    assert (m_nh.devices["CUDA0"].weights, m_nh.devices["CUDA0"].kv) == (m_on.devices["CUDA0"].weights,
                                                                        m_on.devices["CUDA0"].kv)
    experts = sum(t.nbytes for t in inv.allocated() if t.is_expert)
    assert (m_nh.host_pinned, m_nh.host_mapped) == (experts, m_on.host_mapped - experts)

    k5 = _typed("Q5_K")
    b5 = _plans(k5, 0)
    b5 = replace(b5, knobs=replace(b5.knobs, n_ubatch=2048, n_batch=2048))
    n5 = replace(b5, knobs=replace(b5.knobs, no_host=True))
    pinned5 = replace(b5, knobs=replace(b5.knobs, mmap=False))
    up = {name: predict(k5, p, hw, n_prompt=2048).pp_terms[Term("upload")]
          for name, p in (("nohost", n5), ("mmap", b5), ("pinned", pinned5))}
    assert up["nohost"] == pytest.approx(up["mmap"])          # kept, at pageable speed
    assert up["pinned"] < up["nohost"]
    assert estimate(k5, n5, hw).host_pinned == 0
