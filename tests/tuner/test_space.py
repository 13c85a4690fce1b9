"""The tuner's search space: every candidate is a complete placement, `fits` is the memory model's verdict against
VRAM minus margin and host RAM, fitting candidates render to flags that round-trip, and the grid enumerates
each distinct candidate once."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from planner.flags import render
from planner.hardware import GiB, MiB, load_hardware
from planner.memory import estimate
from planner.presets import load_preset
from planner.propose import Room, proposals
from tuner.space import Space, SpaceConfig

CASES = [  # model, hardware, VRAM per GPU, dialect
    ("Qwen3-30B-A3B:Q4_K_M", "rtx4090-ddr5", [16 * GiB], "mainline"),
    ("DeepSeek-V2-Lite:Q4_K_M", "rtx3090-ddr4", [8 * GiB], "ik"),
    ("GLM-4.5-Air:Q4_K_M", "desktop-ddr5", [16 * GiB, 12 * GiB], "mainline"),
]


@pytest.mark.parametrize("preset,hardware,vram,dialect", CASES)
def test_random_candidates_are_complete_plans_judged_by_the_memory_model(preset, hardware, vram, dialect):
    inv = load_preset(preset).inventory()
    hw = load_hardware(hardware).with_vram(vram)
    space = Space(inv, hw, dialect=dialect, n_ctx=8192)
    budget = Room.from_hardware(hw, 512 * MiB)
    names = {t.name for t in inv.allocated()}
    rng = random.Random(7)
    n_fit = 0
    for _ in range(12):
        c = space.decode(space.random(rng))
        assert set(c.plan.assignment) == names
        assert c.plan.assignment["token_embd.weight"] == "CPU"
        assert set(c.params) <= set(space.dims)
        mem = estimate(inv, c.plan, hw)
        assert c.fits == budget.fits(mem), c.reason
        if c.fits:
            n_fit += 1
            assert all(m.total <= budget.gpus[d] for d, m in mem.devices.items() if d != "CPU")
            render(c.plan, inv, "server")      # raises FlagError unless the flags reproduce the plan exactly
    assert n_fit >= 8      # shares of the *remaining* budget: nearly every candidate fits by construction


def test_fill_share_scales_vram_and_order_changes_which_layers():
    inv = load_preset("Qwen3-30B-A3B:Q4_K_M").inventory()
    hw = load_hardware("rtx4090-ddr5").with_vram([16 * GiB])
    space = Space(inv, hw, n_ctx=8192)
    base = space.default_params()
    used = {}
    for share in (0.0, 0.5, 1.0):
        c = space.decode(space.fixed({**base, "fill.CUDA0": share, "order": "last", "partial": True}))
        used[share] = c.gpu_bytes()["CUDA0"]
        assert c.fits
    assert used[0.0] < used[0.5] < used[1.0] <= 16 * GiB - 512 * MiB
    first = space.decode(space.fixed({**base, "fill.CUDA0": 0.5, "order": "first", "partial": False})).plan
    last = space.decode(space.fixed({**base, "fill.CUDA0": 0.5, "order": "last", "partial": False})).plan
    # "first" fills the lowest MoE layers first, "last" the highest: blk.0's experts differ
    assert first.assignment["blk.0.ffn_up_exps.weight"] == "CUDA0"
    assert last.assignment["blk.0.ffn_up_exps.weight"] == "CPU"
    assert last.assignment["blk.47.ffn_up_exps.weight"] == "CUDA0"


def test_grid_enumerates_each_distinct_candidate_once_and_caches_decoding():
    inv = load_preset("Qwen3-30B-A3B:Q4_K_M").inventory()
    hw = load_hardware("rtx4090-ddr5").with_vram([16 * GiB])
    cfg = SpaceConfig(fill_step=0.5, orders=("first", "last"), partial=(True, False), output=("gpu",),
                      ubatch=(512,), batch_mult=(1,), threads=(16,), flash_attn=(True,), kv_types=("f16",),
                      offload=(True,), min_batch=(32,), mmap=(True,))
    space = Space(inv, hw, n_ctx=8192, config=cfg)
    grid = list(space.grid(cache=True))
    # fill 0 asks no order/partial: 1 + (fill .5 and 1) x 2 orders x 2 granularities = 9, all homes fit
    assert len(grid) == 9
    assert len({tuple(sorted(c.params.items())) for c in grid}) == 9
    for c in grid:   # the cached decision tree answers the same as a fresh decode
        again = space.decode(space.fixed(c.params))
        assert again is c
        fresh = Space(inv, hw, n_ctx=8192, config=cfg).decode(space.fixed(c.params))
        assert fresh.plan.id == c.plan.id


def test_proposal_and_default_params_decode():
    inv = load_preset("Qwen3-30B-A3B:Q4_K_M").inventory()
    hw = load_hardware("rtx4090-ddr5").with_vram([16 * GiB])
    space = Space(inv, hw, n_ctx=8192)
    d = space.decode(space.fixed(space.default_params()))
    assert d.fits and d.plan.knobs.n_ubatch == 512 and d.plan.knobs.n_batch == 2048
    # defaults + fill 0 = every layer homed on the GPU, every expert on the CPU: what -ngl 99 -cmoe does
    assert all(d.plan.assignment[t.name] == "CPU" for t in inv.allocated() if t.is_expert)
    assert d.plan.assignment["blk.0.attn_q.weight"] == "CUDA0" and d.plan.assignment["output.weight"] == "CUDA0"
    fill_last = next(x for x in proposals(inv, hw, d.plan.knobs) if x.label == "experts-cpu+fill-last")
    p = space.decode(space.fixed(space.proposal_params(fill_last)))
    assert p.fits and p.plan.assignment["blk.47.ffn_down_exps.weight"] == "CUDA0"
    # the params come from the proposal's fields: its label is for people, never parsed back
    renamed = replace(fill_last, plan=replace(fill_last.plan, label="something else"))
    assert space.proposal_params(renamed) == space.proposal_params(fill_last)
    first = space.proposal_params(replace(fill_last, order="first"))
    assert first["order"] == "first" and first["partial"] is True
    layers = next(x for x in proposals(inv, hw, d.plan.knobs) if x.strategy == "layers")
    assert space.proposal_params(layers)["order"] == "last" and space.proposal_params(layers)["partial"] is False


def test_ik_space_has_an_offload_switch_per_op_class_and_the_ik_knobs():
    # -op per op class (MUL_MAT_ID, MOE_FUSED_UP_GATE with -fmoe, MUL_MAT), -no-ooae, -fmoe, -amb, -rtr,
    # -cuda offload-batch-size (min_batch), alongside placement and ubatch
    inv = load_preset("DeepSeek-V2-Lite:Q4_K_M").inventory()
    hw = load_hardware("rtx3090-ddr4").with_vram([8 * GiB])
    space = Space(inv, hw, dialect="ik", n_ctx=8192)
    assert {"offload_moe", "offload_fused", "offload_dense", "only_active", "fmoe", "amb", "rtr", "mla",
            "min_batch_log2", "ubatch_log2", "fill.CUDA0"} <= set(space.dims)
    p = {**space.default_params(), "offload_fused": False, "min_batch_log2": 6, "only_active": False}
    c = space.decode(space.fixed(p))
    pol = c.plan.knobs.offload
    assert (pol.moe_matmul.enabled, pol.moe_fused_up_gate.enabled, pol.dense_matmul.enabled) == (True, False, True)
    rc = render(c.plan, inv, "server")
    assert rc[rc.index("-op") + 1] == "31,0"                       # MOE_FUSED_UP_GATE off (ik 8337e4cd ids)
    assert "offload-batch-size=64" in rc[rc.index("-cuda") + 1] and "-no-ooae" in rc
    # without fused MoE there is no fused op: the switch is not asked
    c = space.decode(space.fixed({**p, "fmoe": False}))
    assert "offload_fused" not in c.params and "-no-fmoe" in render(c.plan, inv, "server")


def test_ik_space_without_op_per_class_renders_for_llama_bench():
    # ik's llama-bench has no -op: with op_per_class off op offload stays on (its batch, -cuda
    # offload-batch-size, is still tuned), which llama-bench can run
    inv = load_preset("DeepSeek-V2-Lite:Q4_K_M").inventory()
    hw = load_hardware("rtx3090-ddr4").with_vram([8 * GiB])
    space = Space(inv, hw, dialect="ik", n_ctx=8192, config=SpaceConfig(op_per_class=False))
    assert not {"offload_moe", "offload_fused", "offload_dense"} & set(space.dims)
    rng = random.Random(3)
    for _ in range(6):
        c = space.decode(space.random(rng))
        pol = c.plan.knobs.offload
        assert {pol.rule(op).enabled for op in ("dense_matmul", "moe_matmul", "moe_fused_up_gate", "output")} == {True}
        if c.fits:
            assert "-op" not in render(c.plan, inv, "bench")


def test_a_float_dimension_asks_optuna_for_its_own_range_and_step_without_a_warning():
    """0.3 - 0.25 is 0.04999999999999999 in floats: with that step Optuna found [0.25, 1.0] not divisible, warned on
    every trial of a tune_vs_fit study on the H100 and moved the upper end below 1.0, so that every enqueued 1.0
    (a fill-max seed) warned again as out of range."""
    import warnings
    import optuna
    from tuner.space import Dim, _steps
    dim = Dim("home_frac", "float", _steps(0.25, 1.0, 0.05))
    study = optuna.create_study()
    study.enqueue_trial({"home_frac": 1.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = [dim.suggest(study.ask()) for _ in range(4)]
    assert got[0] == 1.0 and all(v in dim.values for v in got)
    assert study.trials[0].distributions["home_frac"].high == 1.0
