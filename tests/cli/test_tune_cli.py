"""`tune`, `report` and `demo` as a user runs them: kill -9 in the middle of a study loses no finished trial and the
study resumes by name; the demo writes its report; bad input is one line and exit 2."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from offload_tuner import cli
from planner import engine_registry

ROOT = Path(__file__).resolve().parents[2]
MODEL = "preset:Qwen3-30B-A3B:Q4_K_M"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _tune_cmd(url: str, trials: int) -> list[str]:
    return [sys.executable, "-m", "offload_tuner.cli", "tune", MODEL, "--engine", "sim", "--gpu", "16GiB", "--trials",
            str(trials), "--study", "k", "--storage", url, "--pool", "0", "--quiet", "--no-report", "--objective", "tg"]


def _complete(db: Path) -> int:
    if not db.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as con:
            return con.execute("SELECT COUNT(*) FROM trials WHERE state = 'COMPLETE'").fetchone()[0]
    except sqlite3.OperationalError:       # tables not created yet
        return 0


def _finished(url: str) -> tuple[dict[int, tuple[str, tuple[float, ...] | None]], float]:
    import optuna
    from tuner.storage import make_storage
    study = optuna.load_study(study_name="k", storage=make_storage(url))
    trials = {t.number: (t.state.name, tuple(t.values) if t.values else None)
              for t in study.get_trials(deepcopy=False) if t.state.is_finished()}
    return trials, study.best_value


@pytest.mark.slow
def test_sigkill_mid_study_loses_no_finished_trial_and_resumes(tmp_path):
    db = tmp_path / "k.db"
    url = f"sqlite:///{db}"
    proc = subprocess.Popen(_tune_cmd(url, 500), cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.time() + 90
        while _complete(db) < 8:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.time() < deadline, "the study made no progress"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)          # kill -9 in the middle of the study
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    before, best_before = _finished(url)
    assert sum(1 for s, _ in before.values() if s == "COMPLETE") >= 8

    r = subprocess.run(_tune_cmd(url, 4), cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    after, best_after = _finished(url)
    for number, rec in before.items():             # every trial finished before the kill is intact
        assert after[number] == rec
    assert best_after >= best_before
    assert sum(1 for s, _ in after.values() if s == "COMPLETE") > sum(1 for s, _ in before.values() if s == "COMPLETE")

    # the report reads everything from the storage
    out = tmp_path / "rep"
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(["report", "k", "--storage", url, "--out", str(out), "--json"]) == 0
    s = json.loads(buf.getvalue())
    assert s["best"]["tg"]["tg_tps"] == pytest.approx(best_after)
    assert "CUDA0" in s["best"]["tg"]["devices"] and s["best"]["tg"]["measurement"]["ok"]
    for name in ("summary.md", "summary.html", "trials.csv", "report.json", "throughput_vs_vram.png",
                 "throughput_vs_vram.svg", "pareto.svg", "history.png"):
        assert (out / name).stat().st_size > 0


@pytest.mark.slow
def test_demo_runs_the_whole_job(tmp_path):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "offload_tuner.cli", "demo", "--quiet"], cwd=tmp_path, env=ENV,
                       capture_output=True, text=True, timeout=180)
    wall = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr
    assert "best TG" in r.stdout and "llama-server" in r.stdout and "llama-bench" in r.stdout
    rep = tmp_path / "reports" / "demo"
    for name in ("summary.md", "summary.html", "trials.csv", "report.json", "throughput_vs_vram.png",
                 "throughput_vs_vram.svg", "pareto.png", "history.svg"):
        assert (rep / name).stat().st_size > 0, name
    s = json.loads((rep / "report.json").read_text())
    assert s["counts"]["complete"] >= 50 and {b["name"] for b in s["baselines"]} >= {"-ngl 49 -cmoe"}
    assert (tmp_path / "studies" / "demo.db").exists()
    print(f"demo wall time {wall:.1f} s")


def _err(capsys, argv: list[str]) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("offload-tuner: error:") and "\n" not in err
    return err


def test_tune_bad_input_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch = engine_registry.ENGINES["torch"]
    monkeypatch.setitem(engine_registry.ENGINES, "torch",
                        replace(torch, factory="runtime.no_such_engine_here:from_options"))
    assert "engine torch is not available yet" in _err(capsys, ["tune", MODEL, "--engine", "torch", "--gpu", "16GiB"])
    assert "not allowed" in _err(capsys, ["tune", MODEL, "--gpu", "16GiB", "--objective", "__import__('os').getcwd()"])
    assert "--trials" in _err(capsys, ["tune", MODEL, "--gpu", "16GiB", "--trials", "0", "--no-report"])
    assert "--kv-types" in _err(capsys, ["tune", MODEL, "--gpu", "16GiB", "--kv-types", "q9_9"])
    assert "no study" in _err(capsys, ["report", "nope", "--storage", f"sqlite:///{tmp_path / 'none.db'}"])
    assert not (tmp_path / "none.db").exists()


def test_tune_ttft_limit_is_the_workloads_and_stays_with_the_study(tmp_path, capsys):
    """--ttft 2.5s: stored with the study's workload and its request time (a resume scores the same); a bad value
    or another objective is one line, exit 2."""
    import optuna

    from tuner.records import StudyRecord
    storage = f"sqlite:///{tmp_path / 's.db'}"
    argv = ["tune", MODEL, "--gpu", "12GiB", "--workload", "rag", "--ttft", "2.5s", "--trials", "4", "--pool", "20",
            "--storage", storage, "--study", "s", "--no-report", "--quiet"]
    assert cli.main(argv) == 0
    rec = StudyRecord.of(optuna.load_study(study_name="s", storage=storage))
    assert rec.request_time.ttft_limit_s == 2.5
    capsys.readouterr()
    assert "--ttft 'soon'" in _err(capsys, [*argv[:6], "--ttft", "soon", "--study", "t", "--no-report"])
    assert "needs the time objective" in _err(capsys, [*argv, "--objective", "tg", "--study", "u"])
