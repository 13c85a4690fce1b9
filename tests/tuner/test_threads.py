"""The thread probe (tuner/threads.py, issue 41): a stand-in engine whose default thread count generates slowly,
as llama.cpp's default -t 64 did on the 64-vCPU four-GPU VM, makes the study settle at the faster count; a
default within THREADS_GAIN is kept; a failed run is no count to take."""
from __future__ import annotations

from planner.engine_contract import Engine, Measurement
from planner.loader import load_model
from planner.plan import Knobs, Plan
from tuner.threads import THREADS_GAIN, ThreadProbe, decide, probe_counts, probe_threads

INV = load_model("preset:Qwen3-30B-A3B:Q4_K_M")
PLAN = Plan(model_id="qwen3", assignment={t.name: "CPU" for t in INV.allocated()}, knobs=Knobs(n_threads=8))


class ThreadsStandIn(Engine):
    """TG by thread count; 0 is the engine's default (no -t). Records each run's -t."""

    def __init__(self, tg_by_count: dict[int, float]):
        self.tg, self.runs = tg_by_count, []

    def measure(self, inv, plan, workload):
        n = plan.knobs.n_threads
        self.runs.append((n, workload.n_prompt, workload.n_gen))
        if n not in self.tg:
            return Measurement.failed("llama-bench crashed (SIGSEGV)")
        return Measurement(0.0, self.tg[n])


def test_a_slow_default_is_left_for_the_faster_count():
    engine = ThreadsStandIn({0: 0.62, 32: 12.8, 48: 9.1})       # threads_h200x4: -t 64 (default) against 32
    lines: list[str] = []
    probe = probe_threads(engine.measure, INV, PLAN, counts=(0, 32, 48), say=lines.append)
    assert probe.pick == 32 and engine.runs == [(0, 0, 16), (32, 0, 16), (48, 0, 16)]   # short TG runs, no prompt
    assert probe.line() == ("threads: llama.cpp's default -t generated 0.6 t/s here; -t 32 12.8 t/s: every command "
                            "here carries -t 32")
    assert lines == ["# threads: the default -t: 0.6 t/s", "# threads: -t 32: 12.8 t/s", "# threads: -t 48: 9.1 t/s"]
    assert ThreadProbe.from_dict(probe.to_dict()) == probe


def test_a_default_within_the_gain_is_kept():
    assert decide({0: 10.0, 8: 10.0 * THREADS_GAIN * 0.99, 12: 9.0}) == 0
    assert decide({0: 10.0, 8: 10.0 * THREADS_GAIN}) == 8
    probe = probe_threads(ThreadsStandIn({0: 30.5, 16: 31.0, 24: 30.0}).measure, INV, PLAN, counts=(0, 16, 24))
    assert probe.pick == 0 and "no other count 1.10x that" in probe.line()


def test_failed_runs_are_no_count_to_take():
    probe = probe_threads(ThreadsStandIn({16: 20.0}).measure, INV, PLAN, counts=(0, 16, 24))
    assert probe.pick == 16 and set(probe.errors) == {0, 24} and "SIGSEGV" in probe.errors[0]
    assert "its run failed" in probe.line()
    assert probe_threads(ThreadsStandIn({}).measure, INV, PLAN, counts=(0, 8)).pick == 0


def test_the_counts_are_the_default_half_and_three_quarters():
    assert probe_counts(64) == (0, 32, 48)
    assert probe_counts(16) == (0, 8, 12)
    assert probe_counts(2) == (0, 1)                  # one core each: 1 once
    assert probe_counts(1) == (0,)
