"""TorchEngine against the Engine contract (planner/engine_contract.py), on logical GPUs."""
from __future__ import annotations

import pytest

from planner.errors import InputError
from planner.plan import Plan
from planner.engine_contract import Engine, BenchRun
from runtime.torch_engine import TorchEngine
from torch_plans import experts_in_ram, knobs, plan_for, tiny_inventory


def test_is_an_engine() -> None:
    assert isinstance(TorchEngine(), Engine) and TorchEngine().name == "torch"


def test_measure_tiny_model_on_logical_gpus() -> None:
    """CI's run of the torch engine: completes with ok=True (its speed is timed in benchmarks, not here)."""
    inv = tiny_inventory("qwen3moe")
    engine = TorchEngine(device_map="logical")
    m = engine.measure(inv, plan_for(inv, experts_in_ram, knobs()), BenchRun(n_prompt=64, n_gen=4, depth=16,
                                                                             repetitions=2))
    assert m.ok, m.error
    assert m.pp_tps > 0 and m.tg_tps > 0
    assert m.raw["logical_gpus"] is True and m.raw["weights"] == "synthetic"
    assert len(m.raw["pp_tps_samples"]) == 2 and len(m.raw["tg_tps_samples"]) == 2
    assert m.peak_bytes["CUDA0"] > 0 and m.host_bytes > 0
    # PP ubatches of 64 >= 32: the expert ops ran on the GPU with uploads; TG ran them on the CPU
    assert m.raw["pp_counters_per_run"]["upload_bytes"] > 0
    assert m.raw["tg_counters_per_run"]["upload_bytes"] == 0
    assert m.raw["tg_counters_per_run"]["ops"]["moe_matmul@CPU"] == 4 * 2


def test_prompt_only_and_generation_only_workloads() -> None:
    inv = tiny_inventory("gpt-oss")
    engine = TorchEngine(device_map="logical", compute_dtype="fp32")
    plan = plan_for(inv, experts_in_ram, knobs())
    m = engine.measure(inv, plan, BenchRun(n_prompt=16, n_gen=0, repetitions=1))
    assert m.ok and m.pp_tps > 0 and m.tg_tps == 0
    m = engine.measure(inv, plan, BenchRun(n_prompt=0, n_gen=3, repetitions=1))
    assert m.ok and m.tg_tps > 0 and m.pp_tps == 0


def test_input_errors_raise() -> None:
    inv = tiny_inventory("qwen3moe")
    plan = plan_for(inv, experts_in_ram, knobs())
    bad = Plan(plan.model_id, {**plan.assignment, "output.weight": "Vulkan0"}, plan.knobs)
    with pytest.raises(InputError):
        TorchEngine(device_map="logical").measure(inv, bad, BenchRun(n_prompt=8, n_gen=0))
    with pytest.raises(InputError):
        TorchEngine(compute_dtype="int3")
    with pytest.raises(InputError):
        TorchEngine(routing="zipf:-1", device_map="logical").measure(inv, plan, BenchRun(n_prompt=8, n_gen=0))


def test_unsupported_architecture_is_an_input_error() -> None:
    from planner.archs import build_inventory
    from runtime.synth import tiny_spec, uniform_recipe
    inv = build_inventory(tiny_spec("llama"), uniform_recipe("Q8_0"), name="tiny-llama")
    plan = Plan("x", {t.name: "CPU" for t in inv.allocated()}, knobs())
    with pytest.raises(InputError, match="torch engine runs"):
        TorchEngine(device_map="logical").measure(inv, plan, BenchRun(n_prompt=8, n_gen=0))


def test_weights_are_reused_between_measurements_of_the_same_model() -> None:
    inv = tiny_inventory("qwen3moe")
    engine = TorchEngine(device_map="logical")
    wl = BenchRun(n_prompt=8, n_gen=2, repetitions=1)
    engine.measure(inv, plan_for(inv, experts_in_ram, knobs()), wl)
    kept = dict(engine._cache.buffers)
    engine.measure(inv, plan_for(inv, experts_in_ram, knobs(min_batch=4)), wl)
    assert kept and all(engine._cache.buffers[k][0] is v[0] for k, v in kept.items())


def test_fast_path_fallbacks_are_logged_and_recorded_in_raw(caplog) -> None:
    import logging

    import torch

    from runtime.torch_engine import kernels as K
    inv = tiny_inventory("qwen3moe")
    engine = TorchEngine(device_map="logical", compute_dtype="fp32")
    plan = plan_for(inv, experts_in_ram, knobs())
    wl = BenchRun(n_prompt=8, n_gen=2, repetitions=1)
    m = engine.measure(inv, plan, wl)
    assert m.ok and isinstance(m.raw["fallbacks"], list)      # what this machine lacks, if anything, is listed
    # a fast path that fails for real (shapes that do not multiply) is dropped for its fallback, logged once, and
    # every later measurement says it ran without it
    x = torch.ones(2, 3)
    try:
        with caplog.at_level(logging.WARNING, logger="runtime.torch_engine.kernels"):
            y = K.CAPABILITIES.run("probe_mm", x.device, lambda a: a @ torch.ones(2, 2), lambda a: a * 2, x)
            again = K.CAPABILITIES.run("probe_mm", x.device, lambda a: a @ torch.ones(2, 2), lambda a: a * 3, x)
        assert torch.equal(y, x * 2) and torch.equal(again, x * 3)
        assert caplog.text.count("probe_mm on device 0: RuntimeError") == 1
        m = engine.measure(inv, plan, wl)
        assert m.ok and "probe_mm on device 0 (dropped earlier in this process)" in m.raw["fallbacks"]
    finally:
        K.CAPABILITIES.failed.discard(("probe_mm", 0))


def test_cuda_graphs_only_where_the_plan_uses_one_gpu() -> None:
    # a capture with a copy between two GPUs is invalidated (the 2x H100 run of 2026-11-27 aborted on it)
    from runtime.torch_engine.engine import graph_gpus
    one = Plan("m", {"a": "CUDA0", "b": "CPU"})
    two = Plan("m", {"a": "CUDA0", "b": "CUDA1"})
    assert graph_gpus(one, "CUDA0") == {"CUDA0"} and graph_gpus(one, "CPU") == {"CUDA0"}
    assert graph_gpus(two, "CUDA0") == {"CUDA0", "CUDA1"}
    assert graph_gpus(one, "CUDA1") == {"CUDA0", "CUDA1"}       # the output layer on the other GPU
    assert graph_gpus(Plan("m", {"a": "CPU"}), "CPU") == set()
