"""The autotuner on the sim engine: at least as good as the planner's first proposal, never runs a candidate over
budget, records failing runs (a crashing or OOM-ing engine) and goes on, raising its margin after an OOM."""
from __future__ import annotations

import pytest
from optuna.trial import TrialState

from planner.hardware import GiB, MiB, load_hardware
from planner.memory import estimate
from planner.plan import Knobs
from planner.presets import load_preset
from planner.propose import best_plans
from tuner.records import RECORD_VERSION, TrialRecord
from tuner.search import Tuner, StudyConfig, BenchRun
from planner.engine_contract import Engine, Measurement
from runtime.sim import SimEngine

MODEL = "Qwen3-30B-A3B:Q4_K_M"
WL = BenchRun(n_prompt=2048, n_gen=128, depth=0, repetitions=1)


def _study(engine_cls, objective: str, seed: int):
    """(inv, hw, engine, tuner): a study of MODEL on an RTX 4090 box cut to 16 GiB, 8192 tokens of context, a 512 MiB
    margin, a pool of 40 candidates, in memory; `engine_cls(hw)` runs it."""
    inv = load_preset(MODEL).inventory()
    hw = load_hardware("rtx4090-ddr5").with_vram([16 * GiB])
    engine = engine_cls(hw)
    tuner = Tuner(inv, hw, engine, StudyConfig(
        objective=objective, bench=WL, n_ctx=8192, margin=512 * MiB, storage=None, pool_size=40, seed=seed))
    return inv, hw, engine, tuner


class RecordingEngine(Engine):
    """The sim engine, remembering every plan it was asked to run and the tuner's margin at that moment."""
    name = "sim"

    def __init__(self, hw, margin_now=lambda: 512 * MiB):
        self.sim, self.calls, self.margin_now = SimEngine(hw), [], margin_now

    def measure(self, inv, plan, workload):
        self.calls.append((plan, self.margin_now()))
        return self.sim.measure(inv, plan, workload)


@pytest.mark.slow
def test_study_on_sim_beats_the_planners_first_proposal_and_never_runs_over_budget():
    inv, hw, engine, tuner = _study(RecordingEngine, "tg", seed=1)
    res = tuner.run(20)
    assert res.measured <= 20 and res.counts.get("complete", 0) >= 10
    first = best_plans(inv, hw, Knobs(n_ctx=8192), "mainline", "tg", 512 * MiB, n_prompt=2048)[0]
    first_tg = SimEngine(hw).measure(inv, first.plan, WL).tg_tps
    assert tuner.study.best_value >= first_tg
    for plan, margin in engine.calls:      # the memory model screened every run against VRAM - margin
        mem = estimate(inv, plan, hw)
        assert all(m.total <= hw.gpu(d).vram_bytes - margin for d, m in mem.devices.items() if d != "CPU")
    t = tuner.study.best_trial
    dup = TrialRecord.from_trial(t).duplicate_of
    rec = TrialRecord.from_trial(tuner.study.trials[t.number if dup is None else dup])   # a repeat points at its run
    assert rec.version == RECORD_VERSION and rec.plan_id and rec.plan().id == rec.plan_id
    assert rec.candidate is not None and rec.measured is not None and rec.terms is not None
    assert rec.commands["llama-server"].startswith("llama-server ")
    assert rec.measured.peak_bytes["CUDA0"] > 0
    assert tuner.study.user_attrs["cost_fit"]["n"] >= 10
    base = {b["kind"]: b for b in tuner.study.user_attrs["baselines"]}
    assert set(base) == {"cmoe", "fit-like", "ncmoe"}      # the sim engine has no --fit of its own
    assert base["fit-like"]["name"] == "--fit-like fill (imitation)" and base["ncmoe"]["ok"]
    assert tuner.study.best_value > base["cmoe"]["measured"]["tg_tps"]
    assert tuner.study.best_value >= base["ncmoe"]["measured"]["tg_tps"]


class FlakyEngine(RecordingEngine):
    """A test double of the Engine protocol: large ubatches "run out of memory", q8_0 KV "segfaults" (raises)."""

    def measure(self, inv, plan, workload):
        self.calls.append((plan, self.margin_now()))
        if plan.knobs.n_ubatch >= 2048:
            return Measurement.failed("CUDA error: out of memory (cudaMalloc failed)", peak_bytes={"CUDA0": 16 * GiB})
        if plan.knobs.type_k == "q8_0":
            raise RuntimeError("segmentation fault in the fake engine")
        return self.sim.measure(inv, plan, workload)


@pytest.mark.slow
def test_failures_are_recorded_and_the_study_goes_on_with_a_larger_margin():
    inv, hw, engine, tuner = _study(FlakyEngine, "pp", seed=2)
    engine.margin_now = lambda: tuner.margin
    tuner.run(24)
    trials = tuner.study.get_trials(deepcopy=False)
    failed = [t for t in trials if t.state == TrialState.FAIL]
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    assert failed and len(done) >= 5
    records = [TrialRecord.from_trial(t) for t in failed]
    errors = {r.measured.error for r in records}
    assert any("out of memory" in e for e in errors)
    assert all(r.measured.ok is False for r in records)
    # an OOM raised the margin, persisted for a resumed study; later runs respect it
    attrs = tuner.study.user_attrs
    assert attrs["margin_bytes"] > 512 * MiB and attrs["margin_events"]
    raised = [i for i, (_, m) in enumerate(engine.calls) if m > 512 * MiB]
    assert raised
    for plan, margin in engine.calls[raised[0]:]:
        mem = estimate(inv, plan, hw)
        assert mem.devices["CUDA0"].total <= hw.gpu("CUDA0").vram_bytes - margin
    # a plan that failed is never run again
    ids = [p.id for p, _ in engine.calls]
    failed_ids = {r.plan_id for r in records}
    assert all(ids.count(i) == 1 for i in failed_ids)
