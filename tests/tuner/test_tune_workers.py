"""Studies shared and resumed through a real database: two `tune` workers on one PostgreSQL study (a throwaway
server started for the test: the postgres_url fixture in conftest.py), and a worker killed mid-trial whose RUNNING
trial a later worker fails and retries (the storage's heartbeat)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from offload_tuner import cli
from tuner import search, storage as storage_module
from tuner.storage import make_storage
from tuner.records import TrialRecord
from planner.hardware import GiB, load_hardware
from planner.presets import load_preset
from runtime.sim import SimEngine

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
MODEL = "preset:Qwen3-30B-A3B:Q4_K_M"


def _tune_cmd(url: str, trials: int, seed: int) -> list[str]:
    return [sys.executable, "-m", "offload_tuner.cli", "tune", MODEL, "--engine", "sim", "--gpu", "16GiB", "--trials",
            str(trials), "--study", "shared", "--storage", url, "--pool", "0", "--quiet", "--no-report",
            "--objective", "tg", "--seed", str(seed)]


@pytest.mark.slow
def test_two_workers_share_one_postgresql_study(postgres_url, tmp_path):
    import optuna
    procs = [subprocess.Popen(_tune_cmd(postgres_url, 6, seed), cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for seed in (1, 2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    study = optuna.load_study(study_name="shared", storage=make_storage(postgres_url))
    trials = study.get_trials(deepcopy=False)
    assert len({t.number for t in trials}) == len(trials)
    assert not [t.number for t in trials if t.state == optuna.trial.TrialState.RUNNING]
    # each worker added its 6 engine runs to the one study (a trial that repeats a plan, or took a baseline's
    # run, made none)
    runs = [t for t in trials if TrialRecord.from_trial(t).engine_run]
    assert len(runs) >= 12
    done = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert study.best_value == max(t.value for t in done)
    # the report reads the shared study from the database
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(["report", "shared", "--storage", postgres_url, "--out", str(tmp_path / "rep"), "--json"]) == 0
    assert json.loads(buf.getvalue())["best"]["tg"]["tg_tps"] == pytest.approx(study.best_value)


@pytest.mark.slow
def test_a_killed_workers_running_trial_is_failed_and_retried(tmp_path, monkeypatch):
    """A worker killed mid-trial leaves a RUNNING trial whose heartbeat stops; once the grace period has passed, the
    next worker fails it and queues it again (one retry, run in its turn among the queued trials)."""
    import optuna
    from optuna.storages import RetryFailedTrialCallback
    monkeypatch.setattr(storage_module, "GRACE_S", 1)
    monkeypatch.setattr(storage_module, "HEARTBEAT_S", 1)
    url = f"sqlite:///{tmp_path / 'k.db'}"
    inv = load_preset("Qwen3-30B-A3B:Q4_K_M").inventory()
    hw = load_hardware("rtx4090-ddr5").with_vram([16 * GiB])
    wl = search.BenchRun(n_prompt=512, n_gen=64, depth=0, repetitions=1)

    def tuner() -> search.Tuner:
        return search.Tuner(inv, hw, SimEngine(hw), search.StudyConfig(
            bench=wl, n_ctx=8192, storage=url, study_name="k", pool_size=40, baselines=False, objective="tg"))
    tuner().run(3)
    # what a killed worker leaves: a trial RUNNING with a heartbeat that stopped
    storage = make_storage(url)
    study = optuna.load_study(study_name="k", storage=storage)
    with pytest.warns(UserWarning, match="Heartbeat"):     # optuna: ask() is not optimize()
        dead = study.ask()
    storage.record_heartbeat(dead._trial_id)
    time.sleep(2.5)
    tuner().run(2)
    trials = optuna.load_study(study_name="k", storage=make_storage(url)).get_trials(deepcopy=False)
    by_number = {t.number: t for t in trials}
    assert by_number[dead.number].state == optuna.trial.TrialState.FAIL
    retries = [t for t in trials if RetryFailedTrialCallback.retried_trial_number(t) == dead.number]
    assert len(retries) == 1
    assert retries[0].state in (optuna.trial.TrialState.WAITING, optuna.trial.TrialState.COMPLETE)
    assert not [t.number for t in trials if t.state == optuna.trial.TrialState.RUNNING]
