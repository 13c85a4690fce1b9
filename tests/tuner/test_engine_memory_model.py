"""An engine's own memory prediction judges its plans (planner.engine_contract.memory_model): the tuner's space decodes,
baselines and judged runs use Engine.predict_memory where the engine has one (the torch engine), and
planner.memory.estimate itself (the same function: byte-identical behaviour) for engines without it (sim, llamacpp),
or for a plan the engine returns None for."""
from __future__ import annotations

from dataclasses import replace

from planner.engine_contract import Engine, memory_model, memory_model_name
from planner.hardware import GiB, MiB, load_hardware
from planner.memory import estimate
from planner.presets import load_preset
from tuner.search import Tuner, StudyConfig, BenchRun
from runtime.sim import SimEngine

WL = BenchRun(n_prompt=2048, n_gen=128, depth=0, repetitions=1)
EXTRA = 2 * GiB


class OwnMemoryEngine(Engine):
    """The sim engine's runs, and a memory model of its own: planner.memory's plus EXTRA on CUDA0 (staging buffers
    llama.cpp does not have, say); None for every plan when `none` (planner.memory judges them)."""
    name = "own-memory"
    predicts_memory = True

    def __init__(self, hw, none=False):
        self.sim, self.asked, self.none = SimEngine(hw), [], none

    def measure(self, inv, plan, workload):
        return self.sim.measure(inv, plan, workload)

    def predict_memory(self, inv, plan, hw, workload):
        self.asked.append((plan.id, workload))
        if self.none:
            return None
        mem = estimate(inv, plan, hw)
        cuda0 = mem.devices["CUDA0"]
        return replace(mem, devices={**mem.devices, "CUDA0": replace(cuda0, compute=cuda0.compute + EXTRA)})


def _setup():
    inv = load_preset("Qwen3-30B-A3B:Q4_K_M").inventory()
    hw = load_hardware("rtx4090-ddr5").with_vram([16 * GiB])
    return inv, hw


def test_engines_without_a_prediction_keep_planner_memory_itself():
    inv, hw = _setup()
    assert memory_model(SimEngine(hw), WL) is estimate
    assert memory_model_name(estimate) == "planner.memory"
    tuner = Tuner(inv, hw, SimEngine(hw), StudyConfig(
        bench=WL, n_ctx=8192, margin=512 * MiB, storage=None, pool_size=5, baselines=False, seed_trials=False))
    assert tuner.estimate is estimate and tuner.space.estimate is estimate


def test_a_study_of_an_engine_with_its_own_memory_model_is_judged_by_it():
    inv, hw = _setup()
    engine = OwnMemoryEngine(hw)
    model = memory_model(engine, WL)
    assert memory_model_name(model) == "own-memory engine"
    tuner = Tuner(inv, hw, engine, StudyConfig(
        bench=WL, n_ctx=8192, margin=512 * MiB, storage=None, pool_size=5, baselines=False, seed_trials=False,
        surrogate=False))
    assert tuner.space.estimate is tuner.estimate
    # a fill of CUDA0 that planner.memory fits (budget 16 GiB - 512 MiB), but the engine's own model does not
    params = {**tuner.space.default_params(), "fill.CUDA0": 0.9, "order": "last", "partial": True}
    sim_space = Tuner(inv, hw, SimEngine(hw), StudyConfig(
        bench=WL, n_ctx=8192, margin=512 * MiB, storage=None, pool_size=5, baselines=False, seed_trials=False)).space
    cand_sim = sim_space.decode(sim_space.fixed(params))
    assert cand_sim.fits
    assert sim_space.over_budget(engine.predict_memory(inv, cand_sim.plan, hw, WL)).startswith("CUDA0")
    cand = tuner.space.decode(tuner.space.fixed(params))
    # the engine's model judged it: it fills less (the fill targets and the check are the engine's), and fits
    assert cand.fits
    assert cand.memory.devices["CUDA0"].compute == estimate(inv, cand.plan, hw).devices["CUDA0"].compute + EXTRA
    assert (cand.plan.id, WL) in engine.asked
    assert cand.memory.gpu_total("CUDA0") <= tuner.space.room.gpus["CUDA0"]
    n_gpu = lambda p: sum(1 for t in inv.allocated() if t.is_expert and p.assignment.get(t.name) == "CUDA0")  # noqa: E731
    assert n_gpu(cand.plan) < n_gpu(cand_sim.plan)
    # the plan planner.memory fits is refused as a baseline would be: not run, over budget on CUDA0
    rec = tuner.measurer.plan_record("sim's fill", "test", cand_sim.plan)
    assert rec["runs"] == 0 and rec["error"].startswith("not run: over budget (CUDA0: needs")


def test_a_plan_the_engine_does_not_predict_is_judged_by_planner_memory():
    inv, hw = _setup()
    tuner = Tuner(inv, hw, OwnMemoryEngine(hw, none=True), StudyConfig(
        bench=WL, n_ctx=8192, margin=512 * MiB, storage=None, pool_size=5, baselines=False, seed_trials=False))
    params = {**tuner.space.default_params(), "fill.CUDA0": 1.0, "order": "last", "partial": True}
    cand = tuner.space.decode(tuner.space.fixed(params))
    assert cand.fits and cand.memory == estimate(inv, cand.plan, hw)


def test_a_timed_engine_times_each_run_and_passes_the_rest_through():
    """planner.engine_contract.TimedEngine (the GPU benchmarks plan their device calls with it): each run's seconds kept
    and reported, the plan time a default until three runs, then 1.2x their mean; name and optional methods pass
    through, so the tuner judges its plans with the inner engine's memory model."""
    from planner.engine_contract import TimedEngine
    from planner.propose import propose
    inv = load_preset("Qwen3-30B-A3B").inventory()
    hw = load_hardware("gpu-box").with_vram([16 * GiB])
    heard: list[float] = []
    engine = TimedEngine(SimEngine(hw), on_run=heard.append)
    assert engine.name == "sim" and memory_model(engine, BenchRun(512)) is estimate
    plan = propose(inv, hw)[0]
    assert engine.run_seconds(25.0) == 25.0
    for _ in range(3):
        assert engine.measure(inv, plan, BenchRun(512, 16)).ok
    assert heard == engine.times and len(heard) == 3 and all(t >= 0 for t in heard)
    assert engine.run_seconds(25.0) == 1.2 * sum(heard) / 3
