"""A study whose every run failed ends with a message naming the real cause (issue 43, item 6): runs that crashed
are counted as crashes with their signal, not answered with "give more --gpu memory"; a study whose runs all ran
out of memory still gets that advice. Stand-in engines whose measure returns failed Measurements, as the llama.cpp
engine does (runtime/llamacpp_output.py classify_failure: "crashed with SIGSEGV: ...")."""
from __future__ import annotations

import pytest

from cli_outcome import run_cli
from offload_tuner.app import tune as tune_app
from planner.engine_contract import Engine, Measurement
from tuner.failures import MEMORY, Failures, failure_kind

MODEL = "preset:Qwen3-30B-A3B:Q4_K_M"
SEGV = "crashed with SIGSEGV: ggml_cuda_compute_forward: MUL_MAT failed"


class FailingEngine(Engine):
    """Every run fails with `error`; named "sim" so the study takes the sim engine's traits."""
    name = "sim"

    def __init__(self, error: str):
        self.error, self.calls = error, 0

    def measure(self, inv, plan, workload):
        self.calls += 1
        return Measurement.failed(self.error, peak_bytes={"CUDA0": 1 << 30})


def _tune(tmp_path, monkeypatch, error: str):
    engine = FailingEngine(error)
    monkeypatch.setattr(tune_app, "load_engine", lambda opts, hw: engine)
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 's.db'}"
    o = run_cli(["tune", MODEL, "--engine", "sim", "--gpu", "16GiB", "--trials", "3", "--study", "s", "--storage",
                 url, "--pool", "0", "--quiet", "--no-report", "--objective", "tg"], time_limit_s=300)
    return o, engine, url


def test_a_study_whose_every_run_crashed_names_the_crashes(tmp_path, monkeypatch):
    o, engine, url = _tune(tmp_path, monkeypatch, SEGV)
    assert engine.calls >= 3
    assert o.kind == "error" and o.rc == 2, (o.kind, o.rc, o.stderr[-3000:])
    line = o.stderr
    assert "every run failed" in line and "crashed (SIGSEGV: ggml_cuda_compute_forward: MUL_MAT failed)" in line
    assert "0 out of memory" in line and "--gpu memory" not in line and "no config fitted" not in line, line
    assert f"offload-tuner report s --storage {url}" in line
    # and that report says the same
    o = run_cli(["report", "s", "--storage", url, "--out", str(tmp_path / "rep")], time_limit_s=120)
    assert o.kind == "ok", (o.kind, o.rc, o.stderr[-3000:])
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "no finished trial: 0 complete" in md and "crashed (SIGSEGV: ggml_cuda_compute_forward" in md, md[:600]


def test_a_study_whose_every_run_ran_out_of_memory_still_asks_for_memory(tmp_path, monkeypatch):
    o, _, _ = _tune(tmp_path, monkeypatch, "out of memory: cudaMalloc of 4096 MiB on CUDA0 failed")
    assert o.kind == "error" and o.rc == 2, (o.kind, o.rc, o.stderr[-3000:])
    assert "no config fitted" in o.stderr and "give more --gpu memory" in o.stderr, o.stderr


@pytest.mark.parametrize("error, kind", [
    (SEGV, "crashed"),
    ("crashed with SIGKILL (SIGKILL often means the host ran out of memory)", "crashed"),
    ("timed out after 600 s; the process group was killed", "timed out"),
    ("out of memory on CUDA0: needs 17.00 GiB, has 16.00 GiB", MEMORY),
    ("measured peak 15.90 GiB on CUDA0 over the budget 15.50 GiB (VRAM 16.00 GiB - margin 512 MiB)", MEMORY),
    ("could not load the model: tensor data is not within the file bounds", "failed"),
])
def test_failure_kinds(error, kind):
    assert failure_kind(error) == kind


def test_failures_text_counts_each_kind_with_its_commonest_reasons():
    f = Failures.of([SEGV] * 11 + ["crashed with SIGABRT: GGML_ASSERT(x) failed"] + ["out of memory: cudaMalloc"])
    assert f.text() == ("12 crashed (11x SIGSEGV: ggml_cuda_compute_forward: MUL_MAT failed; SIGABRT: GGML_ASSERT(x) "
                        "failed), 1 out of memory (out of memory: cudaMalloc)")
    assert Failures.of([SEGV]).text() == ("1 crashed (SIGSEGV: ggml_cuda_compute_forward: MUL_MAT failed), "
                                          "0 out of memory")
