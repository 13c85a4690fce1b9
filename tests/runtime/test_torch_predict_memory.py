"""TorchEngine.predict_memory: a dry run of the engine's own placement, programs, executor and accountant on the
meta device. It must agree with the accountant's peak of a real run on logical GPUs, byte for byte (the same code
charges the same tensors; the dry run leaves out only repeats that cannot move the peak), on one- and two-device
plans: every arch's tiny model in several placements (experts in RAM with op offload, split experts, the first
layer on the CPU, only-active uploads, depth), and the two-device plans of benchmarks/multi_gpu.py's torch step at
the real Qwen3-30B-A3B layer shape (slow)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from planner.memory import HOST_PROCESS_OVERHEAD, estimate
from planner.engine_contract import BenchRun
from runtime.torch_engine import TorchEngine

from torch_plans import (
    ARCHS, all_cpu, all_gpu, experts_in_ram, first_layer_cpu, knobs, plan_for, split_experts, tiny_inventory,
    two_gpus,
)


def agree(engine: TorchEngine, inv, plan, wl: BenchRun, hw=None) -> dict[str, tuple[int, int]]:
    pred = engine.predict_memory(inv, plan, hw, wl)
    m = engine.measure(inv, plan, wl)
    assert m.ok, m.error
    assert m.raw["logical_gpus"]
    out = {}
    for dev, peak in m.peak_bytes.items():
        d = pred.devices[dev]
        assert d.overhead == 0                    # a logical GPU has no CUDA context, and measures none
        assert d.weights == m.raw["static_parts"].get(dev, {}).get("weights", 0)
        assert d.kv == m.raw["static_parts"].get(dev, {}).get("kv", 0)
        out[dev] = (d.total, peak)
    assert {d: p for d, (p, _) in out.items()} == {d: q for d, (_, q) in out.items()}, out
    assert pred.devices["CPU"].overhead == HOST_PROCESS_OVERHEAD
    assert pred.host_pinned == pred.devices["CPU"].weights and pred.host_mapped == 0
    return out


# one architecture in the fast loop, all of them in `make test` (every case costs 0.5-2 s of the fast loop's 90)
@pytest.mark.parametrize("arch", [a if i < 1 else pytest.param(a, marks=pytest.mark.slow) for i, a in enumerate(ARCHS)])
@pytest.mark.parametrize("assign", [all_gpu, experts_in_ram, two_gpus, split_experts, first_layer_cpu, all_cpu])
def test_prediction_is_the_logical_gpu_accountant_peak(arch, assign):
    inv = tiny_inventory(arch)
    engine = TorchEngine(device_map="logical", compile=False, keep_weights=False)
    plan = plan_for(inv, assign, replace(knobs(min_batch=4), n_ubatch=8, n_batch=8))
    agree(engine, inv, plan, BenchRun(20, 3, 0, 1))


@pytest.mark.parametrize("only_active", [True, False])
def test_prediction_with_depth_repetitions_and_uploads(only_active):
    inv = tiny_inventory("qwen3moe")
    engine = TorchEngine(device_map="logical", compile=False, keep_weights=False)
    plan = plan_for(inv, experts_in_ram, replace(knobs(min_batch=2, only_active=only_active), n_ubatch=4, n_batch=4))
    agree(engine, inv, plan, BenchRun(9, 5, 6, 3))


def test_real_gpus_add_the_profiles_context_and_nothing_allocates():
    """On real GPUs the prediction adds the hardware profile's GPU overhead (the CUDA context); the dry run
    allocates no tensor (meta device), so a plan far over any logical budget is predicted, not refused."""
    import torch

    from runtime.torch_engine.engine import dry_accountant, memory_report
    from runtime.torch_engine.placement import resolve_devices
    inv = tiny_inventory("qwen3moe")
    plan = plan_for(inv, two_gpus, knobs())
    hw = None
    engine = TorchEngine(device_map="logical", logical_gpu_bytes=1, compile=False)     # 1 byte per logical GPU
    pred = engine.predict_memory(inv, plan, hw, BenchRun(8, 2, 0, 1))
    assert pred.devices["CUDA0"].total > 1
    assert not engine.measure(inv, plan, BenchRun(8, 2, 0, 1)).ok                    # the real run does not fit
    devices = resolve_devices(plan.devices(), "logical", None)
    acct = dry_accountant(inv, plan, devices, torch.bfloat16, BenchRun(8, 2, 0, 1))
    real = type(devices)(devices.torch_of, devices.gpus, False, {})                # as if on CUDA
    rep = memory_report(acct, real, None)
    assert rep.devices["CUDA0"].overhead > 0
    assert rep.devices["CUDA0"].total == pred.devices["CUDA0"].total + rep.devices["CUDA0"].overhead


def test_real_gpus_charge_cublas_pools_and_the_grouped_experts_scratch(bench_script):
    """A dry run for real GPUs charges what the two-H100 probe (benchmarks/reported/torch_memory_probe_h100x2.md)
    found alive at each GPU's peak beyond the engine's tensors: 32 MiB of cuBLAS workspace per GPU with weights,
    the synthetic source's pools (three bf16 pools of 32 MiB on a GPU holding blocks and experts: 96 MiB there),
    and at a 512-token ubatch the grouped experts' 50 MiB of temporaries (xs 16 + gate|up 12 + activation 6 +
    down 16, the Qwen3-30B-A3B layer shape). Logical GPUs charge none of it."""
    import torch

    from runtime.torch_engine.engine import CUBLAS_WORKSPACE, dry_accountant
    from runtime.torch_engine.model import grouped_scratch
    from runtime.torch_engine.config import config_from_inventory
    from runtime.torch_engine.placement import resolve_devices
    from runtime.torch_engine.weights import SyntheticSource
    mg = bench_script("multi_gpu")
    inv = mg.torch_inventory(2)
    hw = mg.torch_hardware(mg.TORCH_HARDWARE)
    wl = BenchRun(512, 2, 0, 1)
    plan = next(c.plan for c in mg.torch_cases(inv, hw, [4], wl) if c.name == "ts-1-1")
    logical = resolve_devices(plan.devices(), "logical", None)
    real = type(logical)(logical.torch_of, logical.gpus, False, {})
    source = SyntheticSource(inv)
    a = dry_accountant(inv, plan, logical, torch.bfloat16, wl, source=source)
    b = dry_accountant(inv, plan, real, torch.bfloat16, wl, source=source)
    MiB = 1 << 20
    cfg = config_from_inventory(inv)
    assert grouped_scratch(cfg, 512, torch.bfloat16, 2) == 50 * MiB
    assert grouped_scratch(cfg, 2048, torch.bfloat16, 2) == 200 * MiB
    assert grouped_scratch(cfg, 8, torch.bfloat16, 2) == 0 and grouped_scratch(cfg, 512, torch.float32, 2) == 0
    # at 2 layers ts-1-1 puts both blocks on CUDA0 (three pools: the stds of 2048- and 4096-wide rows and of the
    # 768-wide down experts) and the output alone on CUDA1 (one pool)
    assert b.parts["CUDA0"]["library"] == CUBLAS_WORKSPACE + 3 * 32 * MiB
    assert b.parts["CUDA1"]["library"] == CUBLAS_WORKSPACE + 32 * MiB
    assert all("library" not in a.parts[g] for g in ("CUDA0", "CUDA1"))
    # CUDA0 runs the experts at 512 tokens: their scratch lands on top of what is live as that op ends (its inputs
    # not yet freed), above the peak between ops; CUDA1 runs none
    grown = {g: (b.peak[g] - b.static[g]) - (a.peak[g] - a.static[g]) for g in ("CUDA0", "CUDA1")}
    assert 50 * MiB <= grown["CUDA0"] <= 55 * MiB and grown["CUDA1"] == 0, grown


def test_differs_from_planner_memory_where_llamacpp_differs():
    """Experts in RAM with op offload: the engine stages two copies of each uploaded shape on the first GPU, where
    llama.cpp's compute buffer holds its offload copies; the two models disagree there (why the tuner asks the
    engine)."""
    inv = tiny_inventory("qwen3moe")
    engine = TorchEngine(device_map="logical", compile=False, keep_weights=False)
    plan = plan_for(inv, experts_in_ram, replace(knobs(min_batch=4), n_ubatch=8, n_batch=8))
    pred = engine.predict_memory(inv, plan, None, BenchRun(20, 3, 0, 1))
    assert pred.devices["CUDA0"].total != estimate(inv, plan).devices["CUDA0"].total


@pytest.mark.slow
def test_multi_gpu_torch_plans_at_the_real_layer_shape(bench_script):
    """multi_gpu.py's torch step at 2 layers of the Qwen3-30B-A3B shape (BF16, ~3.7 GiB synthesized), ub 512, on two
    logical GPUs: prediction and accountant peak agree byte for byte on every plan (~1 min)."""
    mg = bench_script("multi_gpu")
    inv = mg.torch_inventory(2)
    hw = mg.torch_hardware(mg.TORCH_HARDWARE)
    wl = BenchRun(512, 4, 0, 1)
    engine = TorchEngine(device_map="logical", weights="synthetic", logical_gpu_bytes=mg.DEFAULT_GPU_BYTES)
    cases = mg.torch_cases(inv, hw, [1, 2], wl)
    assert len(cases) >= 10
    for case in cases:
        out = agree(engine, inv, case.plan, wl, hw)
        assert set(out) == {"CUDA0", "CUDA1"}, case.name


def test_a_torch_study_judges_its_candidates_with_the_engines_prediction():
    """The tuner asks the torch engine (not planner.memory) whether a candidate fits: a candidate's memory is the
    engine's prediction at the study's workload, and the budget check reads it."""
    from planner.hardware import MiB, load_hardware
    from tuner.search import Tuner, StudyConfig
    inv = tiny_inventory("qwen3moe")
    hw = load_hardware("rtx4090-ddr5")
    engine = TorchEngine(device_map="logical", compile=False, keep_weights=False)
    wl = BenchRun(16, 2, 0, 1)
    tuner = Tuner(inv, hw, engine, StudyConfig(
        bench=wl, n_ctx=512, margin=256 * MiB, storage=None, pool_size=3, baselines=False, seed_trials=False,
        surrogate=False))
    params = {**tuner.space.default_params(), "fill.CUDA0": 0.5, "order": "last", "partial": True, "offload": True}
    cand = tuner.space.decode(tuner.space.fixed(params))
    assert cand.memory == engine.predict_memory(inv, cand.plan, hw, wl)
    assert cand.memory != estimate(inv, cand.plan, hw)
    assert cand.fits == (tuner.space.over_budget(cand.memory) == "")
