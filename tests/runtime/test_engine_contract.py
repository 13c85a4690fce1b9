"""The Engine contract (planner/engine_contract.py's docstring) as one suite run against every engine: sim, torch
(logical
GPUs on the CPU: the torch engine runs anywhere), llamacpp (the real CPU llama-bench build; its plans keep every
tensor on the CPU, the only device that build has) and llamaserver (the real CPU mainline llama-server, likewise).

What each engine must do: measure a valid plan as ok with positive speeds over the workload and its peaks per
device; turn a run that cannot succeed (out of memory, a model llama.cpp refuses) into Measurement(ok=False,
error=...) instead of raising; raise InputError for a device the machine does not have; honour its time limit."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from planner.errors import InputError
from planner.hardware import from_gpu_sizes
from planner.loader import load_model
from planner.model import ModelInventory
from planner.plan import Knobs, Plan
from planner.engine_contract import Engine, Measurement, BenchRun
from runtime.synth import tiny_spec, uniform_recipe, write_gguf

WL = BenchRun(n_prompt=16, n_gen=4, depth=0, repetitions=2)


@dataclass(frozen=True)
class Case:
    """One engine under the contract: how to make it, the plan it can run, and a run that cannot succeed."""
    engine: Engine
    inv: ModelInventory
    plan: Plan                                   # valid on this engine's machine
    failing: Callable[[], Measurement]           # a run that fails for a reason of the run itself
    timed: Callable[[float], Engine] | None      # the engine with a time limit of N s (None: it has none)
    why_no_limit: str = ""


def _assign(inv: ModelInventory, gpu: str | None) -> dict[str, str]:
    """Routed experts in RAM, the rest on `gpu` (None: everything on the CPU); token_embd stays on the CPU."""
    return {t.name: "CPU" if gpu is None or t.is_expert or t.role == "token_embd" else gpu for t in inv.allocated()}


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("contract") / "tiny.gguf", tiny_spec("qwen3moe"),
                      uniform_recipe("Q8_0"))[0]


def _sim(model: Path, _request) -> Case:
    from runtime.sim import SimEngine
    inv = load_model(str(model))
    hw = from_gpu_sizes("1GiB")
    plan = Plan("tiny", _assign(inv, "CUDA0"), Knobs(n_ctx=512), "mainline")
    # a context whose KV cache alone is larger than the GPU: the sim's out-of-memory
    huge = replace(plan, knobs=replace(plan.knobs, n_ctx=4_000_000))
    return Case(SimEngine(hw), inv, plan, lambda: SimEngine(hw).measure(inv, huge, WL), None,
                "the sim engine computes, it runs nothing that could take long")


def _torch(model: Path, _request) -> Case:
    pytest.importorskip("torch")
    from runtime.torch_engine import TorchEngine
    inv = load_model(str(model))
    plan = Plan("tiny", _assign(inv, "CUDA0"), Knobs(n_ctx=512), "mainline")
    tiny_gpu = TorchEngine(device_map="logical", compute_dtype="fp32", logical_gpu_bytes=1 << 20)   # 1 MiB
    return Case(TorchEngine(device_map="logical", compute_dtype="fp32"), inv, plan,
                lambda: tiny_gpu.measure(inv, plan, WL), None,
                "the torch engine runs in-process and has no time limit")


def _llamacpp(model: Path, request) -> Case:
    from runtime.llamacpp import LlamaCppEngine
    bench = request.getfixturevalue("llama_bench")
    inv = load_model(str(model))
    plan = Plan("tiny", _assign(inv, None), Knobs(n_ctx=512, n_threads=1), "mainline")
    truncated = model.with_name("truncated.gguf")
    truncated.write_bytes(model.read_bytes()[: model.stat().st_size // 3])
    bad_model = LlamaCppEngine(bench, timeout_s=60, model_path=truncated)
    return Case(LlamaCppEngine(bench, timeout_s=60, model_path=model), inv, plan,
                lambda: bad_model.measure(inv, plan, WL),
                lambda s: LlamaCppEngine(bench, timeout_s=s, model_path=model))


def _llamaserver(model: Path, request) -> Case:
    from runtime.llamaserver import LlamaServerEngine
    server = request.getfixturevalue("llama_server")
    # the same model with a made-up vocabulary: the server turns each generated token into text
    model = write_gguf(model.with_name("tiny-vocab.gguf"), tiny_spec("qwen3moe"), uniform_recipe("Q8_0"),
                       vocab=True)[0]
    inv = load_model(str(model))
    plan = Plan("tiny", _assign(inv, None), Knobs(n_ctx=512, n_threads=1), "mainline")
    truncated = model.with_name("truncated-vocab.gguf")
    truncated.write_bytes(model.read_bytes()[: model.stat().st_size // 3])
    bad_model = LlamaServerEngine(server, timeout_s=60, model_path=truncated)
    return Case(LlamaServerEngine(server, timeout_s=60, model_path=model), inv, plan,
                lambda: bad_model.measure(inv, plan, WL),
                lambda s: LlamaServerEngine(server, timeout_s=s, model_path=model))


ENGINES = {"sim": _sim, "torch": _torch, "llamacpp": _llamacpp, "llamaserver": _llamaserver}


@pytest.fixture(params=[pytest.param("sim"), pytest.param("torch"),
                        pytest.param("llamacpp", marks=pytest.mark.llamacpp),
                        pytest.param("llamaserver", marks=pytest.mark.llamacpp)])
def case(request, model_file) -> Case:
    return ENGINES[request.param](model_file, request)


def test_is_an_engine_with_its_name(case):
    assert isinstance(case.engine, Engine) and case.engine.name in ENGINES


def test_a_valid_plan_measures_ok_with_speeds_and_peaks_per_device(case):
    m = case.engine.measure(case.inv, case.plan, WL)
    assert m.ok and not m.error, m.error
    assert m.pp_tps > 0 and m.tg_tps > 0
    gpus = {d for d in case.plan.devices() if d != "CPU"}
    assert set(m.peak_bytes) >= gpus and all(m.peak_bytes[d] > 0 for d in gpus)   # peaks of the plan's GPUs
    assert all(isinstance(b, int) and b >= 0 for b in m.peak_bytes.values())
    assert m.host_bytes > 0
    json.dumps(m.to_dict())                       # a study stores it


def test_speeds_cover_only_what_the_workload_asks(case):
    pp_only = case.engine.measure(case.inv, case.plan, BenchRun(n_prompt=16, n_gen=0, repetitions=1))
    assert pp_only.ok and pp_only.pp_tps > 0 and pp_only.tg_tps == 0, pp_only.error
    tg_only = case.engine.measure(case.inv, case.plan, BenchRun(n_prompt=0, n_gen=4, repetitions=1))
    assert tg_only.ok and tg_only.tg_tps > 0 and tg_only.pp_tps == 0, tg_only.error


def test_a_run_that_cannot_succeed_is_a_failed_measurement_not_an_exception(case):
    m = case.failing()
    assert isinstance(m, Measurement) and not m.ok
    assert m.error and "\n" not in m.error.strip()
    assert m.pp_tps == 0 and m.tg_tps == 0


def test_a_device_the_machine_does_not_have_is_an_input_error(case):
    plan = replace(case.plan, assignment={**case.plan.assignment, "output.weight": "Vulkan0"})
    with pytest.raises(InputError):
        case.engine.measure(case.inv, plan, WL)


def test_the_time_limit_is_honoured(case):
    if case.timed is None:
        pytest.skip(case.why_no_limit)
    import time
    t0 = time.perf_counter()
    m = case.timed(0.05).measure(case.inv, case.plan, BenchRun(n_prompt=512, n_gen=64, repetitions=20))
    assert not m.ok and m.raw.get("failure") == "timeout", m.error
    assert time.perf_counter() - t0 < 30
