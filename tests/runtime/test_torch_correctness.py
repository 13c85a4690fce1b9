"""The torch engine computes the same function under every placement and offload policy, and the same as a
plain reference implementation (runtime/torch_engine/reference.py), for each architecture.

Placements run on logical GPUs (CUDA0/CUDA1 mapped onto the CPU), so every placement, upload and device
crossing of the scheduler is exercised here; tests/runtime/test_torch_gpu.py repeats the check on a real GPU.
"""
from __future__ import annotations

import pytest
import torch

from runtime.torch_engine import TorchEngine
from torch_plans import ARCHS, PLACEMENTS, plan_for, rel, tiny_inventory, untied_prompt

N_TOKENS = 8
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2}


@pytest.fixture(scope="module", params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_logits_agree_across_placements_and_with_reference(arch: str, dtype: str) -> None:
    inv = tiny_inventory(arch)
    engine = TorchEngine(compute_dtype=dtype, device_map="logical")
    prompt = ref = None
    results = {}
    for label, assign, knobs in PLACEMENTS:
        model = engine.load(inv, plan_for(inv, assign, knobs), min_cells=64)
        if prompt is None:
            prompt, ref = untied_prompt(inv, model, N_TOKENS)
        logits, _ = model.forward(prompt, 0, n_out=N_TOKENS)
        results[label] = logits
        model.close()
    base = results[PLACEMENTS[0][0]]
    for label, logits in results.items():
        assert rel(logits, base) < TOLERANCE[dtype], f"{arch} {dtype} {label} differs from {PLACEMENTS[0][0]}"
        assert rel(logits, ref) < TOLERANCE[dtype], f"{arch} {dtype} {label} differs from the reference"


def test_offload_policies_really_differ(arch: str) -> None:
    """The placements above are not all the same schedule: the counters show where the expert ops ran."""
    inv = tiny_inventory(arch)
    engine = TorchEngine(compute_dtype="fp32", device_map="logical")
    ran = {}
    for label, assign, knobs in PLACEMENTS:
        model = engine.load(inv, plan_for(inv, assign, knobs), min_cells=64)
        model.forward(list(range(1, N_TOKENS + 1)), 0)
        ran[label] = model.counters
        model.close()
    assert ran["all_gpu"].ops["moe_matmul@CUDA0"] > 0 and ran["all_gpu"].upload_bytes == 0
    assert ran["experts_in_ram"].ops["moe_matmul@CPU"] > 0 and ran["experts_in_ram"].upload_bytes == 0
    assert ran["experts_in_ram_offload_active"].offloaded["moe_matmul"] > 0
    full, active = ran["experts_in_ram_offload_full"], ran["experts_in_ram_offload_active"]
    assert full.upload_bytes >= active.upload_bytes > 0
    assert ran["all_cpu_offload_everything"].ops.get("moe_matmul@CPU", 0) == 0
    assert ran["two_gpus"].ops["output@CUDA1"] == 1
    assert ran["first_layer_cpu_no_offload"].ops["attention@CPU"] == 1


def test_incremental_decode_matches_reference(arch: str) -> None:
    """Prefill in ubatches of 3, then one-token steps: every step's logits match the reference's row."""
    inv = tiny_inventory(arch)
    engine = TorchEngine(compute_dtype="fp32", device_map="logical")
    model = engine.load(inv, plan_for(inv, *PLACEMENTS[1][1:]), min_cells=64)
    prompt, ref = untied_prompt(inv, model, N_TOKENS)
    logits = model.prefill(prompt[:5], 0, n_ubatch=3)
    assert rel(logits[-1], ref[4]) < 1e-5
    for i in range(5, N_TOKENS):
        step, _ = model.forward([prompt[i]], i)
        assert rel(step[-1], ref[i]) < 1e-5, f"{arch} step {i}"
    model.close()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_greedy_decoding_same_tokens_under_every_placement(arch: str, dtype: str) -> None:
    inv = tiny_inventory(arch)
    engine = TorchEngine(compute_dtype=dtype, device_map="logical")
    outputs = {}
    for label, assign, knobs in PLACEMENTS:
        model = engine.load(inv, plan_for(inv, assign, knobs), min_cells=64)
        outputs[label] = model.generate([5, 9, 2, 7], n_gen=6, n_ubatch=64)
        model.close()
    first = next(iter(outputs.values()))
    assert all(toks == first for toks in outputs.values()), outputs


def test_reference_is_independent_of_torch_engine_kernels() -> None:
    """Sanity of the reference itself: MLA absorbed (engine) and decompressed (reference) agree in float64."""
    inv = tiny_inventory("deepseek2")
    engine = TorchEngine(compute_dtype="fp32", device_map="logical")
    model = engine.load(inv, plan_for(inv, *PLACEMENTS[0][1:]), min_cells=64)
    prompt, ref = untied_prompt(inv, model, 6)
    logits, _ = model.forward(prompt, 0, n_out=6)
    assert rel(logits, ref) < 1e-5
    assert torch.isfinite(ref).all()
    model.close()


def test_sliding_window_ring_equals_full_cache() -> None:
    """gpt-oss SWA layers keep a ring of pad256(n_swa + n_ubatch) cells (mainline); past its end the ring wraps.
    Logits equal those of a full-size cache (--swa-full) well after the wrap."""
    inv = tiny_inventory("gpt-oss")
    engine = TorchEngine(compute_dtype="fp32", device_map="logical")
    ring = engine.load(inv, plan_for(inv, PLACEMENTS[0][1], PLACEMENTS[0][2]), min_cells=320)
    full_knobs = PLACEMENTS[0][2].__class__(**{**PLACEMENTS[0][2].__dict__, "swa_full": True})
    full = engine.load(inv, plan_for(inv, PLACEMENTS[0][1], full_knobs), min_cells=320)
    assert min(c.cells for c in ring.caches if c.swa) == 256 < min(c.cells for c in full.caches if c.swa)
    prompt = torch.randint(0, inv.hparams.n_vocab, (300,), generator=torch.Generator().manual_seed(1))
    a = ring.prefill(prompt, 0, n_ubatch=64, n_out=8)
    b = full.prefill(prompt, 0, n_ubatch=64, n_out=8)
    assert rel(a, b) < 1e-5
    assert ring.decode(7, 300) == full.decode(7, 300)


def test_fast_decode_program_equals_the_plain_one(arch: str) -> None:
    """The decode program with the fused helpers (compiled on CUDA; plain functions here) computes the same."""
    from runtime.torch_engine.model import make_fast_helpers
    inv = tiny_inventory(arch)
    engine = TorchEngine(compute_dtype="fp32", device_map="logical")
    model = engine.load(inv, plan_for(inv, *PLACEMENTS[1][1:]), min_cells=64)
    model.prefill([4, 8, 15, 16, 23], 0, n_ubatch=8)
    model.rt.fast = make_fast_helpers(model.cfg, model.dtype, True, compile=False)
    plain = model.program(1, 1, 256)
    fast = model.program(1, 1, 256, fast=True)
    outs = []
    for program in (plain, fast):
        state = model._externals(program, torch.tensor([42]), torch.tensor([5]))
        from runtime.torch_engine.scheduler import run_eager
        run_eager(program, state, model.counters)
        outs.append(state[program.outputs["logits"]])
    assert rel(outs[1], outs[0]) < 1e-6
    model.close()


def test_prompt_program_with_fused_helpers_equals_the_plain_one(arch: str) -> None:
    """A prompt ubatch's GPU ops take the fused helpers too (compiled on CUDA; plain functions here): same logits,
    including the last layer, which keeps only the output rows."""
    from runtime.torch_engine.model import make_fast_helpers
    inv = tiny_inventory(arch)
    engine = TorchEngine(compute_dtype="fp32", device_map="logical")
    model = engine.load(inv, plan_for(inv, *PLACEMENTS[1][1:]), min_cells=64)
    prompt = torch.randint(0, inv.hparams.n_vocab, (24,), generator=torch.Generator().manual_seed(3))
    plain = model.prefill(prompt, 0, n_ubatch=24, n_out=3)
    model._programs.clear()
    model.rt.fast = make_fast_helpers(model.cfg, model.dtype, True, compile=False)
    fused = model.prefill(prompt, 0, n_ubatch=24, n_out=3)
    assert rel(fused, plain) < 1e-6
    model.close()


def test_causal_flash_path_for_prompts_at_depth_zero() -> None:
    """A 256-token ubatch from position 0 takes the mask-free causal path; its logits equal two 128-token
    ubatches' (which take the masked path)."""
    inv = tiny_inventory("qwen3moe")
    engine = TorchEngine(compute_dtype="fp32", device_map="logical")
    model = engine.load(inv, plan_for(inv, *PLACEMENTS[0][1:]), min_cells=256)
    prompt = torch.randint(0, inv.hparams.n_vocab, (256,), generator=torch.Generator().manual_seed(2))
    a = model.prefill(prompt, 0, n_ubatch=256, n_out=4)
    assert not any(op.name.startswith("mask.") for op in model.program(256, 4, 256).ops)
    assert any(op.name.startswith("mask.") for op in model.program(128, 4, 256).ops)
    b = model.prefill(prompt, 0, n_ubatch=128, n_out=4)
    assert rel(a, b) < 1e-5
    model.close()
